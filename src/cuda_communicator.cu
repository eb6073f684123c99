#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda_check.h"
#include "cuda_communicator.h"
#include "cuda_sum.h"
#include "schedule.h"
#include "trace.h"

namespace jax_ub {
namespace {

using Clock = std::chrono::steady_clock;

// Stream memory operations come from the driver API; resolve them once through the
// runtime so the module links no libcuda (it imports on machines without a driver).
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using StreamBatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
struct DriverOps {
  StreamValueFn wait = nullptr;
  StreamValueFn write = nullptr;
  StreamBatchFn batch = nullptr;
};

Status LoadDriverOps(const DriverOps** out) {
  static DriverOps ops;
  static Status status = [] {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWaitValue64");
    ops.wait = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000,
                                                 cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWriteValue64");
    ops.write = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamBatchMemOp");
    ops.batch = reinterpret_cast<StreamBatchFn>(fn);
    return Status::Ok();
  }();
  *out = &ops;
  return status;
}

// Compares the descriptors that every peer sent with this rank's own call (`mine`).
// Healthy calls return at once. On a mismatch (first one only) block 0 writes the report
// and raises the slot's health word; while the health word is raised, for this call or
// any later one, every block fills the outputs with 0xFF bytes, a NaN in bf16, fp16 and
// f32, so a failed call can never hand plausible numbers to the program.
__global__ void VerifyCall(const uint64_t* desc_from, CallDescriptor mine, int size, int rank,
                           uint64_t* health, CudaCommunicator::DeviceReport* report, char* out0,
                           size_t bytes0, char* out1, size_t bytes1) {
  __shared__ int bad;
  if (threadIdx.x == 0) {
    const uint64_t* own = reinterpret_cast<const uint64_t*>(&mine);
    int peer = -1;
    for (int j = 0; j < size && peer < 0; ++j) {
      if (j == rank) continue;
      const volatile uint64_t* d = desc_from + j * CallDescriptor::kWords;
      for (int q = 0; q < CallDescriptor::kWords; ++q)
        if (d[q] != own[q]) peer = j;
    }
    volatile uint64_t* h = health;
    const uint64_t was = *h;
    if (peer >= 0 && was == 0 && blockIdx.x == 0) {
      volatile uint64_t* r = reinterpret_cast<volatile uint64_t*>(report);
      r[1] = static_cast<uint64_t>(peer);
      for (int q = 0; q < CallDescriptor::kWords; ++q) {
        r[2 + q] = own[q];
        r[2 + CallDescriptor::kWords + q] = desc_from[peer * CallDescriptor::kWords + q];
      }
      __threadfence_system();
      r[0] = 1;
      *h = 2;
    }
    bad = peer >= 0 || was != 0;
  }
  __syncthreads();
  if (!bad) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (size_t i = first; i < bytes0; i += stride) out0[i] = static_cast<char>(0xFF);
  for (size_t i = first; i < bytes1; i += stride) out1[i] = static_cast<char>(0xFF);
}

// Load every kernel of this module on the current device now: lazy loading in the
// middle of a call could block behind a stream that spins on a peer.
Status PreloadKernels() {
  cudaFuncAttributes attr;
  JAX_UB_RETURN_IF_ERROR(PreloadSumKernels());
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, VerifyCall));
  return Status::Ok();
}

std::string Describe(const char* op, int rank, int group) {
  return std::string(op) + ": rank " + std::to_string(rank) + " (group " + std::to_string(group) +
         ")";
}

}  // namespace

Status CudaCommunicator::Create(Topology topology, size_t capacity_bytes,
                                const CommOptions& options, bool multiprocess,
                                std::unique_ptr<CudaCommunicator>* out) {
  std::unique_ptr<CudaCommunicator> c(new CudaCommunicator());
  c->topology_ = std::move(topology);
  c->fold_rows_ = options.reduce_scatter_fold_rows;
  JAX_UB_RETURN_IF_ERROR(c->Allocate(capacity_bytes, options.timeout_s,
                                     GemmOptions::From(options), multiprocess));
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
    (*handles)[sl] = std::string(reinterpret_cast<const char*>(&hb), sizeof(hb)) +
                     std::string(reinterpret_cast<const char*>(&hf), sizeof(hf));
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
      if (handles[sl].size() != 2 * kHandle)
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
    }
  }
  return Wire();
}

Status CudaCommunicator::Allocate(size_t capacity_bytes, double timeout_s, GemmOptions gemm,
                                  bool multiprocess) {
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
    JAX_UB_CUDA(cudaStreamCreateWithFlags(&s->watchdog_stream, cudaStreamNonBlocking));
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
    std::memset(report, 0, sizeof(DeviceReport));
    JAX_UB_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->report_device), report, 0));
    CublasLtGemm* g = nullptr;
    JAX_UB_RETURN_IF_ERROR(CublasLtGemm::Create(gemm, &g));
    s->gemm.reset(g);
    JAX_UB_RETURN_IF_ERROR(PreloadKernels());
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
    cudaStreamDestroy(s.watchdog_stream);
    cudaStreamDestroy(s.tune);
    cudaFree(s.buffer);
    cudaFree(s.flags);
    if (s.report != nullptr) cudaFreeHost(s.report);
  }
}

bool CudaCommunicator::Quiesce() {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  do {
    if (broken_.broken()) return true;  // no more progress to wait for
    bool idle = true;
    uint64_t first = 0;
    bool have_first = false;
    for (auto& sp : slots_) {
      if (!sp || !sp->local) continue;
      const uint64_t e = sp->epoch.load();
      if (have_first && e != first) idle = false;
      first = e;
      have_first = true;
      std::lock_guard<std::mutex> lock(sp->mu);
      if (!sp->pending.empty()) idle = false;
    }
    if (idle) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (Clock::now() < deadline);
  return false;
}

Status CudaCommunicator::Begin(int device, const char* op, int64_t need_bytes, Slot** slot,
                               uint64_t* epoch) {
  if (broken_.broken())
    return FailedPrecondition(std::string(op) +
                              ": jax_ub communicator is broken by an earlier error (" +
                              broken_.reason() + "); call jax_ub.finalize() and run again");
  int sl = 0;
  JAX_UB_RETURN_IF_ERROR(topology_.SlotOfDevice(device, &sl));
  if (need_bytes < 0 || static_cast<size_t>(need_bytes) > capacity_)
    return InvalidArgument(std::string(op) + ": userbuffer too small: the op needs " +
                           std::to_string(need_bytes) + " bytes per GPU, the communicator has " +
                           std::to_string(capacity_) +
                           "; raise jax_ub.configure(buffer_bytes=...)");
  Slot* s = slots_[sl].get();
  JAX_UB_CUDA(cudaSetDevice(s->device));
  *slot = s;
  *epoch = ++s->epoch;
  JAX_UB_TRACE("GPU %d %s call #%llu begins", s->device, op,
               static_cast<unsigned long long>(*epoch));
  return Status::Ok();
}

Status CudaCommunicator::WaitFlag(Slot& s, cudaStream_t stream, int flag_index, uint64_t target,
                                  int peer, const char* what, std::vector<Wait>* waits,
                                  int progress_index) {
  if (target == 0) return Status::Ok();  // first call: nothing to wait for
  const DriverOps* ops;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
  uint64_t* flag = s.flags + flag_index;
  JAX_UB_CU(ops->wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag),
                      target, CU_STREAM_WAIT_VALUE_GEQ));
  const uint64_t* progress = progress_index < 0 ? flag : s.flags + progress_index;
  waits->push_back(Wait{peer, flag, target, what, progress});
  return Status::Ok();
}

Status CudaCommunicator::Signal(cudaStream_t stream, uint64_t* remote_flag, uint64_t value) {
  const DriverOps* ops;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
  // The default flags order this write after all earlier work of the stream, including
  // the data copy it announces, with a memory barrier.
  JAX_UB_CU(ops->write(reinterpret_cast<CUstream>(stream),
                       reinterpret_cast<CUdeviceptr>(remote_flag), value,
                       CU_STREAM_WRITE_VALUE_DEFAULT));
  return Status::Ok();
}

Status CudaCommunicator::Publish(Slot& s, cudaStream_t stream, int p, const CallDescriptor& desc) {
  const DriverOps* ops;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
  const uint64_t* words = reinterpret_cast<const uint64_t*>(&desc);
  uint64_t* dst = s.peer_flags[p] + kDescFlag + s.rank * CallDescriptor::kWords;
  CUstreamBatchMemOpParams params[CallDescriptor::kWords] = {};
  for (int q = 0; q < CallDescriptor::kWords; ++q) {
    params[q].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    params[q].writeValue.address = reinterpret_cast<CUdeviceptr>(dst + q);
    params[q].writeValue.value64 = words[q];
    params[q].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  JAX_UB_CU(ops->batch(reinterpret_cast<CUstream>(stream), CallDescriptor::kWords, params, 0));
  return Status::Ok();
}

Status CudaCommunicator::Verify(Slot& s, const CallDescriptor& desc, void* out0, size_t bytes0,
                                void* out1, size_t bytes1) {
  if (topology_.group_size() == 1) return Status::Ok();  // no peer to disagree with
  // A few blocks: a healthy call only reads ~40 words; a failed one fills its outputs.
  VerifyCall<<<16, 256, 0, s.compute>>>(
      s.flags + kDescFlag, desc, topology_.group_size(), s.rank, s.flags + kHealthFlag,
      s.report_device, static_cast<char*>(out0), bytes0, static_cast<char*>(out1), bytes1);
  return CudaStatus(cudaGetLastError(), "VerifyCall launch");
}

Status CudaCommunicator::Finish(Slot& s, cudaStream_t xla_stream, const char* op, uint64_t epoch,
                                std::vector<Wait> waits) {
  JAX_UB_CUDA(cudaEventRecord(s.compute_done, s.compute));
  JAX_UB_CUDA(cudaStreamWaitEvent(xla_stream, s.compute_done));
  for (int r = 0; r < topology_.group_size(); ++r) {
    if (r == s.rank) continue;
    JAX_UB_CUDA(cudaStreamWaitEvent(xla_stream, s.comm_done[r]));
  }
  cudaEvent_t done = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.free_events.empty()) {
      done = s.free_events.back();
      s.free_events.pop_back();
    }
  }
  if (done == nullptr) JAX_UB_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  JAX_UB_CUDA(cudaEventRecord(done, xla_stream));
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const auto since = s.pending.empty() ? Clock::now() : Clock::time_point::max();
    s.pending.push_back(Pending{done, epoch, op, std::move(waits), since});
  }
  JAX_UB_TRACE("GPU %d %s call #%llu enqueued", s.device, op,
               static_cast<unsigned long long>(epoch));
  return AwaitLocalPeers(s, op, epoch);
}

Status CudaCommunicator::AwaitLocalPeers(Slot& s, const char* op, uint64_t epoch) {
  s.enqueued.store(epoch, std::memory_order_release);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  for (int r = 0; r < topology_.group_size(); ++r) {
    const Slot& q = *slots_[topology_.slot(s.group, r)];
    if (!q.local || &q == &s) continue;
    for (int spin = 0; q.enqueued.load(std::memory_order_acquire) < epoch; ++spin) {
      if (broken_.broken())
        return FailedPrecondition(Describe(op, s.rank, s.group) +
                                  ": jax_ub communicator is broken (" + broken_.reason() + ")");
      if (Clock::now() > deadline) {
        const std::string reason =
            Describe(op, s.rank, s.group) + " (GPU " + std::to_string(s.device) +
            ") timed out after " + std::to_string(timeout_s_) + " s waiting for rank " +
            std::to_string(q.rank) + " (GPU " + std::to_string(q.device) +
            ", same process) to enqueue call #" + std::to_string(epoch) + " (it has reached #" +
            std::to_string(q.enqueued.load()) +
            "); the GPUs of one process must make the same jax_ub calls in the same order";
        broken_.Mark(reason);
        return DeadlineExceeded(reason);
      }
      if (spin < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }
  const int64_t waited_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  s.await_ns.fetch_add(waited_ns, std::memory_order_relaxed);
  if (waited_ns > 100'000'000)
    JAX_UB_TRACE("GPU %d %s call #%llu waited %.3f s for the process's other GPUs", s.device, op,
                 static_cast<unsigned long long>(epoch), waited_ns * 1e-9);
  return Status::Ok();
}

std::vector<CudaCommunicator::HostTime> CudaCommunicator::HostTimes() const {
  std::vector<HostTime> out;
  for (const auto& sp : slots_)
    if (sp && sp->local)
      out.push_back(
          HostTime{sp->device, sp->host_calls.load(), sp->host_ns.load(), sp->await_ns.load()});
  return out;
}

Status CudaCommunicator::EndCall(Slot* s, const char* op, Clock::time_point since, Status st) {
  if (s == nullptr) return st;
  s->host_calls.fetch_add(1, std::memory_order_relaxed);
  s->host_ns.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count(),
      std::memory_order_relaxed);
  // Before Begin nothing was enqueued and every rank checks the same things; after it,
  // peers wait (on their GPUs and in AwaitLocalPeers) for work this call will never
  // enqueue. Failing them now beats letting each run into its timeout.
  if (!st.ok())
    broken_.Mark(Describe(op, s->rank, s->group) + " failed on GPU " + std::to_string(s->device) +
                 " after it began: " + st.message());
  return st;
}

Status CudaCommunicator::AllGatherMatmul(int device, cudaStream_t xs, DType t, const void* x,
                                         const void* w, bool w_transposed, void* out,
                                         void* gathered, int64_t m, int64_t k, int64_t n) {
  const auto since = Clock::now();
  Slot* s = nullptr;
  Status st = EnqueueAllGatherMatmul(device, xs, t, x, w, w_transposed, out, gathered, m, k, n, &s);
  return EndCall(s, "all_gather_matmul", since, std::move(st));
}

Status CudaCommunicator::MatmulReduceScatter(int device, cudaStream_t xs, DType t, const void* x,
                                             const void* w, bool w_transposed, void* out, int64_t m,
                                             int64_t k, int64_t n) {
  const auto since = Clock::now();
  Slot* s = nullptr;
  Status st = EnqueueMatmulReduceScatter(device, xs, t, x, w, w_transposed, out, m, k, n, &s);
  return EndCall(s, "matmul_reduce_scatter", since, std::move(st));
}

Status CudaCommunicator::EnqueueAllGatherMatmul(int device, cudaStream_t xs, DType t, const void* x,
                                                const void* w, bool w_transposed, void* out,
                                                void* gathered, int64_t m, int64_t k, int64_t n,
                                                Slot** began) {
  const char* op = "all_gather_matmul";
  const int size = topology_.group_size();
  const int64_t es = DTypeSize(t);
  const int64_t chunk = m * k * es;
  Slot* s = nullptr;
  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(
      Begin(device, op, RequiredBytes(OpKind::kAllGatherMatmul, chunk, size), &s, &e));
  *began = s;
  const Schedule sched{s->rank, size};
  const std::vector<int> peers = sched.PushOrder();
  const CallDescriptor desc{
      static_cast<uint32_t>(OpKind::kAllGatherMatmul), static_cast<uint32_t>(t), m, k, n, e};
  std::vector<Wait> waits;
  // A shape's first call picks (and loads) its GEMM kernels before anything waits on a
  // peer (see CublasLtGemm::Prepare). Remote chunks may still be landing in `buffer`,
  // which only matters for their values; `out` is rewritten below.
  const std::vector<Schedule::Span> spans = sched.AllGatherSpans();
  std::vector<CublasLtGemm::Plan*> plans(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const void* src = spans[i].first == s->rank ? x : s->buffer + spans[i].first * chunk;
    JAX_UB_RETURN_IF_ERROR(s->gemm->Prepare(t, src, w, w_transposed,
                                            static_cast<char*>(out) + spans[i].first * m * n * es,
                                            spans[i].count * m, k, n, nullptr, s->tune, &plans[i]));
  }
  s->gemm->BeginCall();
  JAX_UB_CUDA(cudaEventRecord(s->start, xs));
  JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->start));

  // Push our shard to every peer at once, one copy-engine stream per peer.
  for (int p : peers) {
    cudaStream_t cs = s->comm[p];
    JAX_UB_CUDA(cudaStreamWaitEvent(cs, s->start));
    JAX_UB_RETURN_IF_ERROR(
        WaitFlag(*s, cs, kCreditFlag + p, e - 1, p, "free its userbuffer", &waits));
    JAX_UB_RETURN_IF_ERROR(Publish(*s, cs, p, desc));
    JAX_UB_CUDA(cudaMemcpyAsync(s->peer_buffer[p] + s->rank * chunk, x, chunk,
                                cudaMemcpyDeviceToDevice, cs));
    JAX_UB_RETURN_IF_ERROR(Signal(cs, s->peer_flags[p] + kDataFlag + s->rank, e));
    JAX_UB_CUDA(cudaEventRecord(s->comm_done[p], cs));
  }
  // The gathered copy, when asked for, runs on its own stream beside the GEMMs.
  cudaStream_t gs = s->comm[s->rank];
  if (gathered != nullptr) {
    JAX_UB_CUDA(cudaStreamWaitEvent(gs, s->start));
    JAX_UB_CUDA(cudaMemcpyAsync(static_cast<char*>(gathered) + s->rank * chunk, x, chunk,
                                cudaMemcpyDeviceToDevice, gs));
  }
  // Multiply the local chunk, then the remote ones once they have landed.
  for (size_t i = 0; i < spans.size(); ++i) {
    const Schedule::Span& span = spans[i];
    const char* src = static_cast<const char*>(x);
    if (span.first != s->rank) {
      for (int j = span.first; j < span.first + span.count; ++j) {
        JAX_UB_RETURN_IF_ERROR(
            WaitFlag(*s, s->compute, kDataFlag + j, e, j, "deliver its chunk", &waits));
        if (gathered != nullptr)
          JAX_UB_RETURN_IF_ERROR(
              WaitFlag(*s, gs, kDataFlag + j, e, j, "deliver its chunk", &waits));
      }
      src = s->buffer + span.first * chunk;
      if (gathered != nullptr)
        JAX_UB_CUDA(cudaMemcpyAsync(static_cast<char*>(gathered) + span.first * chunk, src,
                                    span.count * chunk, cudaMemcpyDeviceToDevice, gs));
    }
    JAX_UB_RETURN_IF_ERROR(s->gemm->Matmul(
        plans[i], src, w, static_cast<char*>(out) + span.first * m * n * es, s->compute));
  }
  if (gathered != nullptr) {
    JAX_UB_CUDA(cudaEventRecord(s->ready[s->rank], gs));
    JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->ready[s->rank]));
  }
  JAX_UB_RETURN_IF_ERROR(
      Verify(*s, desc, out, size * m * n * es, gathered, gathered == nullptr ? 0 : size * chunk));
  // Our buffer is free again: tell every sender.
  for (int p : peers)
    JAX_UB_RETURN_IF_ERROR(Signal(s->compute, s->peer_flags[p] + kCreditFlag + s->rank, e));
  return Finish(*s, xs, op, e, std::move(waits));
}

Status CudaCommunicator::EnqueueMatmulReduceScatter(int device, cudaStream_t xs, DType t,
                                                    const void* x, const void* w, bool w_transposed,
                                                    void* out, int64_t m, int64_t k, int64_t n,
                                                    Slot** began) {
  const char* op = "matmul_reduce_scatter";
  const int size = topology_.group_size();
  const int64_t es = DTypeSize(t);
  const int64_t chunk = m * n * es;
  Slot* s = nullptr;
  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(
      Begin(device, op, RequiredBytes(OpKind::kMatmulReduceScatter, chunk, size), &s, &e));
  *began = s;
  const Schedule sched{s->rank, size, fold_rows_};
  const CallDescriptor desc{
      static_cast<uint32_t>(OpKind::kMatmulReduceScatter), static_cast<uint32_t>(t), m, k, n, e};
  std::vector<Wait> waits;
  char* recv = s->buffer;                  // [size] partials addressed to us, by sender
  char* stage = s->buffer + size * chunk;  // [size] partials we computed for each peer
  char* own = recv + s->rank * chunk;      // our own partial, when it is summed in a pass
  // Each block in `pieces` row ranges (Schedule::ReduceScatterPieces); with `fold`, our
  // own product adds the peer's partial in its epilogue and writes `out`, with no sum pass.
  const std::vector<Schedule::Rows> piece_rows = sched.ReduceScatterPieces(m);
  const int pieces = static_cast<int>(piece_rows.size());
  const bool fold = sched.ReduceScatterFolds(m);
  auto offset = [&](int p) { return piece_rows[p].first * n * es; };  // in a partial
  auto input = [&](int d, int p) {                                    // piece p of row block d of x
    return static_cast<const char*>(x) + (d * m + piece_rows[p].first) * k * es;
  };
  // Where our own block's piece p goes, and what it adds (null: nothing).
  char* own_out = size == 1 || fold ? static_cast<char*>(out) : own;
  auto addend = [&](int p) -> const char* {
    return fold ? recv + (1 - s->rank) * chunk + offset(p) : nullptr;
  };
  // A shape's first call picks (and loads) its GEMM kernels before anything waits on a
  // peer (see CublasLtGemm::Prepare), with our own block's operands. Peers may be writing
  // their partials into `recv` meanwhile, which only matters for values; this writes
  // only `out` and our own slot of `recv`, which no peer writes.
  std::vector<CublasLtGemm::Plan*> plans(pieces);
  for (int p = 0; p < pieces; ++p)
    JAX_UB_RETURN_IF_ERROR(s->gemm->Prepare(t, input(s->rank, p), w, w_transposed,
                                            own_out + offset(p), piece_rows[p].count, k, n,
                                            addend(p), s->tune, &plans[p]));
  s->gemm->BeginCall();
  JAX_UB_CUDA(cudaEventRecord(s->start, xs));
  JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->start));
  // Each peer's partial first, each piece sent while the next one is computed; ours last.
  for (int d : sched.ReduceScatterComputeOrder()) {
    for (int p = 0; p < pieces; ++p) {
      const char* a = input(d, p);
      if (d == s->rank) {
        if (fold) {
          const int peer = 1 - s->rank;
          // A first-piece flag says nothing of unpieced calls: report the data flag.
          JAX_UB_RETURN_IF_ERROR(WaitFlag(*s, s->compute, PieceFlag(p, pieces) + peer, e, peer,
                                          "deliver its partial sum", &waits, kDataFlag + peer));
        }
        JAX_UB_RETURN_IF_ERROR(
            s->gemm->Matmul(plans[p], a, w, own_out + offset(p), s->compute, addend(p)));
        continue;
      }
      char* dst = stage + d * chunk + offset(p);
      JAX_UB_RETURN_IF_ERROR(s->gemm->Matmul(plans[p], a, w, dst, s->compute));
      cudaStream_t cs = s->comm[d];
      JAX_UB_CUDA(cudaEventRecord(s->ready[d], s->compute));
      JAX_UB_CUDA(cudaStreamWaitEvent(cs, s->ready[d]));
      if (p == 0) {
        JAX_UB_RETURN_IF_ERROR(
            WaitFlag(*s, cs, kCreditFlag + d, e - 1, d, "free its userbuffer", &waits));
        JAX_UB_RETURN_IF_ERROR(Publish(*s, cs, d, desc));
      }
      JAX_UB_CUDA(cudaMemcpyAsync(s->peer_buffer[d] + s->rank * chunk + offset(p), dst,
                                  piece_rows[p].count * n * es, cudaMemcpyDeviceToDevice, cs));
      JAX_UB_RETURN_IF_ERROR(Signal(cs, s->peer_flags[d] + PieceFlag(p, pieces) + s->rank, e));
    }
    if (d != s->rank) JAX_UB_CUDA(cudaEventRecord(s->comm_done[d], s->comm[d]));
  }
  if (size > 1 && !fold) {
    for (int j : sched.ReductionOrder()) {
      if (j == s->rank) continue;
      JAX_UB_RETURN_IF_ERROR(
          WaitFlag(*s, s->compute, kDataFlag + j, e, j, "deliver its partial sum", &waits));
    }
    JAX_UB_RETURN_IF_ERROR(LaunchSum(t, recv, m * n, size, out, s->compute));
  }
  JAX_UB_RETURN_IF_ERROR(Verify(*s, desc, out, chunk, nullptr, 0));
  // Credits promise peers the whole buffer, staging area included: wait until our own
  // partials have left it, or a peer's next push could overwrite one still in flight.
  const std::vector<int> peers = sched.PushOrder();
  for (int p : peers) JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->comm_done[p]));
  for (int p : peers)
    JAX_UB_RETURN_IF_ERROR(Signal(s->compute, s->peer_flags[p] + kCreditFlag + s->rank, e));
  return Finish(*s, xs, op, e, std::move(waits));
}

void CudaCommunicator::WatchdogLoop() {
  auto last_trace = Clock::now();
  while (!stop_.load()) {
    bool busy = false;
    // With tracing on, say every 2 s what is pending; if these lines stop, the watchdog
    // itself is stuck in a CUDA call.
    const bool trace = TraceEnabled() && Clock::now() - last_trace > std::chrono::seconds(2);
    if (trace) last_trace = Clock::now();
    for (auto& sp : slots_) {
      Slot& s = *sp;
      if (!s.local) continue;
      std::lock_guard<std::mutex> lock(s.mu);
      if (trace && !s.pending.empty())
        JAX_UB_TRACE("watchdog: GPU %d has %zu calls in flight, the oldest %s #%llu", s.device,
                     s.pending.size(), s.pending.front().op,
                     static_cast<unsigned long long>(s.pending.front().epoch));
      while (!s.pending.empty()) {
        Pending& f = s.pending.front();
        cudaSetDevice(s.device);
        cudaError_t q = cudaEventQuery(f.done);
        if (q == cudaSuccess) {
          const volatile DeviceReport* r = s.report;
          if (r->code != 0 && !s.reported) {
            s.reported = true;
            CallDescriptor mine, theirs;
            std::memcpy(&mine, const_cast<const CallDescriptor*>(&r->mine), sizeof(mine));
            std::memcpy(&theirs, const_cast<const CallDescriptor*>(&r->theirs), sizeof(theirs));
            const std::string reason =
                Describe(f.op, s.rank, s.group) + ": ranks disagree on the call: rank " +
                std::to_string(s.rank) + " runs " + mine.ToString() + " but rank " +
                std::to_string(r->peer) + " sent " + theirs.ToString() +
                "; the outputs of this call were filled with NaN";
            std::fprintf(stderr, "jax_ub: %s\n", reason.c_str());
            broken_.Mark(reason);
          }
          s.free_events.push_back(f.done);
          s.pending.pop_front();
          if (!s.pending.empty()) s.pending.front().since = Clock::now();
          continue;
        }
        if (q != cudaErrorNotReady) {
          broken_.Mark(Describe(f.op, s.rank, s.group) +
                       ": CUDA error while running: " + cudaGetErrorString(q));
          break;
        }
        if (Clock::now() - f.since > std::chrono::duration<double>(timeout_s_)) {
          // Name the peer we are stuck on, then release the stream so the job ends
          // with an error instead of hanging. The health word goes up first, so the
          // released call fills its outputs with NaN instead of computing on stale data.
          const uint64_t unhealthy = 1;
          cudaMemcpyAsync(s.flags + kHealthFlag, &unhealthy, sizeof(unhealthy),
                          cudaMemcpyHostToDevice, s.watchdog_stream);
          cudaStreamSynchronize(s.watchdog_stream);
          std::string reason;
          for (const Wait& wt : f.waits) {
            uint64_t seen = 0;
            cudaMemcpyAsync(&seen, wt.flag, sizeof(seen), cudaMemcpyDeviceToHost,
                            s.watchdog_stream);
            cudaStreamSynchronize(s.watchdog_stream);
            if (static_cast<int64_t>(seen - wt.target) >= 0) continue;
            uint64_t last = seen;
            if (wt.progress != wt.flag) {
              cudaMemcpyAsync(&last, wt.progress, sizeof(last), cudaMemcpyDeviceToHost,
                              s.watchdog_stream);
              cudaStreamSynchronize(s.watchdog_stream);
            }
            if (reason.empty())
              reason = Describe(f.op, s.rank, s.group) + " timed out after " +
                       std::to_string(timeout_s_) + " s waiting for rank " +
                       std::to_string(wt.peer) + " to " + wt.what + " for call #" +
                       std::to_string(wt.target) + " (flag holds #" + std::to_string(last) +
                       "); the peer never arrived, is stuck, or runs a different program. The "
                       "outputs of this call are NaN";
            uint64_t target = wt.target;
            cudaMemcpyAsync(const_cast<uint64_t*>(wt.flag), &target, sizeof(target),
                            cudaMemcpyHostToDevice, s.watchdog_stream);
            cudaStreamSynchronize(s.watchdog_stream);
          }
          if (reason.empty())
            reason = Describe(f.op, s.rank, s.group) + " did not finish within the timeout";
          std::fprintf(stderr, "jax_ub: %s\n", reason.c_str());
          broken_.Mark(reason);
          f.since = Clock::time_point::max();
        }
        busy = true;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(busy ? 1 : 10));
  }
}

}  // namespace jax_ub
