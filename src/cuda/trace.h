// Opt-in trace of the CUDA path on stderr (env JAX_UB_TRACE=1): which call each device's
// handler thread has reached, first-call drains, and what the watchdog sees. Meant for
// diagnosing a hang: the last lines of each device show where it stopped.
#pragma once

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace jax_ub {

// On for 1/true/yes/on (any case, as every boolean JAX_UB_* variable reads), else off.
// Python sets the variable to "1" or "0" before this extension loads (config.py's
// export_trace_setting), warning about other text.
inline bool TraceEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_UB_TRACE");
    if (v == nullptr) return false;
    std::string word;
    for (const char* c = v; *c != '\0'; ++c) {
      if (!std::isspace(static_cast<unsigned char>(*c))) {
        word += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
      }
    }
    return word == "1" || word == "true" || word == "yes" || word == "on";
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
