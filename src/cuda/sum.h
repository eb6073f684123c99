// The reduction that ends GEMM+RS: the partials every rank computed for this rank, summed
// on its GPU. Its own unit so that the diagnostics in benchmarks/tools/ time the same kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol/dtype.h"
#include "protocol/schedule.h"
#include "protocol/status.h"

namespace jax_ub {

// out[i] = addend[i] (float32, where not null) + the sum over the partials j set in `which`
// (bit j, in ascending order) of parts[j * stride + i] (type `t`), accumulated in float32 in
// that order, so results do not depend on which partial landed first; `out` of type `t`, or
// float32 with `out_f32` (a partial sum, added to later). Partials at any alignment (one of
// an odd number of elements starts the next mid-word); float32 arrays 4-byte aligned.
// Enqueued on `stream`.
Status LaunchSum(DType t, const void* parts, int64_t stride, uint64_t which, const float* addend,
                 int64_t count, void* out, bool out_f32, cudaStream_t stream);
// A kSum step (protocol/schedule.h) of a call with `n` output columns and outputs of type
// `t`, its refs resolved to `src`, `addend` (null where it has none) and `dst`.
Status LaunchSumStep(DType t, const Step& step, int64_t n, const void* src, const void* addend,
                     void* dst, cudaStream_t stream);
// The same over partials 0..nparts-1 (1 to 64) laid end to end: stride `count`, no addend.
Status LaunchSum(DType t, const void* parts, int64_t count, int nparts, void* out,
                 cudaStream_t stream);

// Loads the sum's kernels on the current device (see CudaCommunicator: no lazy loading
// while a stream spins on a peer).
Status PreloadSumKernels();

}  // namespace jax_ub
