// signal_gemm.cuh: the library's SignalGemm (src/cuda/gemm/flag_gemm.h) for the tool that times
// it (signal_gemm.cu): the reduce-scatter's partials in one persistent CUTLASS GEMM, its blocks
// in push order (FlagTileScheduler's order, with no flags to wait for), each block's flag raised
// by the epilogue once the block is written (src/cuda/gemm/signal_epilogue.cuh). The push of a
// block then waits on its flag (a stream memory operation, no SM) instead of for a GEMM's end.
// As in the library, Run initializes the kernel at every call (its flags' target is the call's
// number: each SignalOp has flags and counters of its own); RunCached builds its parameters once.
#pragma once

#include <cstdint>

#include "flag_gemm_kernel.cuh"

namespace sg {

using fg::bf16;
using Signals = jax_ub::flag_gemm::Signals;

// The library's configuration (row-major w).
using SignalConfig =
    jax_ub::flag_gemm::Config<128, 128, 2, true, jax_ub::flag_gemm::FlagScheduler<uint64_t>,
                              cutlass::layout::RowMajor, false, true>;

// D[m, n] = A[m, k] @ B[k, n] (row-major bf16) in `blocks` row blocks taken in `order` (block
// order[s] in bits [4s, 4s + 4)), signalling as `s` says; call c raises the flags to c.
struct SignalOp : fg::Op {
  SignalConfig::Gemm gemm;
  SignalConfig::Gemm::Arguments args;
  uint64_t calls = 0;
  SignalOp(int m, int k, int n, int blocks, uint64_t order, int sm_count, const bf16* a,
           const bf16* b, bf16* d, const Signals& s) {
    args = jax_ub::flag_gemm::MakeArguments<SignalConfig>(m, k, n, a, b, d, 0, sm_count);
    args.scheduler.blocks = blocks;
    args.scheduler.order = order;
    args.epilogue.signals = s;
    if (SignalConfig::Gemm::get_workspace_size(args) != 0) Fail("SignalOp", "asks for a workspace");
    CHECK(gemm.can_implement(args));
  }
  void Run(cudaStream_t st) override {
    args.epilogue.signals.target = ++calls;
    CHECK(gemm.initialize(args, nullptr, st));
    CHECK(gemm.run(st));
  }
  // The same call from kernel parameters built at the first call, the target patched in.
  void RunCached(cudaStream_t st) {
    if (!cached) {
      CHECK(gemm.initialize(args, nullptr, st));
      params = gemm.params();
      cached = true;
    }
    params.epilogue.signals.target = ++calls;
    CHECK(SignalConfig::Gemm::run(params, st));
  }

 private:
  SignalConfig::Gemm::Params params;
  bool cached = false;
};

}  // namespace sg
