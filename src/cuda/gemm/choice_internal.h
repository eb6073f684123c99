// What choosing a kernel (kernel_choice.cc) and comparing candidates in the op (trials.cc)
// share: how many candidates are timed, and for how long.
#pragma once

#include <algorithm>
#include <vector>

namespace jax_ub {
namespace gemm_internal {

constexpr int kCandidates = 8;    // heuristic results timed per description
constexpr int kTimedRounds = 3;   // a candidate's time: median of the rounds,
constexpr int kRunsPerRound = 3;  // each this many runs back to back
// Tuning a shape takes about this long at most (a GPU's peers wait for it, under the op's
// deadline, while its first call of a shape tunes): candidates beyond what three rounds
// can time in it are dropped, the slowest first, and rounds stop once it is spent.
constexpr double kTuneBudgetS = 2.0;
// In-op trials (CublasLtGemm::Matmul): after one untimed round over the candidates (the
// first calls run while the GPU and the peers settle), each candidate is timed in this
// many op calls, and the smallest median wins. Even: rounds alternate direction.
constexpr int kTrialRounds = 4;
static_assert(kTrialRounds % 2 == 0, "trial rounds alternate direction in pairs");

inline float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace gemm_internal
}  // namespace jax_ub
