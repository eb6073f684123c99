// FlagGemm: one GEMM over an all-gather's row blocks that takes each block once its flag says
// it has landed, waiting inside the kernel (flag_gemm_kernel.cuh) instead of between GEMMs.
// Where chunks land one by one (the all-gather in turn, Schedule::AllGatherFlagGemm), library
// GEMMs must either wait for a run of chunks or run a small GEMM a chunk, and each GEMM ends in
// a partial wave of tiles; this one persistent kernel keeps every SM on the next landed tiles.
// Hopper only (sm_90a: wgmma and TMA), bf16, no epilogue; built where CUTLASS's headers are
// found (CMakeLists.txt), else FlagGemmBuilt() is false and the schedule keeps its GEMMs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol/dtype.h"
#include "protocol/status.h"

namespace jax_ub {

// d[blocks * block_rows, n] = a[blocks * block_rows, k] @ w for the row blocks `order` names,
// in that order (block order[s] in bits [4s, 4s + 4), `count` of them); blocks in no slot are
// left as they are. a, d row-major bf16; w [k, n] row-major bf16, or its transpose [n, k] where
// `w_transposed`.
struct BlockGemmCall {
  const void* a = nullptr;
  const void* w = nullptr;
  bool w_transposed = false;
  void* d = nullptr;
  int64_t block_rows = 0, k = 0, n = 0;
  int blocks = 0;
  uint64_t order = 0;
  int count = 0;
};

// FlagGemm: each block once flags[block] holds at least `target`, but block `own_block`,
// read from `own` instead of a (block_rows x k, row-major bf16, the op's input), with no wait.
struct FlagGemmCall : BlockGemmCall {
  const void* own = nullptr;
  int own_block = -1;
  const uint64_t* flags = nullptr;  // device memory, one word per block
  uint64_t target = 0;
  // Where the watchdog fires the call (*fired == target: release.h's board, host-mapped), the
  // waits give up and raise *health (the slot's health word): nullptr, never.
  const uint64_t* fired = nullptr;
  uint64_t* health = nullptr;
};

// SignalGemm: waiting for nothing, raising flags[block] to `target` once a block whose bit is
// set in `signalled` is written: the reduce-scatter's partials in one GEMM, each pushed as its
// flag rises (Schedule::ReduceScatterSignalGemm). counts: one word per block, zero between calls
// (each block's last tile resets its own).
struct SignalGemmCall : BlockGemmCall {
  uint64_t* flags = nullptr;             // device memory, one word per block
  unsigned long long* counts = nullptr;  // device memory, one word per block
  uint32_t signalled = 0;
  uint64_t target = 0;
};

// A row block must be a multiple of a cluster's rows (no tile spans two blocks); at most 16
// blocks (the order's 4-bit fields).
constexpr int64_t kFlagGemmRowUnit = 256;
constexpr int kFlagGemmMaxBlocks = 16;

// Whether this build has the kernel (CUTLASS's headers were found at build time).
bool FlagGemmBuilt();

// Whether a call of these types and shape fits the kernel: bf16 throughout, no epilogue, row
// blocks of a multiple of kFlagGemmRowUnit rows, k and n multiples of 8 (TMA's 16 bytes),
// 2 to kFlagGemmMaxBlocks blocks, every extent within int.
inline bool FlagGemmFits(DType in, DType w, DType out, bool epilogue, int64_t block_rows, int64_t k,
                         int64_t n, int blocks) {
  constexpr int64_t kIntMax = 2147483647;
  return in == DType::kBF16 && w == DType::kBF16 && out == DType::kBF16 && !epilogue &&
         block_rows > 0 && block_rows % kFlagGemmRowUnit == 0 && k > 0 && k % 8 == 0 && n > 0 &&
         n % 8 == 0 && blocks >= 2 && blocks <= kFlagGemmMaxBlocks &&
         block_rows * blocks <= kIntMax && k <= kIntMax && n <= kIntMax;
}

// Enqueues `c` on `stream` of `device` (a Hopper GPU: compute capability 9.0), on its
// `sm_count` SMs. Invalid arguments (a shape FlagGemmFits refuses, an own block out of range,
// a build without the kernel) are an error, never a launch.
Status LaunchFlagGemm(const FlagGemmCall& c, int device, int sm_count, cudaStream_t stream);
// The same for `c`, under the same conditions.
Status LaunchSignalGemm(const SignalGemmCall& c, int device, int sm_count, cudaStream_t stream);

// Loads both kernels' code on the current device now (see CudaCommunicator: no lazy loading
// at a first launch while a stream spins on a peer); nothing where the build has none.
Status PreloadFlagGemms();

}  // namespace jax_ub
