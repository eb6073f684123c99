// The GEMM wrapper's kernel choice: tuning candidates once per shape (Tune), then
// comparing the fastest inside the op's own calls (trials: TrialMatmul, Harvest).
#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "cuda_gemm.h"
#include "cuda_gemm_internal.h"
#include "trace.h"

namespace jax_ub {
using namespace gemm_internal;  // NOLINT: this unit's own constants

void CublasLtGemm::DestroyTrial(Trial& t) {
  // An event still pending is released once it completes (cudaEventDestroy).
  for (const Trial::Timing& x : t.pending) {
    cudaEventDestroy(x.begin);
    cudaEventDestroy(x.end);
  }
  for (cudaEvent_t e : t.spare) cudaEventDestroy(e);
  t.pending.clear();
  t.spare.clear();
}

Status CublasLtGemm::Tune(const std::vector<Plan>& described, const void* a, const void* b, void* c,
                          const GemmArgs& args, cudaStream_t stream,
                          std::vector<Candidate>* candidates, int* best) {
  // Events bracket each candidate's runs of a round: 2 per candidate, made once.
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
  // in power as well as in speed), and every candidate at the same one, instead of the
  // first ones cooler than the last. Round 0 is one run each: it tells which candidates
  // can run here, loads their kernels and warms the GPU up. The later rounds keep the
  // candidates the time budget allows, fastest first.
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = i;
  std::vector<float> first_ms(count, -1.0f);
  for (int round = 0; round <= kTimedRounds && st.ok(); ++round) {
    const int runs = round == 0 ? 1 : kRunsPerRound;
    std::vector<bool> ran(count, false);
    // Alternate directions, as the op's trials do (TrialMatmul), so a drifting clock does
    // not favour whichever candidate runs first in every round.
    std::vector<size_t> visit = order;
    if (round > 0 && round % 2 == 0) std::reverse(visit.begin(), visit.end());
    for (size_t i : visit) {
      const Candidate& cand = (*candidates)[i];
      const Plan& p = described[cand.description];
      st = CudaStatus(cudaEventRecord(events[2 * i], stream), "cudaEventRecord");
      for (int r = 0; r < runs && st.ok(); ++r) {
        Status run = Run(p, cand.algo, a, b, c, stream, args);
        if (!run.ok() && round == 0) break;  // cannot run here: skipped from now on
        st = run;
        ran[i] = true;
      }
      if (st.ok()) st = CudaStatus(cudaEventRecord(events[2 * i + 1], stream), "cudaEventRecord");
      if (!st.ok()) break;
    }
    if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    std::vector<size_t> next;
    for (size_t i : order) {
      if (!st.ok() || !ran[i]) continue;
      float ms = 0;
      st = CudaStatus(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]),
                      "cudaEventElapsedTime");
      if (round == 0) {
        first_ms[i] = ms;
      } else {
        (*candidates)[i].ms.push_back(ms / runs);
      }
      next.push_back(i);
    }
    if (round == 0) {
      // Fastest first; keep as many as three timed rounds fit in the budget left.
      std::sort(next.begin(), next.end(),
                [&](size_t x, size_t y) { return first_ms[x] < first_ms[y]; });
      const double left_ms = std::max(0.0, kTuneBudgetS - seconds()) * 1e3;
      double planned_ms = 0;
      size_t keep = 0;
      while (keep < next.size() &&
             (keep < 1 ||
              planned_ms + first_ms[next[keep]] * kRunsPerRound * kTimedRounds <= left_ms)) {
        planned_ms += first_ms[next[keep]] * kRunsPerRound * kTimedRounds;
        ++keep;
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
  for (size_t i : order) {
    const Candidate& cand = (*candidates)[i];
    if (cand.ms.empty()) continue;
    if (*best < 0 || Median(cand.ms) < Median((*candidates)[*best].ms)) *best = static_cast<int>(i);
  }
  if (*best < 0 && !order.empty()) *best = static_cast<int>(order[0]);
  return Status::Ok();
}

Status CublasLtGemm::TrialMatmul(Plan& p, const void* a, const void* b, void* c,
                                 cudaStream_t stream, const GemmArgs& args) {
  JAX_UB_RETURN_IF_ERROR(Harvest(p));
  if (p.trial == nullptr) return Run(p, p.algo, a, b, c, stream, args);  // just decided
  Trial& tr = *p.trial;
  const int count = static_cast<int>(tr.algos.size());
  if (tr.last_call != call_) {  // this call's first GEMM of the shape: the next candidate
    tr.last_call = call_;
    ++tr.calls;
  }
  // Past the warm-up round and the timed ones: the tuned pick until the timings are in.
  const int round = (tr.calls - 1) / count;
  // Odd rounds visit the candidates in reverse, so over an even number of timed rounds
  // each candidate holds every position equally often: a clock that drifts through the
  // trials (a GPU settling at its power cap) costs every candidate alike, where a fixed
  // order would always time the last candidate at the lowest clock.
  const int slot = (tr.calls - 1) % count;
  const int candidate = round % 2 == 0 ? slot : count - 1 - slot;
  if (round > kTrialRounds) return Run(p, p.algo, a, b, c, stream, args);
  const cublasLtMatmulAlgo_t& algo = tr.algos[candidate];
  if (round == 0) return Run(p, algo, a, b, c, stream, args);
  while (tr.spare.size() < 2) {  // events are owned by the trial from creation on
    cudaEvent_t e = nullptr;
    JAX_UB_CUDA(cudaEventCreate(&e));
    tr.spare.push_back(e);
  }
  const Trial::Timing timing{candidate, tr.spare[tr.spare.size() - 2], tr.spare.back()};
  Status st = CudaStatus(cudaEventRecord(timing.begin, stream), "cudaEventRecord");
  if (st.ok()) st = Run(p, algo, a, b, c, stream, args);
  if (st.ok()) st = CudaStatus(cudaEventRecord(timing.end, stream), "cudaEventRecord");
  if (!st.ok()) return st;  // the events stay spare
  tr.spare.resize(tr.spare.size() - 2);
  tr.pending.push_back(timing);
  return Status::Ok();
}

Status CublasLtGemm::Harvest(Plan& p) {
  Trial& tr = *p.trial;
  while (!tr.pending.empty()) {
    const Trial::Timing x = tr.pending.front();
    const cudaError_t q = cudaEventQuery(x.end);
    if (q == cudaErrorNotReady) break;
    JAX_UB_CUDA(q);
    float ms = 0;
    JAX_UB_CUDA(cudaEventElapsedTime(&ms, x.begin, x.end));
    tr.ms[x.candidate].push_back(ms);
    tr.spare.push_back(x.begin);
    tr.spare.push_back(x.end);
    tr.pending.pop_front();
  }
  const int count = static_cast<int>(tr.algos.size());
  if (!tr.pending.empty() || tr.calls < count * (kTrialRounds + 1)) return Status::Ok();
  // Every candidate's timings are in: keep the smallest median.
  int best = 0;
  std::string times;
  for (int i = 0; i < count; ++i) {
    if (tr.ms[i].empty()) continue;
    if (tr.ms[best].empty() || Median(tr.ms[i]) < Median(tr.ms[best])) best = i;
    times += (times.empty() ? "" : ", ") +
             std::to_string(AlgoConfig(tr.algos[i], CUBLASLT_ALGO_CONFIG_TILE_ID)) + ": " +
             std::to_string(Median(tr.ms[i]));
  }
  JAX_UB_TRACE(
      "GPU %d GEMM m=%lld k=%lld n=%lld in the op, median ms by tile (tuned pick first): %s; "
      "keeping candidate %d (tile %d)",
      device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
      static_cast<long long>(p.n), times.c_str(), best,
      AlgoConfig(tr.algos[best], CUBLASLT_ALGO_CONFIG_TILE_ID));
  p.algo = tr.algos[best];
  p.choice_index = tr.indices[best];
  DestroyTrial(tr);
  p.trial.reset();
  RecordChoice(p);
  return Status::Ok();
}

}  // namespace jax_ub
