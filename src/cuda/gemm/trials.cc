// Comparing tuning's fastest candidates inside the op's own calls: each runs in turn,
// bracketed by events read later without waiting (TrialMatmul, Harvest), until the
// fastest beside the op's copies is kept.
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/gemm/choice_internal.h"
#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/trace.h"

namespace jax_ub {
using namespace gemm_internal;  // NOLINT: the kernel choice's own constants

std::unique_ptr<CublasLtGemm::Trial> CublasLtGemm::NewTrial(std::vector<cublasLtMatmulAlgo_t> algos,
                                                            std::vector<int> indices) {
  auto trial = std::make_unique<Trial>();
  trial->ms.resize(algos.size());
  trial->algos = std::move(algos);
  trial->indices = std::move(indices);
  return trial;
}

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

Status CublasLtGemm::TrialMatmul(Plan& p, const void* a, const void* b, void* c,
                                 cudaStream_t stream, const GemmArgs& args) {
  // With an agreement the decision waits for its call (AgreeOnTrial), the same on every rank.
  if (!Agrees()) JAX_UB_RETURN_IF_ERROR(Harvest(p));
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
  if (round > kTrialRounds) {
    if (Agrees()) JAX_UB_RETURN_IF_ERROR(AgreeOnTrial(p));
    return Run(p, p.algo, a, b, c, stream, args);
  }
  const cublasLtMatmulAlgo_t& algo = tr.algos[candidate];
  // A follower runs the leader's rotation untimed: the leader's times decide.
  if (round == 0 || Follows()) return Run(p, algo, a, b, c, stream, args);
  while (tr.spare.size() < 2) {  // events are owned by the trial from creation on
    cudaEvent_t e = nullptr;
    JAX_UB_CUDA(cudaEventCreate(&e));
    tr.spare.push_back(e);
  }
  const Trial::Timing timing{candidate, round, tr.spare[tr.spare.size() - 2], tr.spare.back()};
  Status st = CudaStatus(cudaEventRecord(timing.begin, stream), "cudaEventRecord");
  if (st.ok()) st = Run(p, algo, a, b, c, stream, args);
  if (st.ok()) st = CudaStatus(cudaEventRecord(timing.end, stream), "cudaEventRecord");
  if (!st.ok()) return st;  // the events stay spare
  tr.spare.resize(tr.spare.size() - 2);
  tr.pending.push_back(timing);
  return Status::Ok();
}

Status CublasLtGemm::Harvest(Plan& p, bool wait) {
  Trial& tr = *p.trial;
  while (!tr.pending.empty()) {
    const Trial::Timing x = tr.pending.front();
    if (wait) JAX_UB_CUDA(cudaEventSynchronize(x.end));
    const cudaError_t q = cudaEventQuery(x.end);
    if (q == cudaErrorNotReady) break;
    JAX_UB_CUDA(q);
    float ms = 0;
    JAX_UB_CUDA(cudaEventElapsedTime(&ms, x.begin, x.end));
    std::vector<std::vector<float>>& rounds = tr.ms[x.candidate];
    if (static_cast<int>(rounds.size()) < x.round) rounds.resize(x.round);
    rounds[x.round - 1].push_back(ms);
    tr.spare.push_back(x.begin);
    tr.spare.push_back(x.end);
    tr.pending.pop_front();
  }
  const int count = static_cast<int>(tr.algos.size());
  if (!tr.pending.empty() || tr.calls < count * (kTrialRounds + 1)) return Status::Ok();
  // Every candidate's timings are in: ranked round by round (TrialRounds, RelativeTimes, as
  // tuning's sustained blocks), so that a clock that dips for some rounds and not others
  // cannot reorder them. No round with every candidate timed: the tuned pick stays.
  const std::vector<std::vector<float>> by_round = TrialRounds(tr.ms);
  const std::vector<double> score = RelativeTimes(by_round);
  int best = 0;
  std::string times;
  for (int i = 0; i < count; ++i) {
    if (score[i] < score[best]) best = i;
    char text[64];
    std::snprintf(text, sizeof text, "%d: %.3f (%.4f ms)",
                  AlgoConfig(tr.algos[i], CUBLASLT_ALGO_CONFIG_TILE_ID), score[i],
                  Middle(by_round[i]));
    times += (times.empty() ? "" : ", ") + std::string(text);
  }
  JAX_UB_TRACE(
      "GPU %d GEMM m=%lld k=%lld n=%lld in the op, by tile (tuned pick first) its time over "
      "the round's mean (median ms), %zu rounds: %s; keeping candidate %d (tile %d)",
      device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
      static_cast<long long>(p.n), by_round[0].size(), times.c_str(), best,
      AlgoConfig(tr.algos[best], CUBLASLT_ALGO_CONFIG_TILE_ID));
  Decide(p, best);
  if (Agrees() && agreement_->leader())
    return agreement_->Send(++messages_, PackKernels({AgreedKernel{false, best}}));
  return Status::Ok();
}

void CublasLtGemm::Decide(Plan& p, int best) {
  Trial& tr = *p.trial;
  p.algo = tr.algos[best];
  p.choice_index = tr.indices[best];
  DestroyTrial(tr);
  p.trial.reset();
  RecordChoice(p);
}

Status CublasLtGemm::AgreeOnTrial(Plan& p) {
  // The leader's timings are all recorded by now, in earlier calls: waiting for them
  // waits on no peer's later work.
  if (agreement_->leader()) {
    JAX_UB_RETURN_IF_ERROR(Harvest(p, /*wait=*/true));
    if (p.trial != nullptr)  // the followers would wait for a pick never sent
      return Internal(ShapeText(p.m, p.k, p.n) + ": the trial ended undecided");
    return Status::Ok();
  }
  uint64_t word = 0;
  JAX_UB_RETURN_IF_ERROR(agreement_->Receive(
      ++messages_, "the kernel its trials kept for " + ShapeText(p.m, p.k, p.n), &word));
  const std::vector<AgreedKernel> ks = UnpackKernels(word);
  if (ks.size() != 1 || ks[0].index >= static_cast<int>(p.trial->algos.size()))
    return Internal(ShapeText(p.m, p.k, p.n) + ": group rank 0 kept no candidate of the trial");
  JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld in the op: keeping group rank 0's candidate %d",
               device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
               static_cast<long long>(p.n), ks[0].index);
  Decide(p, ks[0].index);
  return Status::Ok();
}

}  // namespace jax_ub
