// Creation, peer mapping (in one process or through CUDA IPC), teardown and quiescing.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda/check.h"
#include "cuda/communicator.h"
#include "cuda/communicator_internal.h"
#include "cuda/driver_api.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/sum.h"
#include "cuda/trace.h"
#include "cuda/verify.h"
#include "protocol/quiesce.h"
#include "protocol/schedule.h"

namespace jax_ub {

Status CudaCommunicator::Create(Topology topology, size_t capacity_bytes,
                                const CommOptions& options, bool multiprocess,
                                std::unique_ptr<CudaCommunicator>* out) {
  std::unique_ptr<CudaCommunicator> c(new CudaCommunicator());
  c->topology_ = std::move(topology);
  c->schedule_ = Schedule::Of(options);
  c->compute_on_caller_stream_ = options.compute_on_caller_stream;
  JAX_UB_RETURN_IF_ERROR(c->Allocate(capacity_bytes, options.timeout_s, GemmOptions::From(options),
                                     options.autotune_reduce_scatter, multiprocess));
  // Across processes the peers' buffers arrive later, through Connect().
  if (!multiprocess) JAX_UB_RETURN_IF_ERROR(c->Wire());
  *out = std::move(c);
  return Status::Ok();
}

Status CudaCommunicator::ExportHandles(std::vector<std::string>* handles) const {
  handles->assign(slots_.size(), "");
  for (size_t sl = 0; sl < slots_.size(); ++sl) {
    const Slot& s = *slots_[sl];
    if (!s.local) continue;
    JAX_UB_CUDA(cudaSetDevice(s.device));
    cudaIpcMemHandle_t hb, hf;
    JAX_UB_CUDA(cudaIpcGetMemHandle(&hb, s.buffer));
    JAX_UB_CUDA(cudaIpcGetMemHandle(&hf, s.flags));
    // Then the GPU's UUID: a peer on the same GPU (the N-ranks mode) shares its SMs.
    cudaDeviceProp prop;
    JAX_UB_CUDA(cudaGetDeviceProperties(&prop, s.device));
    const cudaUUID_t uuid = prop.uuid;
    (*handles)[sl] = std::string(reinterpret_cast<const char*>(&hb), sizeof(hb)) +
                     std::string(reinterpret_cast<const char*>(&hf), sizeof(hf)) +
                     std::string(reinterpret_cast<const char*>(&uuid), sizeof(uuid));
  }
  return Status::Ok();
}

Status CudaCommunicator::Connect(const std::vector<std::string>& handles) {
  if (handles.size() != slots_.size())
    return InvalidArgument("Connect needs one handle per slot, got " +
                           std::to_string(handles.size()));
  constexpr size_t kHandle = sizeof(cudaIpcMemHandle_t);
  for (size_t sl = 0; sl < slots_.size(); ++sl) {
    Slot& s = *slots_[sl];
    if (s.local) continue;
    // Open a remote slot on every GPU where this process has a rank of its group.
    for (int r = 0; r < topology_.group_size(); ++r) {
      const Slot& q = *slots_[topology_.slot(s.group, r)];
      if (!q.local) continue;
      if (handles[sl].size() != 2 * kHandle + sizeof(cudaUUID_t))
        return FailedPrecondition("no CUDA IPC handle arrived for slot " + std::to_string(sl));
      cudaIpcMemHandle_t hb, hf;
      std::memcpy(&hb, handles[sl].data(), kHandle);
      std::memcpy(&hf, handles[sl].data() + kHandle, kHandle);
      JAX_UB_CUDA(cudaSetDevice(q.device));
      void* b = nullptr;
      void* f = nullptr;
      cudaError_t err = cudaIpcOpenMemHandle(&b, hb, cudaIpcMemLazyEnablePeerAccess);
      if (err == cudaSuccess) err = cudaIpcOpenMemHandle(&f, hf, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        if (b != nullptr) cudaIpcCloseMemHandle(b);
        return FailedPrecondition(
            "GPU " + std::to_string(q.device) + " cannot map the userbuffer of slot " +
            std::to_string(sl) + " (rank " + std::to_string(s.rank) + " of group " +
            std::to_string(s.group) + ", another process): " + cudaGetErrorString(err) +
            ". GPUs of different hosts, or without peer access, cannot share a userbuffer "
            "group: keep the tensor-parallel axis inside one NVLink host, or use impl='xla'");
      }
      s.mappings.push_back({q.device, static_cast<char*>(b), static_cast<uint64_t*>(f)});
      cudaDeviceProp prop;
      JAX_UB_CUDA(cudaGetDeviceProperties(&prop, q.device));
      if (std::memcmp(&prop.uuid, handles[sl].data() + 2 * kHandle, sizeof(prop.uuid)) == 0)
        slots_[topology_.slot(s.group, r)]->shares_gpu = true;
    }
  }
  return Wire();
}

Status CudaCommunicator::Allocate(size_t capacity_bytes, double timeout_s, GemmOptions gemm,
                                  bool tune_reduce_scatter, bool multiprocess) {
  const DriverOps* ops;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
  capacity_ = (capacity_bytes + 255) / 256 * 256;
  timeout_s_ = timeout_s;
  const int size = topology_.group_size();
  slots_.resize(topology_.num_slots());
  for (int sl = 0; sl < topology_.num_slots(); ++sl) {
    auto s = std::make_unique<Slot>();
    s->rank = topology_.rank_of(sl);
    s->group = topology_.group_of(sl);
    if (!topology_.is_local(sl)) {
      if (!multiprocess)
        return FailedPrecondition("slot " + std::to_string(sl) +
                                  " is in another process and needs the multi-process "
                                  "bootstrap (jax.distributed)");
      slots_[sl] = std::move(s);  // filled in by Connect()
      continue;
    }
    s->local = true;
    s->device = topology_.device_of(sl);
    JAX_UB_CUDA(cudaSetDevice(s->device));
    JAX_UB_CUDA(cudaMalloc(&s->buffer, capacity_));
    JAX_UB_CUDA(cudaMalloc(&s->flags, kNumFlags * sizeof(uint64_t)));
    JAX_UB_CUDA(cudaMemset(s->flags, 0, kNumFlags * sizeof(uint64_t)));
    JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->compute, cudaStreamNonBlocking));
    JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->second_gemm, cudaStreamNonBlocking));
    JAX_UB_CUDA(cudaEventCreateWithFlags(&s->second_gemm_done, cudaEventDisableTiming));
    JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->release_stream, cudaStreamNonBlocking));
    JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->tune, cudaStreamNonBlocking));
    JAX_UB_CUDA(cudaEventCreateWithFlags(&s->start, cudaEventDisableTiming));
    JAX_UB_CUDA(cudaEventCreateWithFlags(&s->compute_done, cudaEventDisableTiming));
    s->comm.assign(size, nullptr);
    s->comm_done.assign(size, nullptr);
    s->ready.assign(size, nullptr);
    for (int r = 0; r < size; ++r) {
      JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->comm[r], cudaStreamNonBlocking));
      JAX_UB_CUDA(cudaEventCreateWithFlags(&s->comm_done[r], cudaEventDisableTiming));
      JAX_UB_CUDA(cudaEventCreateWithFlags(&s->ready[r], cudaEventDisableTiming));
    }
    void* report = nullptr;
    JAX_UB_CUDA(cudaHostAlloc(&report, sizeof(DeviceReport), cudaHostAllocMapped));
    s->report = static_cast<DeviceReport*>(report);
    void* board = nullptr;
    JAX_UB_CUDA(cudaHostAlloc(&board, sizeof(ReleaseBoard), cudaHostAllocMapped));
    s->board = static_cast<ReleaseBoard*>(board);
    std::memset(board, 0, sizeof(ReleaseBoard));
    JAX_UB_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->board_device), board, 0));
    std::memset(report, 0, sizeof(DeviceReport));
    JAX_UB_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->report_device), report, 0));
    CublasLtGemm* g = nullptr;
    JAX_UB_RETURN_IF_ERROR(CublasLtGemm::Create(gemm, &g));
    s->gemm.reset(g);
    if (gemm.autotune && !tune_reduce_scatter) {
      GemmOptions untuned = gemm;
      untuned.autotune = false;
      JAX_UB_RETURN_IF_ERROR(CublasLtGemm::Create(untuned, &g));
      s->reduce_scatter_gemm.reset(g);
    }
    // Agreement messages are matched by their order, so every rank must make the same GEMM
    // shapes in the same order. In groups of more than two, the all-gather's spans
    // (Schedule::AllGatherSpans) differ by rank: there each GPU still chooses alone.
    if (size == 2) {
      s->agreement = MakeAgreement(s.get());
      s->gemm->SetAgreement(s->agreement.get());
    }
    JAX_UB_CUDA(cudaDeviceGetAttribute(&s->sm_count, cudaDevAttrMultiProcessorCount, s->device));
    int major = 0, minor = 0;
    JAX_UB_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s->device));
    JAX_UB_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, s->device));
    s->flag_gemm_runs = FlagGemmBuilt() && major == 9 && minor == 0;  // its SASS is sm_90a's
    JAX_UB_RETURN_IF_ERROR(PreloadKernels());
    // A GPU whose driver cannot load the CUTLASS kernels keeps its library GEMMs, and says so.
    if (s->flag_gemm_runs) {
      const Status loaded = PreloadFlagGemms();
      if (!loaded.ok()) {
        cudaGetLastError();  // not sticky: a kernel image that did not load
        s->flag_gemm_runs = false;
        std::fprintf(stderr, "jax_ub: GPU %d keeps library GEMMs, the flag GEMM's kernels: %s\n",
                     s->device, loaded.message().c_str());
      }
    }
    slots_[sl] = std::move(s);
  }
  return Status::Ok();
}

Status CudaCommunicator::Wire() {
  const int size = topology_.group_size();
  // Peer access inside every group, then everyone's pointers to everyone's buffers.
  for (int sl = 0; sl < topology_.num_slots(); ++sl) {
    Slot& s = *slots_[sl];
    if (!s.local) continue;
    s.peer_buffer.assign(size, nullptr);
    s.peer_flags.assign(size, nullptr);
    for (int r = 0; r < size; ++r) {
      Slot& peer = *slots_[topology_.slot(s.group, r)];
      if (peer.local) {
        s.peer_buffer[r] = peer.buffer;
        s.peer_flags[r] = peer.flags;
      }
      for (const Slot::Mapping& m : peer.mappings) {
        if (m.device != s.device) continue;
        s.peer_buffer[r] = m.buffer;
        s.peer_flags[r] = m.flags;
      }
      if (s.peer_buffer[r] == nullptr || s.peer_flags[r] == nullptr)
        return FailedPrecondition("rank " + std::to_string(r) + " of group " +
                                  std::to_string(s.group) + " has no userbuffer mapped on GPU " +
                                  std::to_string(s.device));
      if (r == s.rank || !peer.local) continue;  // remote peers: mapped through CUDA IPC
      int can = 0;
      JAX_UB_CUDA(cudaDeviceCanAccessPeer(&can, s.device, peer.device));
      if (!can)
        return FailedPrecondition(
            "GPU " + std::to_string(s.device) + " cannot access the memory of GPU " +
            std::to_string(peer.device) +
            " (no NVLink or PCIe peer access), so they cannot share a userbuffer group; put "
            "the tensor-parallel axis on peer-connected GPUs or use impl='xla'");
      JAX_UB_CUDA(cudaSetDevice(s.device));
      cudaError_t err = cudaDeviceEnablePeerAccess(peer.device, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear the sticky-free error the runtime records
      } else {
        JAX_UB_CUDA(err);
      }
    }
  }
  // Check once that stream memory operations reach peer memory, and settle everything.
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (!s.local) continue;
    JAX_UB_CUDA(cudaSetDevice(s.device));
    for (int r = 0; r < size; ++r) {
      if (r == s.rank) continue;
      JAX_UB_RETURN_IF_ERROR(Signal(s.compute, s.peer_flags[r] + kCreditFlag + s.rank, 0));
    }
    JAX_UB_CUDA(cudaStreamSynchronize(s.compute));
    JAX_UB_CUDA(cudaDeviceSynchronize());
  }
  watchdog_ = std::thread([this] { WatchdogLoop(); });
  return Status::Ok();
}

CudaCommunicator::~CudaCommunicator() {
  // Let in-flight calls finish (the watchdog still releases stuck ones), then stop it.
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_ + 5.0);
  for (auto& sp : slots_) {
    if (!sp || !sp->local) continue;
    while (Clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(sp->mu);
        if (sp->pending.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  for (auto& sp : slots_) {  // mappings of remote buffers first, while peers still exist
    if (!sp || sp->local) continue;
    for (const Slot::Mapping& m : sp->mappings) {
      cudaSetDevice(m.device);
      cudaIpcCloseMemHandle(m.buffer);
      cudaIpcCloseMemHandle(m.flags);
    }
  }
  for (auto& sp : slots_) {
    if (!sp || !sp->local) continue;
    Slot& s = *sp;
    cudaSetDevice(s.device);
    cudaDeviceSynchronize();
    s.gemm.reset();
    s.reduce_scatter_gemm.reset();
    for (auto& p : s.pending) cudaEventDestroy(p.done);
    for (cudaEvent_t e : s.free_events) cudaEventDestroy(e);
    for (int r = 0; r < static_cast<int>(s.comm.size()); ++r) {
      cudaStreamDestroy(s.comm[r]);
      cudaEventDestroy(s.comm_done[r]);
      cudaEventDestroy(s.ready[r]);
    }
    cudaEventDestroy(s.start);
    cudaEventDestroy(s.compute_done);
    cudaStreamDestroy(s.compute);
    cudaStreamDestroy(s.second_gemm);
    cudaEventDestroy(s.second_gemm_done);
    cudaStreamDestroy(s.release_stream);
    cudaStreamDestroy(s.tune);
    cudaFree(s.buffer);
    cudaFree(s.flags);
    if (s.report != nullptr) cudaFreeHost(s.report);
    if (s.board != nullptr) cudaFreeHost(s.board);
  }
}

bool CudaCommunicator::Quiesce() {
  return WaitUntilIdle(timeout_s_, broken_, [&] {
    EvenCalls even;
    for (auto& sp : slots_) {
      if (!sp || !sp->local) continue;
      even.Add(sp->group, sp->epoch.load());
      std::lock_guard<std::mutex> lock(sp->mu);
      if (!sp->pending.empty()) return false;
    }
    return even.even();
  });
}

}  // namespace jax_ub
