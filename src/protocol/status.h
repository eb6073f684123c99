// A small status type shared by the host and CUDA layers; FFI handlers turn it into
// an ffi::Error, the nanobind layer into a Python exception.
#pragma once

#include <string>
#include <utility>

namespace jax_ub {

enum class StatusCode { kOk, kInvalidArgument, kDeadlineExceeded, kFailedPrecondition, kInternal };

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status DeadlineExceeded(std::string m) {
  return Status(StatusCode::kDeadlineExceeded, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status Internal(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }

#define JAX_UB_RETURN_IF_ERROR(expr) \
  do {                               \
    ::jax_ub::Status _st = (expr);   \
    if (!_st.ok()) return _st;       \
  } while (0)

}  // namespace jax_ub
