// nanobind module for the CUDA implementation: FFI handler capsules and the
// communicator lifecycle.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include "bindings/nb_helpers.h"
#include "bindings/registry.h"
#include "cuda/check.h"
#include "cuda/communicator.h"
#include "cuda/gemm/flag_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_ub {
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulReduceScatterCuda);
}  // namespace jax_ub

NB_MODULE(_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_ub_all_gather_matmul"] = jax_ub::EncapsulateFfiHandler(jax_ub::AllGatherMatmulCuda);
    d["jax_ub_matmul_reduce_scatter"] =
        jax_ub::EncapsulateFfiHandler(jax_ub::MatmulReduceScatterCuda);
    return d;
  });
  m.def(
      "create_communicator",
      [](int group_size, std::vector<int> slot_devices, size_t capacity_bytes, nb::dict options,
         bool multiprocess) {
        const jax_ub::CommOptions opts = jax_ub::OptionsFromDict(options);
        jax_ub::Topology topo;
        jax_ub::Status st = jax_ub::Topology::Make(group_size, std::move(slot_devices), &topo);
        jax_ub::RaiseIfError(st);
        std::unique_ptr<jax_ub::CudaCommunicator> c;
        {
          nb::gil_scoped_release release;
          st = jax_ub::CudaCommunicator::Create(std::move(topo), capacity_bytes, opts, multiprocess,
                                                &c);
        }
        jax_ub::RaiseIfError(st);
        return jax_ub::Registry<jax_ub::CudaCommunicator>::Add(std::move(c));
      },
      nb::arg("group_size"), nb::arg("slot_devices"), nb::arg("capacity_bytes"), nb::arg("options"),
      nb::arg("multiprocess") = false);
  // Same names as the host module's, so one bootstrap serves both: "region names" are the
  // hex-encoded CUDA IPC handles here, and there is nothing to unlink.
  m.def("region_names", [](int64_t id) {
    auto c = jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id);
    std::vector<std::string> raw, hex;
    jax_ub::RaiseIfError(c->ExportHandles(&raw));
    static const char* digits = "0123456789abcdef";
    for (const std::string& h : raw) {
      std::string out;
      for (unsigned char ch : h) {
        out.push_back(digits[ch >> 4]);
        out.push_back(digits[ch & 15]);
      }
      hex.push_back(out);
    }
    return hex;
  });
  m.def("connect", [](int64_t id, std::vector<std::string> hex) {
    auto c = jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id);
    std::vector<std::string> raw;
    for (const std::string& h : hex) {
      std::string out;
      for (size_t i = 0; i + 1 < h.size(); i += 2)
        out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
      raw.push_back(out);
    }
    jax_ub::Status st;
    {
      nb::gil_scoped_release release;
      st = c->Connect(raw);
    }
    jax_ub::RaiseIfError(st);
  });
  m.def("unlink", [](int64_t id) {});
  // [(device, calls, host ns in the ops, of which ns waiting for the process's other GPUs)]
  m.def("host_times", [](int64_t id) {
    auto c = jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id);
    std::vector<std::tuple<int, int64_t, int64_t, int64_t>> out;
    for (const auto& t : c->HostTimes())
      out.emplace_back(t.device, t.calls, t.total_ns, t.await_ns);
    return out;
  });
  // [(device, FlagGemm launches)], [(device, SignalGemm launches)], and whether this build has
  // them at all.
  m.def("flag_gemm_calls", [](int64_t id) {
    return jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id)->FlagGemmCalls();
  });
  m.def("signal_gemm_calls", [](int64_t id) {
    return jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id)->FlagGemmCalls(true);
  });
  m.def("flag_gemm_built", [] { return jax_ub::FlagGemmBuilt(); });
  // [(device, m, k, n, row description, place in cuBLASLt's heuristic list, trials still
  // comparing)]: each local GPU's kernel per GEMM shape.
  m.def("kernel_choices", [](int64_t id) {
    auto c = jax_ub::FindCommunicator<jax_ub::CudaCommunicator>(id);
    std::vector<std::tuple<int, int64_t, int64_t, int64_t, bool, int, bool>> out;
    for (const auto& [device, ch] : c->KernelChoices())
      out.emplace_back(device, ch.m, ch.k, ch.n, ch.row, ch.index, ch.deciding);
    return out;
  });
  jax_ub::DefCommonBindings<jax_ub::CudaCommunicator>(m);
  // (free, total) bytes of a GPU's memory, for leak checks; the current device is kept.
  m.def("memory_info", [](int device) {
    int current = 0;
    size_t free = 0, total = 0;
    jax_ub::Status st = jax_ub::CudaStatus(cudaGetDevice(&current), "cudaGetDevice");
    if (st.ok()) st = jax_ub::CudaStatus(cudaSetDevice(device), "cudaSetDevice");
    if (st.ok()) st = jax_ub::CudaStatus(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    const jax_ub::Status restored =
        jax_ub::CudaStatus(cudaSetDevice(current), "cudaSetDevice (restoring the device)");
    jax_ub::RaiseIfError(st.ok() ? restored : st);
    return std::make_pair(free, total);
  });
  // (runtime, driver) CUDA versions as CUDA encodes them (13000 = 13.0); driver 0: none.
  m.def("cuda_versions", []() {
    int runtime = 0, driver = 0;
    jax_ub::RaiseIfError(
        jax_ub::CudaStatus(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion"));
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    return std::make_pair(runtime, driver);
  });
  // Whether GPU a can map GPU b's memory (NVLink or PCIe peer access).
  m.def("can_access_peer", [](int a, int b) {
    int can = 0;
    jax_ub::RaiseIfError(
        jax_ub::CudaStatus(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer"));
    return can != 0;
  });
}
