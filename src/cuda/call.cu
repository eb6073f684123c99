// A call: its entry point (Call: Begin, the step list that enqueue.cu enqueues, EndCall) and
// the steps every call is made of: begin, flag waits and signals, descriptors, the verify,
// the end of a call, and host time accounting.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda/check.h"
#include "cuda/communicator.h"
#include "cuda/communicator_internal.h"
#include "cuda/driver_api.h"
#include "cuda/sum.h"
#include "cuda/trace.h"
#include "cuda/verify.h"
#include "protocol/schedule.h"

namespace jax_ub {

Status CudaCommunicator::Call(int device, cudaStream_t xs, OpKind op, const CallShape& shape,
                              const Operands& ops) {
  const auto since = Clock::now();
  Slot* s = nullptr;
  Status st = Enqueue(device, xs, op, shape, ops, &s);
  return EndCall(s, OpName(op), since, std::move(st));
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

Status CudaCommunicator::Verify(Slot& s, cudaStream_t stream, const CallDescriptor& desc,
                                const CallOutputs& outputs) {
  if (topology_.group_size() == 1) return Status::Ok();  // no peer to disagree with
  return LaunchVerifyCall(stream, s.flags + kDescFlag, desc, topology_.group_size(), s.rank,
                          s.flags + kHealthFlag, s.report_device, outputs);
}

Status CudaCommunicator::Finish(Slot& s, cudaStream_t xla_stream, const char* op, uint64_t epoch,
                                std::vector<Wait> waits) {
  if (!compute_on_caller_stream_) {
    JAX_UB_CUDA(cudaEventRecord(s.compute_done, s.compute));
    JAX_UB_CUDA(cudaStreamWaitEvent(xla_stream, s.compute_done));
  }
  for (int r = 0; r < topology_.group_size(); ++r) {
    if (r == s.rank) continue;
    JAX_UB_CUDA(cudaStreamWaitEvent(xla_stream, s.comm_done[r]));
  }
  // Before `done`: once the watchdog sees the call done, its end has opened the gate.
  JAX_UB_RETURN_IF_ERROR(ArmRelease(s, xla_stream, epoch, waits));
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

Status CudaCommunicator::ArmRelease(Slot& s, cudaStream_t xla_stream, uint64_t epoch,
                                    const std::vector<Wait>& waits) {
  if (waits.empty()) return Status::Ok();
  if (waits.size() > static_cast<size_t>(kMaxReleaseWaits))
    return Internal("a call of " + std::to_string(waits.size()) + " flag waits; at most " +
                    std::to_string(kMaxReleaseWaits) + " can be released");
  const DriverOps* ops;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
  const auto gate = reinterpret_cast<CUdeviceptr>(&s.board_device->gate);
  JAX_UB_CU(ops->write(reinterpret_cast<CUstream>(xla_stream), gate, epoch,
                       CU_STREAM_WRITE_VALUE_DEFAULT));
  ReleaseBatch b;
  b.epoch = epoch;
  b.health = s.flags + kHealthFlag;
  for (size_t i = 0; i < waits.size(); i += kReleaseWaitsPerLaunch) {
    b.first = static_cast<int>(i);
    b.count = static_cast<int>(std::min<size_t>(kReleaseWaitsPerLaunch, waits.size() - i));
    b.last = i + b.count == waits.size();
    for (int j = 0; j < b.count; ++j) {
      const Wait& w = waits[i + j];
      b.flags[j] = const_cast<uint64_t*>(w.flag);
      b.targets[j] = w.target;
      b.progress[j] = w.progress;
    }
    JAX_UB_RETURN_IF_ERROR(LaunchReleaseWaits(b, s.board_device, s.release_stream));
  }
  return Status::Ok();
}

Status CudaCommunicator::AwaitLocalPeers(Slot& s, const char* op, uint64_t epoch) {
  s.enqueued.store(epoch, std::memory_order_release);
  const auto start = Clock::now();
  const Clock::time_point deadline = DeadlineIn(timeout_s_);  // one for every peer
  auto who = [&] { return Describe(op, s.rank, s.group); };
  for (int r = 0; r < topology_.group_size(); ++r) {
    const Slot& q = *slots_[topology_.slot(s.group, r)];
    if (!q.local || &q == &s) continue;
    auto enqueued = [&](bool* done) {
      *done = q.enqueued.load(std::memory_order_acquire) >= epoch;
      return Status::Ok();
    };
    auto timed_out = [&] {
      return who() + " (GPU " + std::to_string(s.device) + ") timed out after " +
             std::to_string(timeout_s_) + " s waiting for rank " + std::to_string(q.rank) +
             " (GPU " + std::to_string(q.device) + ", same process) to enqueue call #" +
             std::to_string(epoch) + " (it has reached #" + std::to_string(q.enqueued.load()) +
             "); the GPUs of one process must make the same jax_ub calls in the same order";
    };
    JAX_UB_RETURN_IF_ERROR(PollHost(enqueued, deadline, who, timed_out));
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

std::vector<std::pair<int, int64_t>> CudaCommunicator::FlagGemmCalls(bool signals) const {
  std::vector<std::pair<int, int64_t>> out;
  for (const auto& sp : slots_)
    if (sp && sp->local)
      out.emplace_back(sp->device,
                       signals ? sp->signal_gemm_calls.load() : sp->flag_gemm_calls.load());
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

}  // namespace jax_ub
