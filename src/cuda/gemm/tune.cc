// Tuning a new shape's kernel (Tune): cuBLASLt's candidates timed on the GPU, in bursts or,
// for long GEMMs, in sustained blocks, within a time budget; the fastest is kept.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/gemm/choice_internal.h"
#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/trace.h"

namespace jax_ub {
using namespace gemm_internal;  // NOLINT: the kernel choice's own constants

Status CublasLtGemm::Tune(const std::vector<Plan>& described, const void* a, const void* b, void* c,
                          const GemmArgs& args, cudaStream_t stream,
                          std::vector<Candidate>* candidates, int* best, bool* sustained) {
  // Events bracket each candidate's timed runs of a round: 2 per candidate, made once.
  const size_t count = candidates->size();
  std::vector<cudaEvent_t> events(2 * count, nullptr);
  Status st;
  for (size_t i = 0; i < events.size() && st.ok(); ++i)
    st = CudaStatus(cudaEventCreate(&events[i]), "cudaEventCreate");
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // Timed rounds of runs back to back over every candidate that still counts, without the
  // host stopping the GPU in between: each round is timed at the clock a busy GPU holds
  // (a power-capped H200 runs long GEMMs ~25% below its boost clock, and candidates differ
  // in power as well as in speed). Round 0 is two runs each, the second timed: it tells
  // which candidates can run here, loads their kernels and sizes the later rounds. In those,
  // a short GEMM's candidates run kRunsPerRound times each; a long one's (kSustainMinMs) a
  // block each, kSustainWarmMs untimed, then kSustainTimedMs timed, so that each is timed
  // at the clock its own power leaves. The later rounds keep the candidates the time
  // budget allows, fastest first (a long GEMM's: kSustainKept at most). The host waits for
  // each block (a pause of microseconds before the next block's 40 ms warm-up) and starts
  // no block once the budget is spent: planned from round 0's times, blocks on a GPU that
  // other processes share (MPS, the tests' N-ranks mode) would run several times as long.
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = i;
  std::vector<float> first_ms(count, -1.0f);
  std::vector<int> warm_runs(count, 0), timed_runs(count, kRunsPerRound);
  *sustained = false;
  int rounds = kTimedRounds;
  for (int round = 0; round <= rounds && st.ok(); ++round) {
    std::vector<bool> ran(count, false);
    // Alternate directions, as the op's trials do (TrialMatmul), so a drifting clock does
    // not favour whichever candidate runs first in every round.
    std::vector<size_t> visit = order;
    if (round > 0 && round % 2 == 0) std::reverse(visit.begin(), visit.end());
    const bool blockwise = *sustained && round > 0;
    for (size_t i : visit) {
      // A round starts within the budget (the check after each round): its first block runs.
      if (blockwise && i != visit.front() && seconds() > kTuneBudgetS) break;
      const Candidate& cand = (*candidates)[i];
      const Plan& p = described[cand.description];
      // Round 0 times its second run: the first loads the kernel.
      const int warm = round == 0 ? 1 : warm_runs[i];
      const int runs = round == 0 ? 1 : timed_runs[i];
      for (int r = 0; r < warm && st.ok(); ++r) st = Run(p, cand.algo, a, b, c, stream, args);
      if (!st.ok() && round == 0) {  // cannot run here: skipped from now on
        st = Status::Ok();
        continue;
      }
      if (st.ok()) st = CudaStatus(cudaEventRecord(events[2 * i], stream), "cudaEventRecord");
      for (int r = 0; r < runs && st.ok(); ++r) {
        st = Run(p, cand.algo, a, b, c, stream, args);
        ran[i] = true;
      }
      if (st.ok()) st = CudaStatus(cudaEventRecord(events[2 * i + 1], stream), "cudaEventRecord");
      if (blockwise && st.ok())
        st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (!st.ok()) break;
    }
    if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    std::vector<size_t> next;
    for (size_t i : order) {
      if (!st.ok()) break;
      if (ran[i]) {
        float ms = 0;
        st = CudaStatus(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]),
                        "cudaEventElapsedTime");
        if (round == 0) {
          first_ms[i] = ms;
        } else {
          (*candidates)[i].ms.push_back(ms / timed_runs[i]);
        }
      }
      // A candidate the budget left out of this round keeps its earlier rounds' times.
      if (ran[i] || !(*candidates)[i].ms.empty()) next.push_back(i);
    }
    if (round == 0 && !next.empty()) {
      // Fastest first; the shape's time (its fastest run) sets how rounds time it; keep as
      // many candidates as the rounds fit in the budget left.
      std::sort(next.begin(), next.end(),
                [&](size_t x, size_t y) { return first_ms[x] < first_ms[y]; });
      *sustained = first_ms[next[0]] >= kSustainMinMs;
      if (*sustained) {
        rounds = kSustainRounds;
        // A GPU that idled before (compiling, the host's own work) holds a clock above
        // the one it sustains for longer than a block: run it hot first, untimed, for
        // kSustainHeatMs of the host's time, in chunks the host waits for.
        const size_t i = next[0];
        const Plan& p = described[(*candidates)[i].description];
        const int chunk = static_cast<int>(std::ceil(kSustainHeatChunkMs / first_ms[i]));
        const double heat_end_s = seconds() + kSustainHeatMs * 1e-3;
        while (st.ok() && seconds() < std::min(heat_end_s, kTuneBudgetS)) {
          for (int r = 0; r < chunk && st.ok(); ++r)
            st = Run(p, (*candidates)[i].algo, a, b, c, stream, args);
          if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        }
      }
      // Candidate 0 is the first description's heuristic #0 where cuBLASLt served that.
      if (*sustained) next = SustainedCandidates(next, (*candidates)[0].index == 0 ? 0 : count);
      const double left_ms = std::max(0.0, kTuneBudgetS - seconds()) * 1e3;
      double planned_ms = 0;
      size_t keep = 0;
      for (; keep < next.size(); ++keep) {
        const size_t i = next[keep];
        const double run_ms = std::max(first_ms[i], 1e-3f);
        if (*sustained) {
          warm_runs[i] = static_cast<int>(std::ceil(kSustainWarmMs / run_ms));
          timed_runs[i] = static_cast<int>(std::ceil(kSustainTimedMs / run_ms));
        }
        const double cost_ms = run_ms * (warm_runs[i] + timed_runs[i]) * rounds;
        if (keep >= 1 && planned_ms + cost_ms > left_ms) break;
        planned_ms += cost_ms;
      }
      next.resize(keep);
    }
    order = next;
    if (round > 0 && seconds() > kTuneBudgetS) break;  // the rounds so far decide
  }
  for (cudaEvent_t e : events)
    if (e != nullptr) cudaEventDestroy(e);
  JAX_UB_RETURN_IF_ERROR(st);
  *best = -1;
  std::string times;  // for the trace: each timed candidate's time and round spread
  std::vector<double> spread(count, 0);
  for (size_t i : order) {
    Candidate& cand = (*candidates)[i];
    if (cand.ms.empty()) continue;
    spread[i] = RoundSpread(cand.ms);
    if (*sustained) {  // few rounds, each of many runs: their mean
      float sum = 0;
      for (float ms : cand.ms) sum += ms;
      cand.ms = {sum / cand.ms.size()};
    }
    if (*best < 0 || Median(cand.ms) < Median((*candidates)[*best].ms)) *best = static_cast<int>(i);
    char text[112];
    std::snprintf(text, sizeof(text), "%s%s%d tile %d: %.4f (%.1f%%)", times.empty() ? "" : ", ",
                  described[cand.description].row ? "row" : "col", cand.index,
                  AlgoConfig(cand.algo, CUBLASLT_ALGO_CONFIG_TILE_ID), Median(cand.ms),
                  100 * spread[i]);
    times += text;
  }
  if (*best < 0 && !order.empty()) *best = static_cast<int>(order[0]);
  // cuBLASLt's own first pick (candidate 0 where cuBLASLt served the first description)
  // holds unless the fastest beats it by more than kHoldMargin and by more than either's
  // rounds differ: gains inside the timing's noise are no gains.
  const Candidate& first = (*candidates)[0];
  const int fastest = *best;
  if (fastest > 0 && !(*candidates)[fastest].ms.empty())
    *best = KeptCandidate(fastest, Median((*candidates)[fastest].ms),
                          first.index == 0 && !first.ms.empty() ? Median(first.ms) : -1.0,
                          std::max(spread[fastest], spread[0]));
  const bool held = *best != fastest;
  JAX_UB_TRACE("GPU %d tuning, ms a run (%s, %.2f s): %s%s", device_,
               *sustained ? "sustained blocks" : "bursts", seconds(), times.c_str(),
               held ? "; cuBLASLt's first pick holds" : "");
  return Status::Ok();
}

}  // namespace jax_ub
