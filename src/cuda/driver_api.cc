#include "cuda/driver_api.h"

#include "cuda/check.h"

namespace jax_ub {

Status LoadDriverOps(const DriverOps** out) {
  static DriverOps ops;
  static Status status = [] {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWaitValue64");
    ops.wait = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000,
                                                 cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWriteValue64");
    ops.write = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamBatchMemOp");
    ops.batch = reinterpret_cast<StreamBatchFn>(fn);
    return Status::Ok();
  }();
  *out = &ops;
  return status;
}

}  // namespace jax_ub
