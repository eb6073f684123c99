// XLA FFI handlers for platform "cpu": decode, find the communicator, call it.
#include <cstdint>

#include "bindings/ffi_common.h"
#include "host/communicator.h"

namespace jax_ub {
namespace {

// The call runs on its slot's thread (HostCommunicator::CallAsync); XLA's CPU runtime goes
// on with the device's independent work and takes the result when the future is ready.
ffi::Future RunAsync(int32_t device, int64_t site, OpKind op, const Status& prepared,
                     MatmulCall<HostCommunicator>& c) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (!prepared.ok()) {
    promise.SetError(ToFfiError(prepared));
    return future;
  }
  c.comm->CallAsync(device, static_cast<uint64_t>(site), op, c.shape, c.ops,
                    [promise](const Status& st) mutable {
                      if (st.ok()) {
                        promise.SetAvailable();
                      } else {
                        promise.SetError(ToFfiError(st));
                      }
                    });
  return future;
}

ffi::Future AllGatherMatmulHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::AnyBuffer scales, ffi::AnyBuffer bias,
                                ffi::AnyBuffer gelu_input, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> gathered,
                                ffi::Result<ffi::AnyBuffer> aux, int64_t comm_id, bool transpose_w,
                                bool gelu, bool dgelu, int64_t site) {
  MatmulCall<HostCommunicator> c;
  Status st = PrepareAllGather(x, w, transpose_w, scales, bias, gelu_input, *out, *gathered, *aux,
                               comm_id, gelu, dgelu, &c);
  return RunAsync(device, site, OpKind::kAllGatherMatmul, st, c);
}

ffi::Future MatmulReduceScatterHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                    ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> out,
                                    int64_t comm_id, bool transpose_w, int64_t site) {
  MatmulCall<HostCommunicator> c;
  Status st = PrepareReduceScatter(x, w, transpose_w, scales, *out, comm_id, &c);
  return RunAsync(device, site, OpKind::kMatmulReduceScatter, st, c);
}

}  // namespace

// `site`: the call's id from the lowering, the same in every process (OrderedRunner).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherMatmulCpu, AllGatherMatmulHost,
    BindAllGatherMatmul(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()).Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulReduceScatterCpu, MatmulReduceScatterHost,
    BindMatmulReduceScatter(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()).Attr<int64_t>("site"));

}  // namespace jax_ub
