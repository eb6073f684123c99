// The watchdog thread: reads device reports and overdue waits, names the peer, marks the
// communicator broken.
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

std::string CudaCommunicator::WatchdogCopy(Slot& s, void* dst, const void* src, cudaMemcpyKind kind,
                                           const char* what) {
  if (s.watchdog_stuck)
    return std::string("; the watchdog could not ") + what +
           ": an earlier copy of its is still stuck";
  // Through pinned words: a copy to or from pageable memory may block inside the call.
  const bool to_device = kind == cudaMemcpyHostToDevice;
  uint64_t* word = s.watchdog_words + (to_device ? 0 : 1);
  if (to_device) *word = *static_cast<const uint64_t*>(src);
  cudaError_t e = cudaMemcpyAsync(to_device ? dst : word, to_device ? word : src, sizeof(uint64_t),
                                  kind, s.watchdog_stream);
  // Not yet done is the usual first answer (the copy takes microseconds): poll on it.
  const auto deadline = DeadlineIn(kReleaseRunS);
  if (e == cudaSuccess) {
    while ((e = cudaStreamQuery(s.watchdog_stream)) == cudaErrorNotReady) {
      if (Clock::now() > deadline) {
        s.watchdog_stuck = true;
        return std::string("; the watchdog could not ") + what + ": its copy did not run in " +
               std::to_string(kReleaseRunS) + " s (the device is stuck)";
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  if (e != cudaSuccess)
    return std::string("; the watchdog could not ") + what + ": " + cudaGetErrorString(e);
  if (!to_device) *static_cast<uint64_t*>(dst) = *word;
  return "";
}

std::string CudaCommunicator::StuckReason(const Slot& s, const Pending& f, const Wait& wt,
                                          const std::string& seen) const {
  return Describe(f.op, s.rank, s.group) + " timed out after " + std::to_string(timeout_s_) +
         " s waiting for rank " + std::to_string(wt.peer) + " to " + wt.what + " for call #" +
         std::to_string(wt.target) + " (" + seen +
         "); the peer never arrived, is stuck, or runs a different program. The outputs of this "
         "call are NaN";
}

std::string CudaCommunicator::StuckReason(const Slot& s, const Pending& f) const {
  return Describe(f.op, s.rank, s.group) + " did not finish within the timeout";
}

std::string CudaCommunicator::ReleaseByCopies(Slot& s, const Pending& f) {
  // The health word goes up first, so the released call fills its outputs with NaN instead
  // of computing on stale data. Each copy is checked and waited for a bounded time: the first
  // that fails or does not run is named in the reason, and no later copy is tried (the device
  // is failing or stuck: the call may stay stuck, and not be poisoned).
  std::string failed;
  auto copy = [&](void* dst, const void* src, cudaMemcpyKind kind, const char* what) {
    if (!failed.empty()) return false;
    failed = WatchdogCopy(s, dst, src, kind, what);
    return failed.empty();
  };
  const uint64_t unhealthy = 1;
  copy(s.flags + kHealthFlag, &unhealthy, cudaMemcpyHostToDevice,
       "raise the health word (the outputs may not be NaN)");
  std::string reason;
  for (const Wait& wt : f.waits) {
    // A flag that cannot be read names its wait: the first not known to be met.
    uint64_t seen = 0;
    const bool read = copy(&seen, wt.flag, cudaMemcpyDeviceToHost, "read a flag");
    if (read && static_cast<int64_t>(seen - wt.target) >= 0) continue;
    uint64_t last = seen;
    if (read && wt.progress != wt.flag)
      copy(&last, wt.progress, cudaMemcpyDeviceToHost, "read a flag");
    if (reason.empty())
      reason = StuckReason(s, f, wt,
                           read ? "flag holds #" + std::to_string(last)
                                : "the call's first wait: no flag could be read");
    if (!read) break;
    const uint64_t target = wt.target;
    copy(const_cast<uint64_t*>(wt.flag), &target, cudaMemcpyHostToDevice,
         "release the stuck wait (the call may stay stuck)");
  }
  if (reason.empty()) reason = StuckReason(s, f);
  return reason + failed;
}

std::string CudaCommunicator::FireRelease(Slot& s, const Pending& f) {
  std::string reason;
  if (!f.waits.empty()) {
    // The call is the oldest in flight: every earlier one has ended and opened the gate
    // below it, so the gate only grows. `fired` first: the kernel reads it once through.
    __atomic_store_n(&s.board->fired, f.epoch, __ATOMIC_RELEASE);
    __atomic_store_n(&s.board->gate, f.epoch, __ATOMIC_RELEASE);
    const auto deadline = DeadlineIn(kReleaseRunS);
    while (__atomic_load_n(&s.board->released, __ATOMIC_ACQUIRE) != f.epoch) {
      if (Clock::now() > deadline) {
        // A call that ended on its own just as it was fired found nothing to release.
        if (cudaEventQuery(f.done) == cudaSuccess) break;
        // The kernel needs an SM: a flag GEMM waiting inside the call may hold them all.
        // Copies need none (but a module load in flight would hold them: release.h).
        return ReleaseByCopies(s, f) + " (its armed release did not run within " +
               std::to_string(kReleaseRunS) + " s: released by copies)";
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    const bool released = __atomic_load_n(&s.board->released, __ATOMIC_ACQUIRE) == f.epoch;
    for (size_t i = 0; released && i < f.waits.size() && reason.empty(); ++i) {
      if (s.board->met[i] != 0) continue;
      reason = StuckReason(s, f, f.waits[i], "flag holds #" + std::to_string(s.board->progress[i]));
    }
  }
  return reason.empty() ? StuckReason(s, f) : reason;
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
        cudaError_t q = cudaSetDevice(s.device);
        if (q == cudaSuccess) q = cudaEventQuery(f.done);
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
          // Name the peer we are stuck on, then release the call's waits so the job ends
          // with an error instead of hanging: through its armed release (release.h), as no
          // CUDA call of this thread may wait on a module load that waits on this call.
          const std::string reason = FireRelease(s, f);
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
