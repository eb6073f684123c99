// When a communicator is quiet enough to tear down: shared by the host and CUDA
// communicators' Quiesce.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <thread>

#include "protocol/broken_state.h"

namespace jax_ub {

// Whether, within each group, every local slot has made as many calls: groups may make
// different numbers (a branch on the dp index), a group's ranks may not, else one waits
// for a peer whose call was dispatched but has not started yet.
class EvenCalls {
 public:
  void Add(int group, uint64_t calls) {
    if (calls_.emplace(group, calls).first->second != calls) even_ = false;
  }
  bool even() const { return even_; }

 private:
  std::map<int, uint64_t> calls_;
  bool even_ = true;
};

// Polls `idle()` every millisecond for up to `timeout_s`; returns whether it held. A broken
// communicator makes no more progress: nothing to wait for.
template <class Idle>
bool WaitUntilIdle(double timeout_s, const BrokenState& broken, Idle idle) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  do {
    if (broken.broken() || idle()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

}  // namespace jax_ub
