// Helpers shared by the nanobind modules: FFI handler capsules, Status -> exception.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "call_descriptor.h"
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

// `required_bytes(op, chunk_bytes, group_size)`: the communicator's own buffer sizing, so
// Python never repeats it.
template <typename Communicator>
void DefRequiredBytes(nanobind::module_& m) {
  m.def("required_bytes", [](const std::string& op, int64_t chunk_bytes, int group_size) {
    OpKind kind;
    if (!OpKindFromName(op, &kind)) throw nanobind::value_error(("unknown op " + op).c_str());
    return Communicator::RequiredBytes(kind, chunk_bytes, group_size);
  });
}

}  // namespace jax_ub
