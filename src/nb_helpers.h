// Helpers shared by the nanobind modules: FFI handler capsules, Status -> exception.
#pragma once

#include <nanobind/nanobind.h>

#include <stdexcept>

#include "status.h"

namespace jax_ub {

template <typename T>
nanobind::capsule EncapsulateFfiHandler(T* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// Invalid arguments become ValueError, everything else RuntimeError.
inline void RaiseIfError(const Status& st) {
  if (st.ok()) return;
  if (st.code() == StatusCode::kInvalidArgument) throw nanobind::value_error(st.message().c_str());
  throw std::runtime_error(st.message());
}

}  // namespace jax_ub
