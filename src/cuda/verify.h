// The check each call ends with on its compute stream: the peers' descriptors against this
// rank's own, and NaN outputs once the slot is unhealthy.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/communicator.h"
#include "protocol/call_descriptor.h"
#include "protocol/status.h"

namespace jax_ub {

// Enqueues VerifyCall (below) on `stream`.
Status LaunchVerifyCall(cudaStream_t stream, const uint64_t* desc_from, const CallDescriptor& mine,
                        int size, int rank, uint64_t* health,
                        CudaCommunicator::DeviceReport* report,
                        const CudaCommunicator::CallOutputs& outputs);

// Load every kernel of the module on the current device now: lazy loading in the middle
// of a call could block behind a stream that spins on a peer.
Status PreloadKernels();

}  // namespace jax_ub
