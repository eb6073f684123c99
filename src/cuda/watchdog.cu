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

std::string CudaCommunicator::StuckReason(const Slot& s, const Pending& f, const Wait* wt,
                                          uint64_t held) const {
  if (wt == nullptr) return Describe(f.op, s.rank, s.group) + " did not finish within the timeout";
  return Describe(f.op, s.rank, s.group) + " timed out after " + std::to_string(timeout_s_) +
         " s waiting for rank " + std::to_string(wt->peer) + " to " + wt->what + " for call #" +
         std::to_string(wt->target) + " (flag holds #" + std::to_string(held) +
         "); the peer never arrived, is stuck, or runs a different program. The outputs of this "
         "call are NaN";
}

std::string CudaCommunicator::FireRelease(Slot& s, const Pending& f) {
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
        // The kernel needs an SM; a flag GEMM waiting inside the call, which holds them all,
        // gives up on the same host store (GiveUp, flag_gemm_kernel.cuh).
        return Describe(f.op, s.rank, s.group) + " timed out after " + std::to_string(timeout_s_) +
               " s, and its armed release did not run within " + std::to_string(kReleaseRunS) +
               " s: the device is stuck (the call may stay stuck)";
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    const bool released = __atomic_load_n(&s.board->released, __ATOMIC_ACQUIRE) == f.epoch;
    for (size_t i = 0; released && i < f.waits.size(); ++i)
      if (s.board->met[i] == 0) return StuckReason(s, f, &f.waits[i], s.board->progress[i]);
  }
  return StuckReason(s, f);
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
