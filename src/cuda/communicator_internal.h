// What the CUDA communicator's source files share and nothing else needs.
#pragma once

#include <chrono>
#include <string>

namespace jax_ub {

using Clock = std::chrono::steady_clock;

// "op: rank r (group g)", the start of every error a call reports.
inline std::string Describe(const char* op, int rank, int group) {
  return std::string(op) + ": rank " + std::to_string(rank) + " (group " + std::to_string(group) +
         ")";
}

}  // namespace jax_ub
