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
  // One round: each candidate of `visit` in turn runs warm[i] times untimed, then runs[i]
  // times timed, back to back, without the host stopping the GPU in between: each is timed
  // at the clock a busy GPU holds (a power-capped H200 runs long GEMMs ~25% below its boost
  // clock, and candidates differ in power as well as in speed). (*ms)[i]: its time a run,
  // -1 where it did not run. `blockwise`: the host waits for each candidate (a pause of
  // microseconds), and starts none past the budget once the round's first ran: planned from
  // round 0's times, blocks on a GPU that other processes share (MPS, the tests' N-ranks
  // mode) would run several times as long. `probe`: a candidate that fails its untimed run
  // cannot run here and is left out.
  auto time_round = [&](const std::vector<size_t>& visit, const std::vector<int>& warm,
                        const std::vector<int>& runs, bool blockwise, bool probe,
                        std::vector<float>* ms) {
    ms->assign(count, -1.0f);
    std::vector<bool> ran(count, false);
    Status s;
    for (size_t i : visit) {
      if (blockwise && i != visit.front() && seconds() > kTuneBudgetS) break;
      const Candidate& cand = (*candidates)[i];
      const Plan& p = described[cand.description];
      for (int r = 0; r < warm[i] && s.ok(); ++r) s = Run(p, cand.algo, a, b, c, stream, args);
      if (!s.ok() && probe) {
        s = Status::Ok();
        continue;
      }
      if (s.ok()) s = CudaStatus(cudaEventRecord(events[2 * i], stream), "cudaEventRecord");
      for (int r = 0; r < runs[i] && s.ok(); ++r) s = Run(p, cand.algo, a, b, c, stream, args);
      ran[i] = s.ok();
      if (s.ok()) s = CudaStatus(cudaEventRecord(events[2 * i + 1], stream), "cudaEventRecord");
      if (blockwise && s.ok())
        s = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (!s.ok()) break;
    }
    if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    for (size_t i = 0; i < count && s.ok(); ++i) {
      if (!ran[i]) continue;
      s = CudaStatus(cudaEventElapsedTime(&(*ms)[i], events[2 * i], events[2 * i + 1]),
                     "cudaEventElapsedTime");
      (*ms)[i] /= runs[i];
    }
    return s;
  };
  // Round 0: two runs each, the second timed. It tells which candidates can run here, loads
  // their kernels and sizes the later rounds: a short GEMM's candidates then run
  // kRunsPerRound times a round, in kTimedRounds rounds; a long one's (kSustainMinMs) are
  // ranked by bursts on a hot GPU and the first few (SustainedCandidates) timed in blocks.
  // The later rounds keep the candidates the time budget allows, fastest first, and
  // alternate direction, as the op's trials do (TrialMatmul), so that a drifting clock does
  // not favour whichever candidate runs first.
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = i;
  std::vector<int> warm_runs(count, 1), timed_runs(count, 1);
  std::vector<float> first_ms, ms;
  if (st.ok()) st = time_round(order, warm_runs, timed_runs, false, true, &first_ms);
  std::vector<size_t> next;
  for (size_t i = 0; i < count && st.ok(); ++i)
    if (first_ms[i] >= 0) next.push_back(i);
  // How many runs of candidate i last about `span_ms`, at its time a run in `t`.
  auto runs_in = [](double span_ms, const std::vector<float>& t, size_t i) {
    return static_cast<int>(std::ceil(span_ms / std::max(t[i], 1e-3f)));
  };
  auto fastest_first = [&](const std::vector<float>& t) {
    std::stable_sort(next.begin(), next.end(), [&](size_t x, size_t y) { return t[x] < t[y]; });
  };
  fastest_first(first_ms);
  *sustained = !next.empty() && first_ms[next[0]] >= kSustainMinMs;
  int rounds = kTimedRounds;
  std::vector<float> run_ms = first_ms;
  std::fill(warm_runs.begin(), warm_runs.end(), 0);
  std::fill(timed_runs.begin(), timed_runs.end(), kRunsPerRound);
  if (*sustained && st.ok()) {
    // A GPU that idled before (compiling, the host's own work) holds a clock above the one
    // it sustains for longer than a block: run it hot first, untimed, for kSustainHeatMs of
    // the host's time, in chunks the host waits for.
    const Candidate& hot = (*candidates)[next[0]];
    const int chunk = runs_in(kSustainHeatChunkMs, first_ms, next[0]);
    const double heat_end_s = seconds() + kSustainHeatMs * 1e-3;
    while (st.ok() && seconds() < std::min(heat_end_s, kTuneBudgetS)) {
      for (int r = 0; r < chunk && st.ok(); ++r)
        st = Run(described[hot.description], hot.algo, a, b, c, stream, args);
      if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
    // The ranking bursts; a GEMM as long as a burst was ranked by round 0's run.
    if (first_ms[next[0]] < kRankBurstMs) {
      for (size_t i : next) timed_runs[i] = runs_in(kRankBurstMs, first_ms, i);
      if (st.ok()) st = time_round(next, warm_runs, timed_runs, false, false, &run_ms);
      fastest_first(run_ms);
    }
    // Candidate 0 is the first description's heuristic #0 where cuBLASLt served that.
    next = SustainedCandidates(next, (*candidates)[0].index == 0 ? 0 : count);
    rounds = kSustainRounds;
    for (size_t i : next) {
      warm_runs[i] = runs_in(kSustainWarmMs, run_ms, i);
      timed_runs[i] = runs_in(kSustainTimedMs, run_ms, i);
    }
  }
  // Keep as many candidates, and rounds, as the budget left fits (PlanRounds).
  std::vector<double> round_ms;
  for (size_t i : next)
    round_ms.push_back(std::max(run_ms[i], 1e-3f) * (warm_runs[i] + timed_runs[i]));
  const RoundPlan plan =
      PlanRounds(round_ms, rounds, *sustained, std::max(0.0, kTuneBudgetS - seconds()) * 1e3);
  next.resize(plan.candidates);
  rounds = plan.rounds;
  order = next;
  for (int round = 1; round <= rounds && st.ok(); ++round) {
    std::vector<size_t> visit = order;
    if (round % 2 == 0) std::reverse(visit.begin(), visit.end());
    st = time_round(visit, warm_runs, timed_runs, *sustained, false, &ms);
    for (size_t i : order)
      if (st.ok() && ms[i] >= 0) (*candidates)[i].ms.push_back(ms[i]);
    if (seconds() > kTuneBudgetS) break;  // the rounds so far decide
  }
  for (cudaEvent_t e : events)
    if (e != nullptr) cudaEventDestroy(e);
  JAX_UB_RETURN_IF_ERROR(st);
  std::erase_if(order, [&](size_t i) { return (*candidates)[i].ms.empty(); });
  if (order.empty()) {  // only where the budget ran out before any round: round 0 decides
    *best = next.empty() ? -1 : static_cast<int>(next[0]);
    JAX_UB_TRACE(
        "GPU %d tuning (%.2f s): the budget ran out before a timed round; round 0's "
        "fastest is kept (candidate %d)",
        device_, seconds(), *best);
    return Status::Ok();
  }
  // A long GEMM's candidates are scored round by round (RelativeTimes), over the rounds all
  // of them ran in at a steady clock (SteadyRounds); a short one's by the median of their
  // rounds.
  std::vector<double> score(count, 0);
  std::vector<std::vector<float>> steady;  // a long GEMM's: by place in `order`
  if (*sustained) {
    for (size_t i : order) steady.push_back((*candidates)[i].ms);
    steady = SteadyRounds(steady);
    const std::vector<double> relative = RelativeTimes(steady);
    for (size_t k = 0; k < order.size(); ++k) score[order[k]] = relative[k];
  } else {
    for (size_t i : order) score[i] = Middle((*candidates)[i].ms);
  }
  *best = static_cast<int>(order[0]);
  for (size_t i : order)
    if (score[i] < score[*best]) *best = static_cast<int>(i);
  std::string times;  // for the trace: each timed candidate's time, score and rounds
  for (size_t k = 0; k < order.size(); ++k) {
    const Candidate& cand = (*candidates)[order[k]];
    char text[96];
    std::snprintf(text, sizeof(text), "%s%s%d tile %d: %.4f", times.empty() ? "" : ", ",
                  described[cand.description].row ? "row" : "col", cand.index,
                  AlgoConfig(cand.algo, CUBLASLT_ALGO_CONFIG_TILE_ID), Middle(cand.ms));
    times += text;
    if (*sustained) {  // x its score; each round's time @ its place in the round
      std::snprintf(text, sizeof(text), " x%.3f [", score[order[k]]);
      times += text;
      for (size_t r = 0; r < cand.ms.size(); ++r) {
        const size_t place = r % 2 == 0 ? k + 1 : order.size() - k;
        std::snprintf(text, sizeof(text), "%s%.4f@%zu", r ? " " : "", cand.ms[r], place);
        times += text;
      }
      times += "]";
    } else {
      std::snprintf(text, sizeof(text), " (%.1f%%)", 100 * RoundSpread(cand.ms));
      times += text;
    }
  }
  // With GemmOptions::hold_first_pick (the default), cuBLASLt's own first pick (candidate 0
  // where cuBLASLt served the first description) holds unless the fastest beats it by more than
  // kHoldMargin and by more than the timing's spread: gains inside the timing's noise are no gains.
  // Bursts: the two candidates' round spreads; blocks: how the first pick's lead varies from round
  // to round.
  const Candidate& first = (*candidates)[0];
  const int fastest = *best;
  const bool first_timed = first.index == 0 && !first.ms.empty();
  char text[96];
  if (*sustained) {
    std::snprintf(text, sizeof(text), "; %zu steady rounds", steady[0].size());
    times += text;
  }
  if (fastest > 0 && first_timed) {
    const Candidate& won = (*candidates)[fastest];
    int kept = fastest;
    if (*sustained) {
      auto place = [&](size_t i) {
        return std::find(order.begin(), order.end(), i) - order.begin();
      };
      const auto [lead, spread] = RoundLead(steady[place(0)], steady[place(fastest)]);
      kept = KeptCandidate(fastest, 1.0, lead, spread);
      std::snprintf(text, sizeof(text), "; the first pick x%.3f (rounds %.1f%% apart)", lead,
                    100 * spread);
      times += text;
    } else {
      kept = KeptCandidate(fastest, Middle(won.ms), Middle(first.ms),
                           std::max(RoundSpread(won.ms), RoundSpread(first.ms)));
    }
    if (options_.hold_first_pick) *best = kept;
  }
  JAX_UB_TRACE("GPU %d tuning, ms a run (%s, %.2f s): %s%s", device_,
               *sustained ? "sustained blocks" : "bursts", seconds(), times.c_str(),
               *best != fastest ? "; cuBLASLt's first pick holds" : "");
  return Status::Ok();
}

}  // namespace jax_ub
