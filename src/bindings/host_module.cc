// nanobind module for the host (CPU) implementation: FFI handler capsules and the
// communicator lifecycle.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>

#include "bindings/ffi_cpu.h"
#include "bindings/nb_helpers.h"
#include "bindings/registry.h"
#include "cuda/gemm/choice_internal.h"
#include "host/communicator.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_ub {
XLA_FFI_DECLARE_HANDLER_SYMBOL(InstantiateCallCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulReduceScatterCpu);
}  // namespace jax_ub

NB_MODULE(_host, m) {
  m.def("registrations", []() {
    auto stages = [](auto* execute) {
      nb::dict d;
      d["instantiate"] = jax_ub::EncapsulateFfiHandler(jax_ub::InstantiateCallCpu);
      d["execute"] = jax_ub::EncapsulateFfiHandler(execute);
      return d;
    };
    nb::dict d;
    d["jax_ub_all_gather_matmul"] = stages(jax_ub::AllGatherMatmulCpu);
    d["jax_ub_matmul_reduce_scatter"] = stages(jax_ub::MatmulReduceScatterCpu);
    return d;
  });
  // The TypeRegistration of the handlers' state, for jax.ffi.register_ffi_type.
  m.def("call_copy_type", []() {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&jax_ub::CallCopy::id));
    d["type_info"] = nb::capsule(
        reinterpret_cast<void*>(const_cast<xla::ffi::TypeInfo*>(&jax_ub::CallCopy::info)));
    return d;
  });
  m.def("reset_call_copies", &jax_ub::ResetCallCopies);
  m.def(
      "create_communicator",
      [](int group_size, std::vector<int> slot_devices, size_t capacity_bytes, nb::dict options,
         std::string shm_prefix) {
        const jax_ub::CommOptions opts = jax_ub::OptionsFromDict(options);
        jax_ub::Topology topo;
        jax_ub::Status st = jax_ub::Topology::Make(group_size, std::move(slot_devices), &topo);
        jax_ub::RaiseIfError(st);
        std::unique_ptr<jax_ub::HostCommunicator> c;
        st =
            jax_ub::HostCommunicator::Create(std::move(topo), capacity_bytes, opts, shm_prefix, &c);
        jax_ub::RaiseIfError(st);
        return jax_ub::Registry<jax_ub::HostCommunicator>::Add(std::move(c));
      },
      nb::arg("group_size"), nb::arg("slot_devices"), nb::arg("capacity_bytes"), nb::arg("options"),
      nb::arg("shm_prefix") = "");
  m.def("region_names", [](int64_t id) {
    auto c = jax_ub::FindCommunicator<jax_ub::HostCommunicator>(id);
    return c->region_names();
  });
  m.def("connect", [](int64_t id, std::vector<std::string> names) {
    auto c = jax_ub::FindCommunicator<jax_ub::HostCommunicator>(id);
    jax_ub::Status st = c->Connect(names);
    jax_ub::RaiseIfError(st);
  });
  m.def("hold_next_call", [](int64_t id, int device, double seconds) {
    auto c = jax_ub::FindCommunicator<jax_ub::HostCommunicator>(id);
    jax_ub::RaiseIfError(c->HoldNextCall(device, seconds));
  });
  m.def("held_key", [](int64_t id) {
    return jax_ub::FindCommunicator<jax_ub::HostCommunicator>(id)->held_key();
  });
  m.def("leader_order", [](int64_t id, int device) {
    auto c = jax_ub::FindCommunicator<jax_ub::HostCommunicator>(id);
    std::vector<uint64_t> keys;
    jax_ub::RaiseIfError(c->LeaderOrder(device, &keys));
    return keys;
  });
  // One rank's step list for a call (protocol/schedule.h), for tests of the protocol's
  // order: per step (kind, lane, peer, on_lane, rows, src region, src offset, parts, addend
  // region, addend offset, dst region, dst offset, bytes, flag, slot, signals, own region, own
  // offset, aux region, aux offset), kinds and regions by their enumerators' names without
  // the k. `epilogue`: "" (none), "gelu_aux" (GELU, the pre-GELU product kept) or "dgelu".
  m.def(
      "call_steps",
      [](const std::string& op, int rank, int size, int64_t m, int64_t k, int64_t n, bool gathered,
         nb::dict options, const std::string& epilogue) {
        jax_ub::OpKind kind;
        if (!jax_ub::OpKindFromName(op, &kind)) throw nb::value_error(("unknown op " + op).c_str());
        const std::string got = "rank " + std::to_string(rank) + ", size " + std::to_string(size) +
                                ", m " + std::to_string(m) + ", k " + std::to_string(k) + ", n " +
                                std::to_string(n);
        if (size < 1 || rank < 0 || rank >= size || m < 0 || k < 1 || n < 1)
          throw nb::value_error(
              ("call_steps needs 0 <= rank < size, m >= 0 and k, n >= 1; got " + got).c_str());
        static const char* kKinds[] = {"Wait", "Publish", "Copy", "Signal",
                                       "Gemm", "Sum",     "Join", "Verify"};
        static const char* kRegions[] = {"None", "X",         "Out",    "Gathered",
                                         "Aux",  "GatherSrc", "Buffer", "PeerBuffer"};
        static const char* kFlags[] = {"Data", "FirstPiece", "Credit", "Block"};
        static_assert(static_cast<int>(jax_ub::Step::Kind::kVerify) == 7 &&
                          static_cast<int>(jax_ub::Region::kPeerBuffer) == 7 &&
                          static_cast<int>(jax_ub::Flag::kBlock) == 3,
                      "call_steps names every Step::Kind, Region and Flag, in their order");
        jax_ub::CallShape shape;
        shape.m = m;
        shape.k = k;
        shape.n = n;
        shape.gathered = gathered;
        if (epilogue == "gelu_aux")
          shape.epilogue.gelu = shape.epilogue.aux = true;
        else if (epilogue == "dgelu")
          shape.epilogue.dgelu = true;
        else if (!epilogue.empty())
          throw nb::value_error(
              ("epilogue must be '', 'gelu_aux' or 'dgelu'; got '" + epilogue + "'").c_str());
        const jax_ub::Schedule sched =
            jax_ub::Schedule::Of(jax_ub::OptionsFromDict(options)).For(rank, size);
        nb::list out;
        for (const jax_ub::Step& st : jax_ub::CallSteps(kind, sched, shape))
          out.append(
              nb::make_tuple(kKinds[static_cast<int>(st.kind)], st.lane, st.peer, st.on_lane,
                             st.rows, kRegions[static_cast<int>(st.src.region)], st.src.offset,
                             st.parts, kRegions[static_cast<int>(st.addend.region)],
                             st.addend.offset, kRegions[static_cast<int>(st.dst.region)],
                             st.dst.offset, st.bytes, kFlags[static_cast<int>(st.flag)], st.slot,
                             st.signals, kRegions[static_cast<int>(st.own.region)], st.own.offset,
                             kRegions[static_cast<int>(st.aux.region)], st.aux.offset));
        return out;
      },
      nb::arg("op"), nb::arg("rank"), nb::arg("size"), nb::arg("m"), nb::arg("k"), nb::arg("n"),
      nb::arg("gathered"), nb::arg("options"), nb::arg("epilogue") = "");
  // Which of a long GEMM's kernel candidates the GPU tuning's blocks time (CUDA-free logic,
  // tested here): `ranked` fastest first by the ranking bursts, `first_pick` cuBLASLt's own
  // first.
  m.def("sustained_candidates", &jax_ub::gemm_internal::SustainedCandidates, nb::arg("ranked"),
        nb::arg("first_pick"));
  // Which candidate the tuning keeps: its fastest, or cuBLASLt's own first (candidate 0)
  // where that is within the hold margin or the rounds' spread (first_ms < 0: not timed).
  m.def("kept_candidate", &jax_ub::gemm_internal::KeptCandidate, nb::arg("fastest"),
        nb::arg("fastest_ms"), nb::arg("first_ms"), nb::arg("spread") = 0.0);
  m.attr("hold_margin") = jax_ub::gemm_internal::kHoldMargin;
  m.def("round_spread", &jax_ub::gemm_internal::RoundSpread, nb::arg("ms"));
  // How sustained blocks score candidates: the rounds at a steady clock, each one's time over
  // its round's, the middle over rounds; the in-op trials' rounds, scored alike; and the first
  // pick's round-by-round lead over the fastest, with its spread.
  m.def("steady_rounds", &jax_ub::gemm_internal::SteadyRounds, nb::arg("ms"));
  m.def("relative_times", &jax_ub::gemm_internal::RelativeTimes, nb::arg("ms"));
  m.def("trial_rounds", &jax_ub::gemm_internal::TrialRounds, nb::arg("ms"));
  m.def("round_lead", &jax_ub::gemm_internal::RoundLead, nb::arg("first"), nb::arg("fastest"));
  // How many candidates and rounds tuning's later rounds time within the budget left.
  m.def(
      "plan_rounds",
      [](const std::vector<double>& round_ms, int rounds, bool sustained, double left_ms) {
        const auto plan = jax_ub::gemm_internal::PlanRounds(round_ms, rounds, sustained, left_ms);
        return std::make_pair(plan.candidates, plan.rounds);
      },
      nb::arg("round_ms"), nb::arg("rounds"), nb::arg("sustained"), nb::arg("left_ms"));
  m.def("unlink", [](int64_t id) {
    auto c = jax_ub::Registry<jax_ub::HostCommunicator>::Get(id);
    if (c) c->Unlink();
  });
  jax_ub::DefCommonBindings<jax_ub::HostCommunicator>(m);
}
