// XLA FFI handlers for platform "CUDA": decode, find the communicator, enqueue on XLA's
// stream. No handler blocks the host on another device.
#include <cuda_runtime.h>

#include <cstdint>

#include "bindings/ffi_common.h"
#include "cuda/communicator.h"

namespace jax_ub {
namespace {

ffi::Error AllGatherMatmulGpu(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::AnyBuffer w, ffi::AnyBuffer scales, ffi::AnyBuffer bias,
                              ffi::AnyBuffer gelu_input, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> gathered, ffi::Result<ffi::AnyBuffer> aux,
                              int64_t comm_id, bool transpose_w, bool gelu, bool dgelu) {
  MatmulCall<CudaCommunicator> c;
  Status st = PrepareAllGather(x, w, transpose_w, scales, bias, gelu_input, *out, *gathered, *aux,
                               comm_id, gelu, dgelu, &c);
  if (st.ok()) st = c.comm->Call(device, stream, OpKind::kAllGatherMatmul, c.shape, c.ops);
  return ToFfiError(st);
}

ffi::Error MatmulReduceScatterGpu(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                  ffi::AnyBuffer w, ffi::AnyBuffer scales,
                                  ffi::AnyBuffer gather_src, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> gathered, int64_t comm_id,
                                  bool transpose_w) {
  MatmulCall<CudaCommunicator> c;
  Status st =
      PrepareReduceScatter(x, w, transpose_w, scales, gather_src, *out, *gathered, comm_id, &c);
  if (st.ok()) st = c.comm->Call(device, stream, OpKind::kMatmulReduceScatter, c.shape, c.ops);
  return ToFfiError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherMatmulCuda, AllGatherMatmulGpu,
                              BindAllGatherMatmul(ffi::Ffi::Bind()
                                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                      .Ctx<ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulReduceScatterCuda, MatmulReduceScatterGpu,
                              BindMatmulReduceScatter(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()));

}  // namespace jax_ub
