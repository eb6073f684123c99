// Stream memory operations (wait on, write and batch 64-bit flags from a stream) come from
// the CUDA driver API. They are resolved once through the runtime, so the module links no
// libcuda and imports on machines without a driver.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "protocol/status.h"

namespace jax_ub {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using StreamBatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
struct DriverOps {
  StreamValueFn wait = nullptr;
  StreamValueFn write = nullptr;
  StreamBatchFn batch = nullptr;
};

// The process-wide entry points (resolved on the first call), or why they are missing.
Status LoadDriverOps(const DriverOps** out);

}  // namespace jax_ub
