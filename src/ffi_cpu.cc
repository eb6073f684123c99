// XLA FFI handlers for platform "cpu": decode, find the communicator, call it.
#include <cstdint>

#include "ffi_common.h"
#include "host_communicator.h"
#include "registry.h"

namespace jax_ub {
namespace {

ffi::Error AllGatherMatmulHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> gathered, int64_t comm_id) {
  DType t;
  Status st = CheckMatmulOperands("all_gather_matmul", x, w, *out, &t);
  if (!st.ok()) return ToFfiError(st);
  auto comm = Registry<HostCommunicator>::Get(comm_id);
  if (!comm) return ToFfiError(FailedPrecondition("communicator was finalized"));
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = w.dimensions()[1];
  if (out->dimensions()[0] != m * comm->topology().group_size())
    return ToFfiError(InvalidArgument("all_gather_matmul: output rows do not match the group"));
  void* g = gathered->element_count() > 0 ? gathered->untyped_data() : nullptr;
  return ToFfiError(comm->AllGatherMatmul(device, t, x.untyped_data(), w.untyped_data(),
                                          out->untyped_data(), g, m, k, n));
}

ffi::Error MatmulReduceScatterHost(int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t comm_id) {
  DType t;
  Status st = CheckMatmulOperands("matmul_reduce_scatter", x, w, *out, &t);
  if (!st.ok()) return ToFfiError(st);
  auto comm = Registry<HostCommunicator>::Get(comm_id);
  if (!comm) return ToFfiError(FailedPrecondition("communicator was finalized"));
  const int64_t m = out->dimensions()[0], k = x.dimensions()[1], n = w.dimensions()[1];
  if (x.dimensions()[0] != m * comm->topology().group_size())
    return ToFfiError(InvalidArgument("matmul_reduce_scatter: input rows do not match the group"));
  return ToFfiError(comm->MatmulReduceScatter(device, t, x.untyped_data(), w.untyped_data(),
                                              out->untyped_data(), m, k, n));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllGatherMatmulCpu, AllGatherMatmulHost,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulReduceScatterCpu, MatmulReduceScatterHost,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm_id"));

}  // namespace jax_ub
