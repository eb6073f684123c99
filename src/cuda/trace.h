// Opt-in trace of the CUDA path on stderr (env JAX_UB_TRACE=1): which call each device's
// handler thread has reached, first-call drains, and what the watchdog sees. Meant for
// diagnosing a hang: the last lines of each device show where it stopped.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace jax_ub {

inline bool TraceEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_UB_TRACE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}

}  // namespace jax_ub

// JAX_UB_TRACE("format", args...): one line, prefixed, only when tracing is on.
#define JAX_UB_TRACE(...)                                 \
  do {                                                    \
    if (::jax_ub::TraceEnabled()) {                       \
      std::fprintf(stderr, "jax_ub trace: " __VA_ARGS__); \
      std::fputc('\n', stderr);                           \
    }                                                     \
  } while (0)
