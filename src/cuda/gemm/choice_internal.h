// What choosing and timing a kernel (kernel_choice.cc, tune.cc) and comparing candidates in
// the op (trials.cc) share: how many candidates are timed, and for how long.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace jax_ub {
namespace gemm_internal {

constexpr int kCandidates = 8;    // heuristic results timed per description
constexpr int kTimedRounds = 3;   // a candidate's time: median of the rounds,
constexpr int kRunsPerRound = 3;  // each this many runs back to back
// GEMMs of at least kSustainMinMs are timed as they run in a training loop instead: a
// power-capped GPU's clock follows the power of the last tens of ms, so a candidate timed
// in a short burst after others runs at the clock they left, and kernels that draw more
// power read faster than they run for good. On one H200 3-run bursts ranked first a kernel
// 0.3-4.8% slower in 250 ms loops, at 6 LLM shapes; blocks of runs, part untimed, then
// timed, put first the 250 ms loops' fastest at all 6 (benchmarks/tools/gemm_candidates.cu
// --windows). Shorter GEMMs keep the bursts: blocks take ~1 s a shape (4-5 candidates).
constexpr double kSustainMinMs = 0.05;
// Before the blocks, each candidate runs one burst of about kRankBurstMs, all back to back
// on a GPU already hot: the bursts rank the candidates the blocks time (SustainedCandidates).
// Round 0's single runs rank by chance: at 8192x512x4096 (8B's o, tp=8) on one H100 they
// left out the kernel that loops of 200 runs put 8.6% ahead of cuBLAS's pick; the bursts
// put it first in every tuning.
constexpr double kRankBurstMs = 2;
// The blocks: kSustainWarmMs untimed, then kSustainTimedMs timed, a candidate a block, in
// kSustainRounds rounds that alternate direction; each round is scored on its own
// (SteadyRounds, RelativeTimes, RoundLead). Short blocks in many rounds because the clock
// dips: on one H100 at its 700 W cap it fell ~20% for ~0.3 s of every second of load, and in
// two rounds of 80 ms blocks the dip caught the last blocks (17-28% slower than the same
// kernel's first): the mean of two rounds put a kernel 8.6% ahead only 2% ahead. A dip now
// costs the rounds it lands in, and those are left out: in 7 tunings of 8B's tp=8 GEMMs on
// that H100 (~1 s each) it took the last 2-3 of 8, and o kept a kernel 8% ahead.
constexpr double kSustainWarmMs = 10;
constexpr double kSustainTimedMs = 10;
constexpr int kSustainRounds = 8;
static_assert(kSustainRounds % 2 == 0, "rounds alternate direction in pairs");
// Of a long GEMM's candidates, the blocks time the ranking's fastest few only. In 21 tunings
// on one H200 (the GEMMs of Llama 3 8B's step at 8192 rows and 8192^3; 7-8 candidates each,
// ranked by one run apiece), the blocks' fastest was always among that ranking's first 4, and
// the best of the rest ran 0.6-7.6% slower: timing 4 halves a shape's tuning.
constexpr int kSustainKept = 4;
// The candidates a long GEMM's blocks time, in order, of `ranked` (fastest first by the
// ranking bursts): the first kSustainKept, and `first_pick` (cuBLASLt's own first pick, the
// kernel cuBLAS itself runs: torch's GEMM) after them where it ran but is not among them. On
// one H100 the kept pick at 8192x1792x4096 once ran 5% slower than cuBLAS's (kernel times
// through CUPTI), so the blocks time cuBLAS's pick too. The time budget may still cut the
// list's tail.
inline std::vector<size_t> SustainedCandidates(std::vector<size_t> ranked, size_t first_pick) {
  size_t kept = std::min(ranked.size(), static_cast<size_t>(kSustainKept));
  const auto pick = std::find(ranked.begin() + kept, ranked.end(), first_pick);
  if (pick != ranked.end()) {
    std::rotate(ranked.begin() + kept, pick, pick + 1);
    ++kept;
  }
  ranked.resize(kept);
  return ranked;
}
// cuBLASLt's own first pick (the kernel cuBLAS runs: torch's) holds unless another
// candidate's time beats it by more than this share, and by more than the timing's own spread
// (KeptCandidate): a guard against noise, not a measured gain. On one H100, tuning's block
// times put candidates up to 8% apart that ran alike in programs of 8 GEMMs.
constexpr double kHoldMargin = 0.03;
// The candidate tuning keeps: `fastest`, timed `fastest_ms` a run, unless candidate 0
// (cuBLASLt's own first pick, timed `first_ms` a run; negative where it was not timed or is
// not that pick) is within the margin of it: kHoldMargin, or `spread` where that is larger (a
// share of the times: a lead no larger than the timing's rounds differ is no lead). Bursts
// pass the larger of the two candidates' RoundSpread; blocks pass 1 and RoundLead's lead and
// spread.
inline int KeptCandidate(int fastest, double fastest_ms, double first_ms, double spread = 0) {
  if (fastest <= 0 || first_ms < 0) return fastest;
  const double margin = std::max(kHoldMargin, spread);
  return fastest_ms > (1.0 - margin) * first_ms ? 0 : fastest;
}
// What tuning's later rounds time within `left_ms` of budget, given each candidate's time a
// round (`round_ms`, fastest first by the ranking): `rounds` rounds of as many candidates as
// fit, at least one. A long GEMM's blocks (`sustained`; a GEMM of tens of ms runs few a block)
// give up rounds first, in pairs down to 2, before they give up candidates.
struct RoundPlan {
  size_t candidates;
  int rounds;
};
inline RoundPlan PlanRounds(const std::vector<double>& round_ms, int rounds, bool sustained,
                            double left_ms) {
  auto planned_ms = [&](size_t keep, int r) {
    double sum = 0;
    for (size_t k = 0; k < keep; ++k) sum += round_ms[k] * r;
    return sum;
  };
  while (sustained && rounds > 2 && planned_ms(round_ms.size(), rounds) > left_ms) rounds -= 2;
  size_t keep = std::min<size_t>(round_ms.size(), 1);
  while (keep < round_ms.size() && planned_ms(keep + 1, rounds) <= left_ms) ++keep;
  return {keep, rounds};
}
// Untimed, before the first round: a GPU that idled (compiling, the host's own work) ran
// a whole first block above its sustained clock (5-7% fast, on the H200). A guess at
// what covers that, not measured yet.
constexpr double kSustainHeatMs = 250;
constexpr double kSustainHeatChunkMs = 25;  // the heat's runs a host wait
// Tuning a shape takes about this long at most (a GPU's peers wait for it, under the op's
// deadline, while its first call of a shape tunes): candidates beyond what the rounds can
// time in it are dropped, the slowest first, and rounds (a long GEMM's blocks) stop once it
// is spent.
constexpr double kTuneBudgetS = 2.0;
// In-op trials (CublasLtGemm::Matmul): after one untimed round over the candidates (the
// first calls run while the GPU and the peers settle), each candidate is timed in this
// many op calls, and the fastest round by round wins (TrialRounds). Even: rounds alternate
// direction.
constexpr int kTrialRounds = 4;
static_assert(kTrialRounds % 2 == 0, "trial rounds alternate direction in pairs");

// An agreement message (KernelAgreement): up to kMaxAgreed kernels, each its description
// (bit 7) and its place in that description's heuristic list (bits 0-6), 8 bits apiece
// from bit 0, and their count in bits 40-43. A plan's message lists its kernel, or its
// trial's candidates in the trial's order; a trial's decision, the kept candidate's place
// in that list (as a column kernel).
constexpr int kMaxAgreed = 5;
struct AgreedKernel {
  bool row;
  int index;
};
inline uint64_t PackKernels(const std::vector<AgreedKernel>& ks) {
  uint64_t word = static_cast<uint64_t>(ks.size()) << 40;
  for (size_t i = 0; i < ks.size() && i < kMaxAgreed; ++i)
    word |= static_cast<uint64_t>((ks[i].row ? 0x80 : 0) | (ks[i].index & 0x7f)) << (8 * i);
  return word;
}
inline std::vector<AgreedKernel> UnpackKernels(uint64_t word) {
  const int count = std::min(static_cast<int>((word >> 40) & 0xf), kMaxAgreed);
  std::vector<AgreedKernel> ks;
  for (int i = 0; i < count; ++i) {
    const int byte = static_cast<int>((word >> (8 * i)) & 0xff);
    ks.push_back(AgreedKernel{(byte & 0x80) != 0, byte & 0x7f});
  }
  return ks;
}

// The middle of `v` (the mean of the middle two where they are even); 0 where it is empty.
template <typename T>
double Middle(std::vector<T> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}
// (max - min) / middle of a candidate's timed rounds; 0 for fewer than two.
inline double RoundSpread(const std::vector<float>& ms) {
  if (ms.size() < 2) return 0;
  const double middle = Middle(ms);
  const auto [lo, hi] = std::minmax_element(ms.begin(), ms.end());
  return middle > 0 ? (*hi - *lo) / middle : 0;
}
// Each round's geometric mean over the candidates (`ms[c][r]`: candidate c's time a run in
// round r), over the rounds every candidate ran in.
inline std::vector<double> RoundMeans(const std::vector<std::vector<float>>& ms) {
  size_t rounds = ms.empty() ? 0 : ms[0].size();
  for (const auto& m : ms) rounds = std::min(rounds, m.size());
  std::vector<double> mean(rounds);
  for (size_t r = 0; r < rounds; ++r) {
    double log_sum = 0;
    for (const auto& m : ms) log_sum += std::log(std::max(m[r], 1e-9f));
    mean[r] = std::exp(log_sum / ms.size());
  }
  return mean;
}
// The rounds every candidate ran in, less those the clock dipped in: a round whose mean
// (RoundMeans) reads more than kDipShare above the middle round's. On one H100 the dip came
// ~0.75 s into a tuning's load and took its last 2-3 rounds (their means 9-24% above the
// middle), and one that begins partway through a round slows only the blocks after it: kept,
// such rounds put a kernel 13% ahead within its rounds' spread, and the first pick held.
constexpr double kDipShare = 0.03;
inline std::vector<std::vector<float>> SteadyRounds(const std::vector<std::vector<float>>& ms) {
  const std::vector<double> mean = RoundMeans(ms);
  const double limit = (1 + kDipShare) * Middle(mean);
  std::vector<std::vector<float>> steady(ms.size());
  for (size_t r = 0; r < mean.size(); ++r)
    if (mean[r] <= limit)
      for (size_t c = 0; c < ms.size(); ++c) steady[c].push_back(ms[c][r]);
  return steady;
}
// Each candidate's score over blocks timed in rounds (`ms[c][r]`, as SteadyRounds returns
// them): in each round, its time over the round's mean (RoundMeans), and the middle of that
// over the rounds, so that a round that went wrong for one candidate counts little.
inline std::vector<double> RelativeTimes(const std::vector<std::vector<float>>& ms) {
  const std::vector<double> mean = RoundMeans(ms);
  std::vector<double> score;
  for (const auto& m : ms) {
    std::vector<double> ratio;
    for (size_t r = 0; r < mean.size(); ++r) ratio.push_back(m[r] / mean[r]);
    score.push_back(Middle(ratio));
  }
  return score;
}
// The in-op trials' rounds (`ms[c][r]`: candidate c's GEMM times in its op call of timed round
// r): a candidate's time a round is the middle of its GEMMs there (a call may run the shape as
// several chunks), over the rounds every candidate was timed in (a failed event record leaves
// one out), for RelativeTimes to rank round by round as tuning's sustained blocks are ranked.
inline std::vector<std::vector<float>> TrialRounds(
    const std::vector<std::vector<std::vector<float>>>& ms) {
  size_t rounds = 0;
  for (const auto& m : ms) rounds = std::max(rounds, m.size());
  std::vector<std::vector<float>> by_round(ms.size());
  for (size_t r = 0; r < rounds; ++r) {
    bool all = true;
    for (const auto& m : ms) all = all && r < m.size() && !m[r].empty();
    if (!all) continue;
    for (size_t c = 0; c < ms.size(); ++c)
      by_round[c].push_back(static_cast<float>(Middle(ms[c][r])));
  }
  return by_round;
}
// How far the first pick (`first[r]`, its time a run in round r) trails the fastest
// (`fastest[r]`), round by round: the middle of first / fastest over their common rounds, and
// that ratio's spread, twice its median absolute deviation over its middle (for rounds of
// even noise about their interquartile range, and still small where up to half the rounds
// went wrong: on one H100, a dip that began partway through a round slowed the kernel timed
// after it by up to 25% and not the one before). For KeptCandidate(fastest, 1, lead, spread).
inline std::pair<double, double> RoundLead(const std::vector<float>& first,
                                           const std::vector<float>& fastest) {
  std::vector<double> ratio;
  for (size_t r = 0; r < std::min(first.size(), fastest.size()); ++r)
    ratio.push_back(first[r] / std::max(fastest[r], 1e-9f));
  if (ratio.empty()) return {-1.0, 0.0};
  const double lead = Middle(ratio);
  std::vector<double> deviation;
  for (double x : ratio) deviation.push_back(std::abs(x - lead));
  return {lead, lead > 0 ? 2 * Middle(deviation) / lead : 0.0};
}

}  // namespace gemm_internal
}  // namespace jax_ub
