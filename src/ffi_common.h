// Helpers shared by the CPU and CUDA FFI handlers: status conversion and the shape
// checks every handler repeats.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtype.h"
#include "registry.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ub {

namespace ffi = xla::ffi;

inline ffi::Error ToFfiError(const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
      code = ffi::ErrorCode::kInvalidArgument;
      break;
    case StatusCode::kDeadlineExceeded:
      code = ffi::ErrorCode::kDeadlineExceeded;
      break;
    case StatusCode::kFailedPrecondition:
      code = ffi::ErrorCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  return ffi::Error(code, "jax_ub: " + st.message());
}

// Operands arrive flattened to 2-D by the Python layer; check what it promised. w is
// [k, n], or [n, k] with `w_transposed`.
inline Status CheckMatmulOperands(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  bool w_transposed, ffi::AnyBuffer out, DType* dtype) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return InvalidArgument(std::string(op) + ": operands must be 2-D after flattening");
  const int64_t wk = w_transposed ? wd[1] : wd[0];
  if (xd[1] != wk)
    return InvalidArgument(std::string(op) + ": contracting dims differ: x has k=" +
                           std::to_string(xd[1]) + ", w has k=" + std::to_string(wk));
  const int32_t raw = static_cast<int32_t>(x.element_type());
  if (!IsSupportedDType(raw) || w.element_type() != x.element_type() ||
      out.element_type() != x.element_type())
    return InvalidArgument(std::string(op) +
                           ": x, w and the output must share one dtype among float32, "
                           "bfloat16 and float16");
  *dtype = static_cast<DType>(raw);
  return Status::Ok();
}

// What a handler hands its communicator: the live communicator and the decoded problem.
template <typename Comm>
struct MatmulCall {
  std::shared_ptr<Comm> comm;
  DType t;
  int64_t m, k, n;           // local rows (x for AG, the output for RS), contraction, columns
  void* gathered = nullptr;  // AG only: where all_gather(x) goes, if asked for
};

// Decode and check an all_gather_matmul call: x [m, k], w [k, n] (or [n, k] transposed),
// out [size*m, n].
template <typename Comm>
Status PrepareAllGather(ffi::AnyBuffer x, ffi::AnyBuffer w, bool w_transposed, ffi::AnyBuffer out,
                        ffi::AnyBuffer gathered, int64_t comm_id, MatmulCall<Comm>* call) {
  JAX_UB_RETURN_IF_ERROR(
      CheckMatmulOperands("all_gather_matmul", x, w, w_transposed, out, &call->t));
  call->comm = Registry<Comm>::Get(comm_id);
  if (!call->comm) return FailedPrecondition("communicator was finalized");
  call->m = x.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = w.dimensions()[w_transposed ? 0 : 1];
  if (out.dimensions()[0] != call->m * call->comm->topology().group_size())
    return InvalidArgument("all_gather_matmul: output rows do not match the group");
  call->gathered = gathered.element_count() > 0 ? gathered.untyped_data() : nullptr;
  return Status::Ok();
}

// Decode and check a matmul_reduce_scatter call: x [size*m, k], w [k, n] (or [n, k]
// transposed), out [m, n].
template <typename Comm>
Status PrepareReduceScatter(ffi::AnyBuffer x, ffi::AnyBuffer w, bool w_transposed,
                            ffi::AnyBuffer out, int64_t comm_id, MatmulCall<Comm>* call) {
  JAX_UB_RETURN_IF_ERROR(
      CheckMatmulOperands("matmul_reduce_scatter", x, w, w_transposed, out, &call->t));
  call->comm = Registry<Comm>::Get(comm_id);
  if (!call->comm) return FailedPrecondition("communicator was finalized");
  call->m = out.dimensions()[0];
  call->k = x.dimensions()[1];
  call->n = w.dimensions()[w_transposed ? 0 : 1];
  if (x.dimensions()[0] != call->m * call->comm->topology().group_size())
    return InvalidArgument("matmul_reduce_scatter: input rows do not match the group");
  return Status::Ok();
}

}  // namespace jax_ub
