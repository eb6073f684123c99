// A step list's block GEMMs (Step::parts, protocol/schedule.h) as calls of FlagGemm's and
// SignalGemm's kernels (flag_gemm.h): what the CUDA communicator enqueues, and the tools that
// time its schedules (benchmarks/tools/solo_schedule.cu) launch, built in one place.
#pragma once

#include <cstdint>

#include "cuda/gemm/flag_gemm.h"
#include "protocol/schedule.h"

namespace jax_ub {

// A kGemm step over the group's row blocks as a call of one GEMM: every block of src into dst,
// its order filled in by the caller.
inline BlockGemmCall BlockCall(const Schedule& sched, const Step& step, const CallShape& shape,
                               const void* w, bool w_transposed, const void* src, void* dst) {
  BlockGemmCall c;
  c.a = src;
  c.w = w;
  c.w_transposed = w_transposed;
  c.d = dst;
  c.blocks = sched.size;
  c.block_rows = step.rows / sched.size;
  c.k = shape.k;
  c.n = shape.n;
  return c;
}

// A kGemm step with `signals` as SignalGemm's call: the blocks in Schedule::SignalGemmOrder,
// each peer's raising flags[block] to `epoch` once written (our own is summed here, not
// pushed); counts: the kernel's tile counters, one word per block.
inline SignalGemmCall SignalCall(const Schedule& sched, const Step& step, const CallShape& shape,
                                 const void* w, bool w_transposed, const void* src, void* dst,
                                 uint64_t* flags, unsigned long long* counts, uint64_t epoch) {
  SignalGemmCall c;
  static_cast<BlockGemmCall&>(c) = BlockCall(sched, step, shape, w, w_transposed, src, dst);
  c.flags = flags;
  c.counts = counts;
  c.target = epoch;
  for (int j : sched.SignalGemmOrder(step.parts)) {
    c.order |= uint64_t(j) << (4 * c.count++);
    if (j != sched.rank) c.signalled |= 1u << j;
  }
  return c;
}

}  // namespace jax_ub
