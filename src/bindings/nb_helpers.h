// Helpers shared by the nanobind modules: FFI handler capsules, Status -> exception, the
// bindings both modules define alike.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include "bindings/registry.h"
#include "protocol/buffer_layout.h"
#include "protocol/call_descriptor.h"
#include "protocol/comm_options.h"
#include "protocol/schedule.h"
#include "protocol/status.h"
#include "xla/ffi/api/c_api.h"

#ifndef JAX_UB_BUILT_JAXLIB  // CMakeLists.txt defines it
#define JAX_UB_BUILT_JAXLIB "unknown"
#endif

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

// CommOptions from the dict of jax_ub's Python Options (same names). Every field is
// required and no other is accepted, so the two sides cannot drift apart silently.
inline CommOptions OptionsFromDict(const nanobind::dict& d) {
  namespace nb = nanobind;
  static const std::set<std::string> kFields = {"timeout_s",
                                                "allow_tf32",
                                                "autotune_gemm",
                                                "gemm_hold_first_pick",
                                                "autotune_reduce_scatter",
                                                "gemm_order",
                                                "gemm_trials",
                                                "reduce_scatter_fold_rows",
                                                "reduce_scatter_ring",
                                                "reduce_scatter_early_sum",
                                                "all_gather_in_turn",
                                                "two_gemm_lanes",
                                                "all_gather_flag_gemm",
                                                "reduce_scatter_signal_gemm",
                                                "compute_on_caller_stream",
                                                "fp8_fast_accumulation",
                                                "gemm_cache"};
  for (auto item : d) {
    std::string key = nb::cast<std::string>(item.first);
    if (!kFields.count(key)) throw nb::value_error(("unknown communicator option " + key).c_str());
  }
  auto get = [&](const char* name) {
    if (!d.contains(name))
      throw nb::value_error((std::string("missing communicator option ") + name).c_str());
    return d[name];
  };
  CommOptions o;
  o.timeout_s = nb::cast<double>(get("timeout_s"));
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s)) {  // NaN and inf would disable deadlines
    char msg[96];
    std::snprintf(msg, sizeof(msg), "timeout must be positive and finite, got %g s", o.timeout_s);
    throw nb::value_error(msg);
  }
  o.allow_tf32 = nb::cast<bool>(get("allow_tf32"));
  o.autotune_gemm = nb::cast<bool>(get("autotune_gemm"));
  o.gemm_hold_first_pick = nb::cast<bool>(get("gemm_hold_first_pick"));
  o.autotune_reduce_scatter = nb::cast<bool>(get("autotune_reduce_scatter"));
  o.fp8_fast_accumulation = nb::cast<bool>(get("fp8_fast_accumulation"));
  o.compute_on_caller_stream = nb::cast<bool>(get("compute_on_caller_stream"));
  const std::string order = nb::cast<std::string>(get("gemm_order"));
  if (order == "auto") {
    o.gemm_order = GemmOrder::kAuto;
  } else if (order == "column") {
    o.gemm_order = GemmOrder::kColumn;
  } else if (order == "row") {
    o.gemm_order = GemmOrder::kRow;
  } else {
    throw nb::value_error(
        ("gemm_order must be 'auto', 'column' or 'row', got '" + order + "'").c_str());
  }
  o.gemm_trials = nb::cast<int>(get("gemm_trials"));
  if (o.gemm_trials < 0)
    throw nb::value_error(
        ("gemm_trials must be >= 0, got " + std::to_string(o.gemm_trials)).c_str());
  o.reduce_scatter_fold_rows = nb::cast<int64_t>(get("reduce_scatter_fold_rows"));
  o.reduce_scatter_ring = nb::cast<bool>(get("reduce_scatter_ring"));
  auto choice = [&](const char* name) {  // None: by each call's shape
    const nb::object v = get(name);
    return v.is_none()         ? ScheduleChoice::kByShape
           : nb::cast<bool>(v) ? ScheduleChoice::kOn
                               : ScheduleChoice::kOff;
  };
  o.reduce_scatter_early_sum = choice("reduce_scatter_early_sum");
  o.all_gather_in_turn = choice("all_gather_in_turn");
  o.two_gemm_lanes = choice("two_gemm_lanes");
  o.all_gather_flag_gemm = choice("all_gather_flag_gemm");
  o.reduce_scatter_signal_gemm = choice("reduce_scatter_signal_gemm");
  o.gemm_cache = nb::cast<std::string>(get("gemm_cache"));
  if (o.gemm_cache.find('\n') != std::string::npos)
    throw nb::value_error("gemm_cache must be a file path, without newlines");
  return o;
}

// The bindings both platform modules share, with the same names, so the Python side
// (bootstrap, finalize, check_health, buffer sizing) serves either:
// broken_reason, quiesce, destroy_communicator, num_communicators, and
// `required_bytes(op, chunk_bytes, group_size, also_gathers, rows, k, options)`, the
// schedule's buffer sizing (protocol/schedule.h).
template <typename Communicator>
void DefCommonBindings(nanobind::module_& m) {
  // The XLA FFI API the handlers were compiled against, and the jaxlib whose headers those
  // were: XLA rejects handlers newer than its own API, so extension.py checks before
  // registering.
  m.attr("FFI_API_VERSION") = nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("BUILT_AGAINST_JAXLIB") = JAX_UB_BUILT_JAXLIB;
  m.def("broken_reason", [](int64_t id) {
    auto c = Registry<Communicator>::Get(id);
    return c ? c->BrokenReason() : std::string();
  });
  // Waits up to the communicator's own timeout.
  m.def("quiesce", [](int64_t id) {
    auto c = Registry<Communicator>::Get(id);
    nanobind::gil_scoped_release release;
    return c ? c->Quiesce() : true;
  });
  m.def("destroy_communicator", [](int64_t id) {
    nanobind::gil_scoped_release release;  // the destructor may wait for calls in flight
    return Registry<Communicator>::Remove(id);
  });
  m.def("num_communicators", []() { return Registry<Communicator>::Size(); });
  // The call's rows (a rank's: x's for AG, the output's for RS) and k, with the options the
  // communicator is created with, choose its schedule (Schedule::ReduceScatterSumsEarly).
  m.def(
      "required_bytes",
      [](const std::string& op, int64_t chunk_bytes, int group_size, bool also_gathers,
         int64_t rows, int64_t k, nanobind::dict options) {
        OpKind kind;
        if (!OpKindFromName(op, &kind)) throw nanobind::value_error(("unknown op " + op).c_str());
        if (group_size < 1) throw nanobind::value_error("group_size must be positive");
        CallShape shape;
        shape.m = rows;
        shape.k = k;
        shape.gathered = also_gathers;
        const Schedule sched = Schedule::Of(OptionsFromDict(options)).For(0, group_size);
        return RequiredBytes(kind, chunk_bytes, group_size, also_gathers,
                             SumsEarly(kind, shape, sched));
      },
      nanobind::arg("op"), nanobind::arg("chunk_bytes"), nanobind::arg("group_size"),
      nanobind::arg("also_gathers"), nanobind::arg("rows"), nanobind::arg("k"),
      nanobind::arg("options"));
}

}  // namespace jax_ub
