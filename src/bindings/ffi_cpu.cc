// XLA FFI handlers for platform "cpu": decode, find the communicator, call it.
#include <cstdint>

#include "bindings/ffi_common.h"
#include "host/communicator.h"

namespace jax_ub {
namespace {

ffi::Error AllGatherMatmulHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::AnyBuffer scales, ffi::AnyBuffer bias,
                               ffi::AnyBuffer gelu_input, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> gathered,
                               ffi::Result<ffi::AnyBuffer> aux, int64_t comm_id, bool transpose_w,
                               bool gelu, bool dgelu) {
  MatmulCall<HostCommunicator> c;
  Status st = PrepareAllGather(x, w, transpose_w, scales, bias, gelu_input, *out, *gathered, *aux,
                               comm_id, gelu, dgelu, &c);
  if (st.ok()) st = c.comm->Call(device, OpKind::kAllGatherMatmul, c.shape, c.ops);
  return ToFfiError(st);
}

ffi::Error MatmulReduceScatterHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> out,
                                   int64_t comm_id, bool transpose_w) {
  MatmulCall<HostCommunicator> c;
  Status st = PrepareReduceScatter(x, w, transpose_w, scales, *out, comm_id, &c);
  if (st.ok()) st = c.comm->Call(device, OpKind::kMatmulReduceScatter, c.shape, c.ops);
  return ToFfiError(st);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherMatmulCpu, AllGatherMatmulHost,
                              BindAllGatherMatmul(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulReduceScatterCpu, MatmulReduceScatterHost,
                              BindMatmulReduceScatter(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));

}  // namespace jax_ub
