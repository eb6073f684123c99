// Choosing a shape's kernel when its first Prepare makes a plan (MakePlan): the choice
// file's kernel where it has one, else cuBLASLt's heuristic candidates of each
// description, timed (tune.cc) when autotuning; and the choice recorded once final.
#include <algorithm>
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

Status CublasLtGemm::Heuristic(const Plan& p, int want,
                               std::vector<cublasLtMatmulHeuristicResult_t>* out) const {
  cublasLtMatmulPreference_t pref = nullptr;
  JAX_UB_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = workspace_bytes_;
  out->resize(want);
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.first, p.second, p.out, p.out, pref,
                                        want, out->data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  JAX_UB_RETURN_IF_ERROR(CublasStatus(st, "cublasLtMatmulAlgoGetHeuristic"));
  out->resize(found);
  if (found == 0) return Internal("cuBLASLt found no algorithm");
  return Status::Ok();
}

Status CublasLtGemm::MakePlan(const PlanKey& key, const Epilogue& ep, const void* a, const void* b,
                              void* c, const GemmArgs& args, cudaStream_t stream, Plan** plan) {
  // cuBLASLt's fp8 kernels take both operands k-major: the column description of a with
  // b stored transposed (op T on its first operand, N on its second), and nothing else.
  if (IsFp8(key.a_type) && !key.b_transposed)
    return InvalidArgument("fp8 GEMMs need b stored transposed ([n, k]), for cuBLASLt");
  if (Follows()) return PlanFromLeader(key, ep, a, b, c, args, stream, plan);
  JAX_UB_RETURN_IF_ERROR(ChoosePlan(key, ep, a, b, c, args, stream, plan));
  if (Agrees()) return SendPlan(**plan);
  return Status::Ok();
}

std::string CublasLtGemm::ShapeText(int64_t m, int64_t k, int64_t n) {
  return "GEMM m=" + std::to_string(m) + " k=" + std::to_string(k) + " n=" + std::to_string(n);
}

Status CublasLtGemm::SendPlan(const Plan& p) {
  std::vector<AgreedKernel> ks;
  if (p.trial != nullptr) {
    for (int index : p.trial->indices) ks.push_back(AgreedKernel{p.row, index});
  } else {
    ks.push_back(AgreedKernel{p.row, p.choice_index});
  }
  return agreement_->Send(++messages_, PackKernels(ks));
}

Status CublasLtGemm::PlanFromLeader(const PlanKey& key, const Epilogue& ep, const void* a,
                                    const void* b, void* c, const GemmArgs& args,
                                    cudaStream_t stream, Plan** plan) {
  uint64_t word = 0;
  JAX_UB_RETURN_IF_ERROR(agreement_->Receive(
      ++messages_, "the kernels it chose for " + ShapeText(key.m, key.k, key.n), &word));
  const std::vector<AgreedKernel> ks = UnpackKernels(word);
  std::vector<int> indices;
  for (const AgreedKernel& kernel : ks)
    if (kernel.row == ks[0].row) indices.push_back(kernel.index);
  if (ks.empty() || indices.size() != ks.size())
    return Internal(ShapeText(key.m, key.k, key.n) + ": rank 0's message is no kernel list");
  Plan p;
  bool usable = false;
  Status st = KnownKernels(key, ep, ks[0].row, indices, a, b, c, args, stream, &p, &usable);
  if (st.ok() && !usable)
    st = FailedPrecondition(ShapeText(key.m, key.k, key.n) + ": GPU " + std::to_string(device_) +
                            " cannot run the kernels group rank 0 chose; the GPUs of a "
                            "tensor-parallel group must be of one model, with one cuBLASLt");
  if (!st.ok()) return st;
  p.choice_index = indices[0];  // the leader records the choice file's line
  JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld: %zu kernel(s) from group rank 0, tile %d",
               device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
               static_cast<long long>(p.n), indices.size(),
               AlgoConfig(p.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
  *plan = &plans_.emplace(key, std::move(p)).first->second;
  return Status::Ok();
}

Status CublasLtGemm::KnownKernels(const PlanKey& key, const Epilogue& ep, bool row,
                                  const std::vector<int>& indices, const void* a, const void* b,
                                  void* c, const GemmArgs& args, cudaStream_t stream, Plan* p,
                                  bool* usable) {
  *usable = false;
  p->epilogue = ep;
  std::vector<cublasLtMatmulHeuristicResult_t> results;
  Status st = Describe(key, row, p);
  // Tuning's candidates are the first kCandidates: a larger index is no choice of ours.
  if (st.ok()) st = Heuristic(*p, kCandidates, &results);
  std::vector<cublasLtMatmulAlgo_t> algos;
  for (int index : indices) {
    if (!st.ok() || index < 0 || index >= static_cast<int>(results.size()) ||
        results[index].state != CUBLAS_STATUS_SUCCESS)
      break;
    algos.push_back(results[index].algo);
  }
  GemmArgs no_addend = args;
  no_addend.addend = nullptr;
  // Run each once, as tuning would have: its kernel is loaded before any peer wait (Prepare).
  const bool all = algos.size() == indices.size();
  for (size_t i = 0; st.ok() && all && i < algos.size(); ++i)
    st = Run(*p, algos[i], a, b, c, stream, no_addend);
  if (st.ok() && all) st = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!st.ok() || !all) {
    Destroy(*p);
    return st;
  }
  *usable = true;
  p->algo = algos[0];
  p->m = key.m;
  p->k = key.k;
  p->n = key.n;
  if (algos.size() >= 2) p->trial = NewTrial(std::move(algos), indices);
  return Status::Ok();
}

std::vector<CublasLtGemm::Choice> CublasLtGemm::Choices() const {
  std::vector<Choice> out;
  for (const auto& [key, p] : plans_)
    out.push_back(Choice{key.m, key.k, key.n, p.row, p.choice_index, p.trial != nullptr});
  return out;
}

Status CublasLtGemm::ChoosePlan(const PlanKey& key, const Epilogue& ep, const void* a,
                                const void* b, void* c, const GemmArgs& args, cudaStream_t stream,
                                Plan** plan) {
  const bool tune = options_.autotune;
  const bool fp8 = IsFp8(key.a_type);  // the column description only (see MakePlan)
  // Epilogues take the column description too: in the row one cuBLASLt's bias would run
  // along our rows.
  const bool column_only = fp8 || ep.Any();
  std::vector<bool> rows;  // the descriptions tried: GemmOrder::kRow or not
  if (column_only || options_.order != GemmOrder::kRow) rows.push_back(false);
  if (!column_only &&
      (options_.order == GemmOrder::kRow || (options_.order == GemmOrder::kAuto && tune)))
    rows.push_back(true);
  const std::string choice_key = ChoiceKey(key);
  if (!choice_key.empty()) {
    JAX_UB_RETURN_IF_ERROR(PlanFromChoices(key, choice_key, ep, rows, a, b, c, args, stream, plan));
    if (*plan != nullptr) return Status::Ok();
  }
  std::vector<Plan> described;  // one per description cuBLASLt serves
  std::vector<Candidate> candidates;
  std::string declined;  // why cuBLASLt served no description, should none be served
  Status st;
  for (bool row : rows) {
    Plan p;
    p.epilogue = ep;
    std::vector<cublasLtMatmulHeuristicResult_t> results;
    st = Describe(key, row, &p);
    if (st.ok()) st = Heuristic(p, tune ? kCandidates : 1, &results);
    if (!st.ok()) {  // a description cuBLASLt cannot serve; the other may do
      declined +=
          std::string(declined.empty() ? "" : "; ") + (row ? "row: " : "column: ") + st.message();
      Destroy(p);
      continue;
    }
    for (size_t i = 0; i < results.size(); ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS)
        candidates.push_back(Candidate{
            static_cast<int>(described.size()), results[i].algo, {}, static_cast<int>(i)});
    described.push_back(std::move(p));
  }
  st = Status::Ok();
  int best = candidates.empty() ? -1 : 0;
  GemmArgs tune_args = args;  // tuning runs without an addend
  tune_args.addend = nullptr;
  bool sustained = false;
  if (tune && !candidates.empty())
    st = Tune(described, a, b, c, tune_args, stream, &candidates, &best, &sustained);
  if (st.ok() && best < 0)
    st = Internal("cuBLASLt has no algorithm for m=" + std::to_string(key.m) +
                  " k=" + std::to_string(key.k) + " n=" + std::to_string(key.n) +
                  (declined.empty() ? "" : " (" + declined + ")"));
  if (!st.ok()) {
    for (Plan& p : described) Destroy(p);
    return st;
  }
  const Candidate& chosen = candidates[best];
  Plan kept = std::move(described[chosen.description]);
  kept.algo = chosen.algo;
  kept.m = key.m;
  kept.k = key.k;
  kept.n = key.n;
  for (size_t i = 0; i < described.size(); ++i)
    if (static_cast<int>(i) != chosen.description) Destroy(described[i]);
  // The op's first calls compare the fastest few of the kept description (see Matmul).
  std::vector<const Candidate*> timed;
  for (const Candidate& cand : candidates)
    if (cand.description == chosen.description && !cand.ms.empty()) timed.push_back(&cand);
  std::stable_sort(timed.begin(), timed.end(), [](const Candidate* x, const Candidate* y) {
    return Middle(x->ms) < Middle(y->ms);
  });
  // cuBLASLt's own first pick always takes part: tuning times kernels alone, and beside
  // the op's copies the heuristic's kernel was at times the faster one (a reduce-scatter
  // at some shapes, benchmarks/RESULTS.md "Kernel choice"); the trials decide from the
  // time beside the copies. Not where tuning timed sustained blocks (which time it too,
  // SustainedCandidates): the trials time single calls in turn, the bursts that rank
  // kernels by a clock others left.
  const Candidate* heuristic = nullptr;
  for (const Candidate& cand : candidates)
    if (cand.description == chosen.description) {
      heuristic = &cand;
      break;
    }
  if (options_.trials >= 2 && timed.size() >= 2 && !sustained) {
    // An agreement's message holds kMaxAgreed candidates at most.
    const int most = Agrees() ? std::min(options_.trials, kMaxAgreed) : options_.trials;
    const size_t count = std::min(timed.size(), static_cast<size_t>(most));
    std::vector<const Candidate*> compared(timed.begin(), timed.begin() + count);
    if (heuristic != nullptr && !heuristic->ms.empty() &&
        std::find(compared.begin(), compared.end(), heuristic) == compared.end())
      compared.back() = heuristic;
    std::vector<cublasLtMatmulAlgo_t> algos;
    std::vector<int> indices;
    for (const Candidate* cand : compared) {
      algos.push_back(cand->algo);
      indices.push_back(cand->index);
    }
    kept.trial = NewTrial(std::move(algos), std::move(indices));
  }
  kept.choice_key = choice_key;
  kept.choice_index = chosen.index;
  if (kept.trial == nullptr) RecordChoice(kept);  // else once the trials end (Harvest)
  JAX_UB_TRACE(
      "GPU %d GEMM m=%lld k=%lld n=%lld: %s description, algo %d tile %d stages %d, "
      "%.3f ms",
      device_, static_cast<long long>(key.m), static_cast<long long>(key.k),
      static_cast<long long>(key.n), kept.row ? "row" : "column",
      AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_ID),
      AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
      AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
      chosen.ms.empty() ? -1.0 : Middle(chosen.ms));
  *plan = &plans_.emplace(key, std::move(kept)).first->second;
  return Status::Ok();
}

std::string CublasLtGemm::ChoiceKey(const PlanKey& key) const {
  if (!choices_.enabled()) return "";
  std::string gpu = gpu_name_;
  for (char& ch : gpu)
    if (ch == ' ' || ch == '|' || ch == '\n') ch = '_';
  // The types as one word, PackTypes', so the file's keys read as they always have.
  const int types = static_cast<int>(PackTypes(key.a_type, key.b_type, key.out_type));
  char text[176];
  std::snprintf(text, sizeof(text), "v1 types=%d m=%lld k=%lld n=%lld bt=%d ep=%d tf32=%d fa=%d",
                types, static_cast<long long>(key.m), static_cast<long long>(key.k),
                static_cast<long long>(key.n), key.b_transposed ? 1 : 0, key.epilogue,
                options_.allow_tf32 ? 1 : 0, FastAccumulation(key) ? 1 : 0);
  // A choice made without the first pick's hold is kept apart (the default's keys unchanged).
  return "gpu=" + gpu + " cublasLt=" + std::to_string(cublasLtGetVersion()) + " " + text +
         (options_.hold_first_pick ? "" : " hold=0");
}

Status CublasLtGemm::PlanFromChoices(const PlanKey& key, const std::string& choice_key,
                                     const Epilogue& ep, const std::vector<bool>& rows,
                                     const void* a, const void* b, void* c, const GemmArgs& args,
                                     cudaStream_t stream, Plan** plan) {
  *plan = nullptr;
  bool row = false;
  int index = -1;
  if (!choices_.Find(choice_key, &row, &index)) return Status::Ok();
  if (std::find(rows.begin(), rows.end(), row) == rows.end()) return Status::Ok();
  Plan p;
  bool usable = false;
  const Status st = KnownKernels(key, ep, row, {index}, a, b, c, args, stream, &p, &usable);
  if (!usable) {
    JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld: the choice file's kernel is refused here (%s)",
                 device_, static_cast<long long>(key.m), static_cast<long long>(key.k),
                 static_cast<long long>(key.n),
                 st.ok() ? "no such candidate" : st.message().c_str());
    return Status::Ok();  // tuned instead
  }
  p.choice_key = choice_key;
  p.choice_index = index;
  JAX_UB_TRACE("GPU %d GEMM m=%lld k=%lld n=%lld: %s description, tile %d, from the choice file",
               device_, static_cast<long long>(p.m), static_cast<long long>(p.k),
               static_cast<long long>(p.n), row ? "row" : "column",
               AlgoConfig(p.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
  *plan = &plans_.emplace(key, std::move(p)).first->second;
  return Status::Ok();
}

void CublasLtGemm::RecordChoice(const Plan& p) {
  if (p.choice_key.empty()) return;
  const Status st = choices_.Record(p.choice_key, p.row, p.choice_index);
  if (!st.ok() && !choices_failed_) {
    choices_failed_ = true;
    std::fprintf(stderr, "jax_ub: %s; kernel choices are not kept for later processes\n",
                 st.message().c_str());
  }
}

}  // namespace jax_ub
