// Helpers shared by the nanobind modules: FFI handler capsules, Status -> exception, the
// bindings both modules define alike.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "call_descriptor.h"
#include "registry.h"
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

// The live communicator `id`, or a ValueError.
template <typename Communicator>
std::shared_ptr<Communicator> FindCommunicator(int64_t id) {
  auto c = Registry<Communicator>::Get(id);
  if (!c) throw nanobind::value_error("no such communicator");
  return c;
}

// The bindings both platform modules share, with the same names, so the Python side
// (bootstrap, finalize, check_health, buffer sizing) serves either:
// broken_reason, quiesce, destroy_communicator, num_communicators, and
// `required_bytes(op, chunk_bytes, group_size)`, the communicator's own buffer sizing.
template <typename Communicator>
void DefCommonBindings(nanobind::module_& m) {
  m.def("broken_reason", [](int64_t id) {
    auto c = Registry<Communicator>::Get(id);
    return c ? c->BrokenReason() : std::string();
  });
  m.def("quiesce", [](int64_t id, double timeout_s) {
    auto c = Registry<Communicator>::Get(id);
    nanobind::gil_scoped_release release;
    return c ? c->Quiesce(timeout_s) : true;
  });
  m.def("destroy_communicator", [](int64_t id) {
    nanobind::gil_scoped_release release;  // the destructor may wait for calls in flight
    return Registry<Communicator>::Remove(id);
  });
  m.def("num_communicators", []() { return Registry<Communicator>::Size(); });
  m.def("required_bytes", [](const std::string& op, int64_t chunk_bytes, int group_size) {
    OpKind kind;
    if (!OpKindFromName(op, &kind)) throw nanobind::value_error(("unknown op " + op).c_str());
    return Communicator::RequiredBytes(kind, chunk_bytes, group_size);
  });
}

}  // namespace jax_ub
