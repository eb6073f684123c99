// The reduction that ends GEMM+RS: the partials every rank computed for this rank, summed
// on its GPU. Its own unit so that the diagnostics in benchmarks/tools/ time the same kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol/dtype.h"
#include "protocol/status.h"

namespace jax_ub {

// out[i] = sum over j = 0..nparts-1 of parts[j * count + i] (type `t`), accumulated in
// float32 in that order, so results do not depend on which partial landed first.
// Enqueued on `stream`.
Status LaunchSum(DType t, const void* parts, int64_t count, int nparts, void* out,
                 cudaStream_t stream);

// Loads the sum's kernels on the current device (see CudaCommunicator: no lazy loading
// while a stream spins on a peer).
Status PreloadSumKernels();

}  // namespace jax_ub
