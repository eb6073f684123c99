// Whether a communicator has failed, and the first reason. Shared by the host and CUDA
// communicators: once broken, every later call fails at once with that reason.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

namespace jax_ub {

class BrokenState {
 public:
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // The first reason given to Mark, or "" while healthy.
  std::string reason() const {
    if (!broken()) return "";
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }
  // Marks the communicator broken; the first reason is kept.
  void Mark(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reason_.empty()) reason_ = reason;
    }
    broken_.store(true, std::memory_order_release);
  }

 private:
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  std::string reason_;
};

}  // namespace jax_ub
