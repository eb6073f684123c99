// Helpers shared by the CPU and CUDA FFI handlers: status conversion and the shape
// checks every handler repeats.
#pragma once

#include <string>

#include "dtype.h"
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

// Operands arrive flattened to 2-D by the Python layer; check what it promised.
inline Status CheckMatmulOperands(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  ffi::AnyBuffer out, DType* dtype) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return InvalidArgument(std::string(op) + ": operands must be 2-D after flattening");
  if (xd[1] != wd[0])
    return InvalidArgument(std::string(op) + ": contracting dims differ: x has k=" +
                           std::to_string(xd[1]) + ", w has k=" + std::to_string(wd[0]));
  const int32_t raw = static_cast<int32_t>(x.element_type());
  if (!IsSupportedDType(raw) || w.element_type() != x.element_type() ||
      out.element_type() != x.element_type())
    return InvalidArgument(std::string(op) +
                           ": x, w and the output must share one dtype among float32, "
                           "bfloat16 and float16");
  *dtype = static_cast<DType>(raw);
  return Status::Ok();
}

}  // namespace jax_ub
