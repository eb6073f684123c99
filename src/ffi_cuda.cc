// XLA FFI handlers for platform "CUDA": decode, find the communicator, enqueue on XLA's
// stream. No handler blocks the host on another device.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_communicator.h"
#include "ffi_common.h"
#include "registry.h"

namespace jax_ub {
namespace {

ffi::Error AllGatherMatmulGpu(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> gathered, int64_t comm_id) {
  DType t;
  Status st = CheckMatmulOperands("all_gather_matmul", x, w, *out, &t);
  if (!st.ok()) return ToFfiError(st);
  auto comm = Registry<CudaCommunicator>::Get(comm_id);
  if (!comm) return ToFfiError(FailedPrecondition("communicator was finalized"));
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = w.dimensions()[1];
  if (out->dimensions()[0] != m * comm->topology().group_size())
    return ToFfiError(InvalidArgument("all_gather_matmul: output rows do not match the group"));
  void* g = gathered->element_count() > 0 ? gathered->untyped_data() : nullptr;
  return ToFfiError(comm->AllGatherMatmul(device, stream, t, x.untyped_data(), w.untyped_data(),
                                          out->untyped_data(), g, m, k, n));
}

ffi::Error MatmulReduceScatterGpu(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                                  int64_t comm_id) {
  DType t;
  Status st = CheckMatmulOperands("matmul_reduce_scatter", x, w, *out, &t);
  if (!st.ok()) return ToFfiError(st);
  auto comm = Registry<CudaCommunicator>::Get(comm_id);
  if (!comm) return ToFfiError(FailedPrecondition("communicator was finalized"));
  const int64_t m = out->dimensions()[0], k = x.dimensions()[1], n = w.dimensions()[1];
  if (x.dimensions()[0] != m * comm->topology().group_size())
    return ToFfiError(InvalidArgument("matmul_reduce_scatter: input rows do not match the group"));
  return ToFfiError(comm->MatmulReduceScatter(device, stream, t, x.untyped_data(), w.untyped_data(),
                                              out->untyped_data(), m, k, n));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherMatmulCuda, AllGatherMatmulGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulReduceScatterCuda, MatmulReduceScatterGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id"));

}  // namespace jax_ub
