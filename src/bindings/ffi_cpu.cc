// XLA FFI handlers for platform "cpu": decode, find the communicator, call it.
#include "bindings/ffi_cpu.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "bindings/ffi_common.h"
#include "host/communicator.h"

namespace jax_ub {

ffi::TypeId CallCopy::id = {};
const ffi::TypeInfo CallCopy::info = ffi::MakeTypeInfo<CallCopy>();

namespace {

// Per site and lowering, how many copies XLA has instantiated in this process. Copies of one
// site in one executable are instantiated in the order of the compiled schedule, the same
// in every process. The lowering is this process's number for the module the site was
// lowered in (jax_ub/_src/lowering/call_site.py): programs that differ only in shapes keep
// their counts apart, and a program lowered again (after a jax.clear_caches() of one
// process alone) counts its copies from 0, as its peers' first executable did.
std::mutex copies_mu;
std::map<std::pair<int64_t, int64_t>, uint64_t> copies_of_site;

// The state of one compiled custom call: which copy of its site it is.
ffi::ErrorOr<std::unique_ptr<CallCopy>> InstantiateCall(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> site = attrs.get<int64_t>("site");
  if (site.has_error()) return ffi::Unexpected(site.error());
  ffi::ErrorOr<int64_t> lowering = attrs.get<int64_t>("lowering");
  if (lowering.has_error()) return ffi::Unexpected(lowering.error());
  auto state = std::make_unique<CallCopy>();
  std::lock_guard<std::mutex> lock(copies_mu);
  const uint64_t copy = copies_of_site[{*site, *lowering}]++;
  // Copy 0 keeps the site itself; others differ by an odd multiple of a large constant.
  state->key = static_cast<uint64_t>(*site) + copy * 0x9e3779b97f4a7c15ULL;
  return state;
}

// The call runs on its slot's thread (HostCommunicator::CallAsync); XLA's CPU runtime goes
// on with the device's independent work and takes the result when the future is ready.
ffi::Future RunAsync(int32_t device, const CallCopy* copy, OpKind op, const Status& prepared,
                     MatmulCall<HostCommunicator>& c) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (!prepared.ok()) {
    promise.SetError(ToFfiError(prepared));
    return future;
  }
  c.comm->CallAsync(device, copy->key, op, c.shape, c.ops, [promise](const Status& st) mutable {
    if (st.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ToFfiError(st));
    }
  });
  return future;
}

ffi::Future AllGatherMatmulHost(int32_t device, CallCopy* copy, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::AnyBuffer scales, ffi::AnyBuffer bias,
                                ffi::AnyBuffer gelu_input, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> gathered,
                                ffi::Result<ffi::AnyBuffer> aux, int64_t comm_id, bool transpose_w,
                                bool gelu, bool dgelu, int64_t /*site*/, int64_t /*lowering*/) {
  MatmulCall<HostCommunicator> c;
  Status st = PrepareAllGather(x, w, transpose_w, scales, bias, gelu_input, *out, *gathered, *aux,
                               comm_id, gelu, dgelu, &c);
  return RunAsync(device, copy, OpKind::kAllGatherMatmul, st, c);
}

ffi::Future MatmulReduceScatterHost(int32_t device, CallCopy* copy, ffi::AnyBuffer x,
                                    ffi::AnyBuffer w, ffi::AnyBuffer scales,
                                    ffi::AnyBuffer gather_src, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> gathered, int64_t comm_id,
                                    bool transpose_w, int64_t /*site*/, int64_t /*lowering*/) {
  MatmulCall<HostCommunicator> c;
  Status st =
      PrepareReduceScatter(x, w, transpose_w, scales, gather_src, *out, *gathered, comm_id, &c);
  return RunAsync(device, copy, OpKind::kMatmulReduceScatter, st, c);
}

}  // namespace

void ResetCallCopies() {
  std::lock_guard<std::mutex> lock(copies_mu);
  copies_of_site.clear();
}

// `site`: the call's id from the lowering, the same in every process; with the copy
// number of its instantiate state it keys the call (OrderedRunner). `lowering`: which of
// this process's lowerings the call is of (counting copies only).
XLA_FFI_DEFINE_HANDLER_SYMBOL(InstantiateCallCpu, InstantiateCall,
                              ffi::Ffi::BindInstantiate().Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AllGatherMatmulCpu, AllGatherMatmulHost,
    BindAllGatherMatmul(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::State<CallCopy>>())
        .Attr<int64_t>("site")
        .Attr<int64_t>("lowering"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MatmulReduceScatterCpu, MatmulReduceScatterHost,
    BindMatmulReduceScatter(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::State<CallCopy>>())
        .Attr<int64_t>("site")
        .Attr<int64_t>("lowering"));

}  // namespace jax_ub
