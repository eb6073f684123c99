// What the CUDA communicator's source files share and nothing else needs.
#pragma once

#include <chrono>
#include <string>
#include <thread>

#include "cuda/communicator.h"

namespace jax_ub {

using Clock = std::chrono::steady_clock;

// "op: rank r (group g)", the start of every error a call reports.
inline std::string Describe(const char* op, int rank, int group) {
  return std::string(op) + ": rank " + std::to_string(rank) + " (group " + std::to_string(group) +
         ")";
}

// `seconds` from now.
inline Clock::time_point DeadlineIn(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

template <typename Ready, typename Who, typename Reason>
Status CudaCommunicator::PollHost(Ready ready, Clock::time_point deadline, Who who,
                                  Reason timeout_reason) {
  for (int spin = 0;; ++spin) {
    bool done = false;
    JAX_UB_RETURN_IF_ERROR(ready(&done));
    if (done) return Status::Ok();
    if (broken_.broken())
      return FailedPrecondition(who() + ": jax_ub communicator is broken (" + broken_.reason() +
                                ")");
    if (Clock::now() > deadline) {
      const std::string reason = timeout_reason();
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

}  // namespace jax_ub
