// Access to the words peers share in the symmetric regions, and the host's polling.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

namespace jax_ub {

// Flags and log entries: peers read with acquire what others wrote with release.
inline uint64_t Load(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
inline void Store(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}

// Polls with backoff: yields quickly at first (peers are usually close), then sleeps so
// that up to 8 device threads waiting on 2 cores leave the cores to the ones doing work.
inline void Backoff(int spins) {
  if (spins < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 20 : 200));
  }
}

// printf into a std::string, for error messages.
inline std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string Fmt(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

}  // namespace jax_ub
