// What choosing and timing a kernel (kernel_choice.cc, tune.cc) and comparing candidates in
// the op (trials.cc) share: how many candidates are timed, and for how long.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
// 0.3-4.8% slower in 250 ms loops, at 6 LLM shapes; blocks of 40 ms run untimed and 40 ms
// timed put first the 250 ms loops' fastest at all 6 (benchmarks/tools/gemm_candidates.cu
// --windows). Shorter GEMMs keep the bursts: blocks take ~1 s a shape (4 candidates).
constexpr double kSustainMinMs = 0.05;
constexpr double kSustainWarmMs = 40;   // untimed, a candidate's block in each round
constexpr double kSustainTimedMs = 40;  // then timed
constexpr int kSustainRounds = 2;       // a candidate's time: the mean of the rounds
// Of a long GEMM's candidates, the blocks time round 0's fastest few only. In 21 tunings on
// one H200 (the GEMMs of Llama 3 8B's step at 8192 rows and 8192^3; 7-8 candidates each,
// ranked by round 0's one run apiece), the blocks' fastest was always among round 0's
// first 4, and the best of the rest ran 0.6-7.6% slower: timing 4 halves a shape's tuning.
constexpr int kSustainKept = 4;
// The candidates a long GEMM's blocks time, in order, of `ranked` (those that ran in round
// 0, fastest first): round 0's first kSustainKept, and `first_pick` (cuBLASLt's own first
// pick, the kernel cuBLAS itself runs: torch's GEMM) after them where it ran but is not
// among them. Round 0's single runs on a cold GPU rank by bursts: on one H100 the kept pick
// at 8192x1792x4096 ran 5% slower than cuBLAS's (kernel times through CUPTI), so the blocks
// time cuBLAS's pick too. The time budget may still cut the list's tail. Round 0 also
// ranks short GEMMs by chance: at 8192x512x4096 (8B's o, tp=8) it left out the kernel that
// loops of 200 runs put 8.6% ahead of the first pick (tile 29; the op, on the first pick,
// read 1.11-1.14x XLA's dot on one H100).
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
// candidate's time beats it by more than this share, and by more than the two candidates'
// own rounds differ (KeptCandidate): a guard against noise, not a measured gain. On one H100,
// tuning's block times put candidates up to 8% apart that ran alike in programs of 8 GEMMs; in 2
// runs over 24 rows of Llama 3 projections (8192 rows, tp 2-8, spreads 2-16%) the op tuned without
// this margin and the first pick's were within the noise of each other but at o (short k, wide n),
// where the first pick ran 2-12% slower at 6 of 7.
constexpr double kHoldMargin = 0.03;
// The candidate tuning keeps: `fastest`, timed `fastest_ms` a run, unless candidate 0
// (cuBLASLt's own first pick, timed `first_ms` a run; negative where it was not timed or is
// not that pick) is within the margin of it: kHoldMargin, or `spread` where that is larger
// (the larger of the two candidates' own round-to-round spreads, (max - min) / middle of
// their timed rounds): a lead no larger than the rounds of one kernel differ is no lead.
// The spread counts the clock too: on one H100 at its 700 W cap the clock dipped ~20% for
// ~0.3 s of every second of load, and the dip caught tuning's last blocks, the fastest
// candidates' second round (17-28% slower than their first): a lead may be real and still
// held back, or lost in the mean.
inline int KeptCandidate(int fastest, double fastest_ms, double first_ms, double spread = 0) {
  if (fastest <= 0 || first_ms < 0) return fastest;
  const double margin = std::max(kHoldMargin, spread);
  return fastest_ms > (1.0 - margin) * first_ms ? 0 : fastest;
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
// many op calls, and the smallest median wins. Even: rounds alternate direction.
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

inline float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
// (max - min) / middle of a candidate's timed rounds (the mean of the middle two where they
// are even); 0 for fewer than two.
inline double RoundSpread(std::vector<float> ms) {
  if (ms.size() < 2) return 0;
  std::sort(ms.begin(), ms.end());
  const size_t h = ms.size() / 2;
  const double middle = ms.size() % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h]);
  return middle > 0 ? (ms.back() - ms.front()) / middle : 0;
}

}  // namespace gemm_internal
}  // namespace jax_ub
