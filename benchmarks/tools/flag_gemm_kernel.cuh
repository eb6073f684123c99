// flag_gemm_kernel.cuh: the GEMMs of benchmarks/tools/flag_gemm.cu and paced_gemm.cu (their
// drivers: data, checks, timing, main). The flag-waiting GEMM is the library's
// (src/cuda/gemm/flag_gemm_kernel.cuh: a CUTLASS 4.2 SM90 bf16 GEMM whose persistent tile
// scheduler waits, before each output tile, for the flag of the tile's row block), here with
// 32-bit flags and a 2 s timeout per wait, after which it writes 1 + block to an error word and
// gives up (the drivers then report TIMEOUT instead of hanging).
// Also here: CutlassOp (one initialized GEMM), Entry (a named config the driver can build with
// the flag scheduler or CUTLASS's stock one), and Lt, the cuBLASLt GEMMs the drivers compare
// with: the whole of D, or one contiguous span of its rows.
#pragma once
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/gemm/flag_gemm_kernel.cuh"
#include "cuda_tool.h"  // the tools' checks (CUDA, cuBLASLt) and random bf16 operands
#include "cutlass/version.h"

namespace jax_ub_tool {
inline void Check(cutlass::Status s, const char* what) {
  if (s != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cutlass::cutlassGetStatusString(s));
    std::exit(1);
  }
}
}  // namespace jax_ub_tool
#define CHECK(x) jax_ub_tool::Check((x), #x)

// A bad argument or an unexpected state: say which and stop.
[[noreturn]] inline void Fail(const char* what, const char* msg) {
  std::fprintf(stderr, "%s: %s\n", what, msg);
  std::exit(1);
}

namespace fg {

using jax_ub::flag_gemm::bf16;
using jax_ub::flag_gemm::LoadAcquire;
using jax_ub::flag_gemm::Now;
using FlagScheduler = jax_ub::flag_gemm::FlagScheduler<int>;
template <int TM, int TN, int CM, bool Pingpong, class SchedTag>
using Config = jax_ub::flag_gemm::Config<TM, TN, CM, Pingpong, SchedTag>;

__device__ __forceinline__ void StoreRelease(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

struct Problem {
  int m, k, n, blocks;
  uint64_t order;
  int sm_count;
  int slots = 0;                           // the blocks computed, the first of `order` (0: all)
  jax_ub::flag_gemm::GiveUp give_up = {};  // the library's waits' way out (none: the tools' own)
};

struct Op {  // one initialized GEMM (fixed pointers); run() enqueues one call
  virtual ~Op() = default;
  virtual void Run(cudaStream_t s) = 0;
};

// With an OwnBlock config and `own`, block `own_block`'s rows of A are read from `own`, with no
// wait for its flag (as the library's FlagGemm).
template <class Cfg>
struct CutlassOp : Op {
  typename Cfg::Gemm gemm;
  CutlassOp(const Problem& p, const bf16* a, const bf16* b, bf16* d, const int* flags, int* err,
            const bf16* own = nullptr, int own_block = -1) {
    using K = typename Cfg::Kernel;
    auto args = jax_ub::flag_gemm::MakeArguments<Cfg>(p.m, p.k, p.n, a, b, d, 0, p.sm_count);
    if constexpr (!std::is_same_v<typename Cfg::Mainloop, typename Cfg::BuiltMainloop>) {
      if (own != nullptr) {
        args.mainloop.own = own;
        args.mainloop.own_rows = p.m / p.blocks;
        args.mainloop.own_first_row = own_block * args.mainloop.own_rows;
      }
    } else if (own != nullptr) {
      Fail("CutlassOp", "own rows given to a config that reads A alone");
    }
    if constexpr (std::is_same_v<typename K::TileSchedulerTag, FlagScheduler>) {
      args.scheduler.flags = flags;
      args.scheduler.error = err;
      args.scheduler.blocks = p.blocks;
      args.scheduler.order = p.order;
      args.scheduler.slots = p.slots;
      args.scheduler.timeout_ns = 2000000000ull;
      args.scheduler.give_up = p.give_up;
      if (own != nullptr) args.scheduler.ready_block = own_block;
    }
    if (Cfg::Gemm::get_workspace_size(args) != 0) Fail("workspace", "unexpected");
    CHECK(gemm.can_implement(args));
    CHECK(gemm.initialize(args, nullptr));
  }
  void Run(cudaStream_t s) override { CHECK(gemm.run(s)); }
};

struct ConfigEntry {
  const char* name;
  int row_unit;  // tile M * cluster M: a row block must be a multiple of it
  std::function<std::unique_ptr<Op>(const Problem&, const bf16*, const bf16*, bf16*, const int*,
                                    int*, bool stock)>
      make;
};

template <int TM, int TN, int CM, bool PP>
ConfigEntry Entry(const char* name) {
  return {name, TM * CM,
          [](const Problem& p, const bf16* a, const bf16* b, bf16* d, const int* f, int* e,
             bool stock) -> std::unique_ptr<Op> {
            if (stock)
              return std::make_unique<
                  CutlassOp<Config<TM, TN, CM, PP, cutlass::gemm::PersistentScheduler>>>(p, a, b, d,
                                                                                         f, e);
            return std::make_unique<CutlassOp<Config<TM, TN, CM, PP, FlagScheduler>>>(p, a, b, d, f,
                                                                                      e);
          }};
}

// cuBLASLt, row-major D = A B described column-major as D^T[n,m] = B^T[n,k] A^T[k,m]; a plan
// (layouts, the heuristic's first pick) per row span [row0, row0 + rows) of A and D.
struct LtSpan {
  int row0, rows;
  cublasLtMatrixLayout_t la, ld;
  cublasLtMatmulAlgo_t algo;
};
struct Lt {
  const Problem& p;
  const bf16* b;
  void* ws;
  size_t ws_size;
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lb = nullptr;
  int sm_target = 0;  // > 0: the SMs cuBLASLt may use (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET)
  void Create() {
    CHECK(cublasLtCreate(&h));
    CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (sm_target > 0)
      CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target,
                                           sizeof(sm_target)));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.n, p.k, p.n));
  }
  LtSpan Plan(int row0, int rows) {
    LtSpan s{row0, rows, nullptr, nullptr, {}};
    CHECK(cublasLtMatrixLayoutCreate(&s.la, CUDA_R_16BF, p.k, rows, p.k));
    CHECK(cublasLtMatrixLayoutCreate(&s.ld, CUDA_R_16BF, p.n, rows, p.n));
    uint32_t align = 256;  // of the span's A and D pointers (cudaMalloc's are 256-aligned)
    while (align > 2 && (int64_t(row0) * p.k * 2 % align || int64_t(row0) * p.n * 2 % align))
      align /= 2;
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ws_size, sizeof(ws_size)));
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, lb, s.la, s.ld, s.ld, pref, 1, &heur, &found));
    if (found < 1) Fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm");
    CHECK(cublasLtMatmulPreferenceDestroy(pref));
    s.algo = heur.algo;
    return s;
  }
  void Run(const LtSpan& s, const bf16* a, bf16* d, cudaStream_t st) const {
    const float one = 1.0f, zero = 0.0f;
    bf16* ds = d + int64_t(s.row0) * p.n;
    CHECK(cublasLtMatmul(h, desc, &one, b, lb, a + int64_t(s.row0) * p.k, s.la, &zero, ds, s.ld, ds,
                         s.ld, &s.algo, ws, ws_size, st));
  }
  void Destroy(std::vector<LtSpan>& spans) {
    for (auto& s : spans)
      for (auto l : {s.la, s.ld}) CHECK(cublasLtMatrixLayoutDestroy(l));
    CHECK(cublasLtMatrixLayoutDestroy(lb));
    CHECK(cublasLtMatmulDescDestroy(desc));
    CHECK(cublasLtDestroy(h));
  }
};

}  // namespace fg
