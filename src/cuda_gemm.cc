#include "cuda_gemm.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "trace.h"

namespace jax_ub {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt asks for on Hopper
constexpr int kCandidates = 8;                 // heuristic results timed per description
constexpr int kTimedRounds = 3;                // a candidate's time: median of the rounds,
constexpr int kRunsPerRound = 3;               // each this many runs back to back
// Tuning a shape takes about this long at most (a GPU's peers wait for it, under the op's
// deadline, while its first call of a shape tunes): candidates beyond what three rounds
// can time in it are dropped, the slowest first, and rounds stop once it is spent.
constexpr double kTuneBudgetS = 2.0;
// In-op trials (CublasLtGemm::Matmul): after one untimed round over the candidates (the
// first calls run while the GPU and the peers settle), each candidate is timed in this
// many op calls, and the smallest median wins.
constexpr int kTrialRounds = 4;

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

}  // namespace

int AlgoConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return -1;
  return static_cast<int>(v);
}

Status CublasLtGemm::Create(GemmOptions options, CublasLtGemm** out) {
  auto* g = new CublasLtGemm();
  g->options_ = options;
  Status st = CublasStatus(cublasLtCreate(&g->handle_), "cublasLtCreate");
  if (st.ok())
    st = CudaStatus(cudaMalloc(&g->workspace_, kWorkspaceBytes), "cudaMalloc(workspace)");
  if (!st.ok()) {
    delete g;
    return st;
  }
  g->workspace_bytes_ = kWorkspaceBytes;
  *out = g;
  return Status::Ok();
}

CublasLtGemm::~CublasLtGemm() {
  for (auto& [key, p] : plans_) Destroy(p);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
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

void CublasLtGemm::Destroy(Plan& p) {
  if (p.trial != nullptr) DestroyTrial(*p.trial);
  if (p.first != nullptr) cublasLtMatrixLayoutDestroy(p.first);
  if (p.second != nullptr) cublasLtMatrixLayoutDestroy(p.second);
  if (p.out != nullptr) cublasLtMatrixLayoutDestroy(p.out);
  if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

Status CublasLtGemm::Describe(const Key& key, bool row, Plan* p) const {
  auto [t_raw, m, k, n, b_transposed] = key;
  // Dense row-major operands: a[m, k], b[k, n] (stored [n, k] when transposed), c[m, n].
  const int64_t lda = k, ldb = b_transposed ? k : n, ldc = n;
  const cudaDataType_t dt = CudaType(static_cast<DType>(t_raw));
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (static_cast<DType>(t_raw) == DType::kF32 && options_.allow_tf32)
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  p->row = row;
  JAX_UB_CUBLAS(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
  // The stored transpose of b is read with op T on whichever operand b is.
  const cublasOperation_t op_t = CUBLAS_OP_T;
  if (b_transposed)
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(
        p->desc, row ? CUBLASLT_MATMUL_DESC_TRANSB : CUBLASLT_MATMUL_DESC_TRANSA, &op_t,
        sizeof(op_t)));
  if (row) {
    // C[m, n] = A[m, k] @ B[k, n] as stored; B's stored transpose is [n, k].
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, dt, m, k, lda));
    if (b_transposed) {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, dt, n, k, ldb));
    } else {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, dt, k, n, ldb));
    }
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->out, dt, m, n, ldc));
    const cublasLtOrder_t order = CUBLASLT_ORDER_ROW;
    for (cublasLtMatrixLayout_t l : {p->first, p->second, p->out})
      JAX_UB_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)));
  } else {
    // Row-major C = A @ B is column-major C^T = B^T @ A^T: B is the first operand. A
    // transposed B [n, k] row-major is B^T stored column-major as k x n: cuBLASLt
    // transposes it on the fly.
    if (b_transposed) {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, dt, k, n, ldb));  // (B^T)^T: k x n
    } else {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, dt, n, k, ldb));  // B^T: n x k
    }
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, dt, k, m, lda));  // A^T: k x m
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->out, dt, n, m, ldc));     // C^T: n x m
  }
  return Status::Ok();
}

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

Status CublasLtGemm::MakePlan(const Key& key, const void* a, const void* b, void* c,
                              cudaStream_t stream, Plan** plan) {
  const bool tune = options_.autotune;
  std::vector<bool> rows;  // the descriptions tried: GemmOrder::kRow or not
  if (options_.order != GemmOrder::kRow) rows.push_back(false);
  if (options_.order == GemmOrder::kRow || (options_.order == GemmOrder::kAuto && tune))
    rows.push_back(true);
  std::vector<Plan> described;  // one per description cuBLASLt serves
  std::vector<Candidate> candidates;
  std::string declined;  // why cuBLASLt served no description, should none be served
  Status st;
  for (bool row : rows) {
    Plan p;
    std::vector<cublasLtMatmulHeuristicResult_t> results;
    st = Describe(key, row, &p);
    if (st.ok()) st = Heuristic(p, tune ? kCandidates : 1, &results);
    if (!st.ok()) {  // a description cuBLASLt cannot serve; the other may do
      declined +=
          std::string(declined.empty() ? "" : "; ") + (row ? "row: " : "column: ") + st.message();
      Destroy(p);
      continue;
    }
    for (const cublasLtMatmulHeuristicResult_t& r : results)
      if (r.state == CUBLAS_STATUS_SUCCESS)
        candidates.push_back(Candidate{static_cast<int>(described.size()), r.algo, {}});
    described.push_back(std::move(p));
  }
  st = Status::Ok();
  int best = candidates.empty() ? -1 : 0;
  if (tune && !candidates.empty()) st = Tune(described, a, b, c, stream, &candidates, &best);
  if (st.ok() && best < 0)
    st = Internal("cuBLASLt has no algorithm for m=" + std::to_string(std::get<1>(key)) + " k=" +
                  std::to_string(std::get<2>(key)) + " n=" + std::to_string(std::get<3>(key)) +
                  (declined.empty() ? "" : " (" + declined + ")"));
  if (!st.ok()) {
    for (Plan& p : described) Destroy(p);
    return st;
  }
  const Candidate& chosen = candidates[best];
  Plan kept = std::move(described[chosen.description]);
  kept.algo = chosen.algo;
  std::tie(std::ignore, kept.m, kept.k, kept.n, std::ignore) = key;
  for (size_t i = 0; i < described.size(); ++i)
    if (static_cast<int>(i) != chosen.description) Destroy(described[i]);
  // The op's first calls compare the fastest few of the kept description (see Matmul).
  std::vector<const Candidate*> timed;
  for (const Candidate& cand : candidates)
    if (cand.description == chosen.description && !cand.ms.empty()) timed.push_back(&cand);
  std::stable_sort(timed.begin(), timed.end(), [](const Candidate* x, const Candidate* y) {
    return Median(x->ms) < Median(y->ms);
  });
  if (options_.trials >= 2 && timed.size() >= 2) {
    kept.trial = std::make_unique<Trial>();
    for (size_t i = 0; i < timed.size() && static_cast<int>(i) < options_.trials; ++i)
      kept.trial->algos.push_back(timed[i]->algo);
    kept.trial->ms.resize(kept.trial->algos.size());
  }
  JAX_UB_TRACE("GEMM m=%lld k=%lld n=%lld: %s description, algo %d tile %d stages %d, %.3f ms",
               static_cast<long long>(std::get<1>(key)), static_cast<long long>(std::get<2>(key)),
               static_cast<long long>(std::get<3>(key)), kept.row ? "row" : "column",
               AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_ID),
               AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
               AlgoConfig(kept.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
               chosen.ms.empty() ? -1.0f : Median(chosen.ms));
  *plan = &plans_.emplace(key, std::move(kept)).first->second;
  return Status::Ok();
}

Status CublasLtGemm::Run(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a,
                         const void* b, void* c, cudaStream_t stream, const void* addend) {
  const float alpha = 1.0f, beta = addend == nullptr ? 0.0f : 1.0f;
  return CublasStatus(cublasLtMatmul(handle_, p.desc, &alpha, p.row ? a : b, p.first, p.row ? b : a,
                                     p.second, &beta, addend == nullptr ? c : addend, p.out, c,
                                     p.out, &algo, workspace_, workspace_bytes_, stream),
                      "cublasLtMatmul");
}

Status CublasLtGemm::Tune(const std::vector<Plan>& described, const void* a, const void* b, void* c,
                          cudaStream_t stream, std::vector<Candidate>* candidates, int* best) {
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
    for (size_t i : order) {
      const Candidate& cand = (*candidates)[i];
      const Plan& p = described[cand.description];
      st = CudaStatus(cudaEventRecord(events[2 * i], stream), "cudaEventRecord");
      for (int r = 0; r < runs && st.ok(); ++r) {
        Status run = Run(p, cand.algo, a, b, c, stream);
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

Status CublasLtGemm::Prepare(DType t, const void* a, const void* b, bool b_transposed, void* c,
                             int64_t m, int64_t k, int64_t n, const void* addend,
                             cudaStream_t tune_stream, Plan** plan) {
  *plan = nullptr;
  if (m == 0 || n == 0) return Status::Ok();
  const Key key{static_cast<int>(t), m, k, n, b_transposed};
  auto it = plans_.find(key);
  if (it != plans_.end() && (addend == nullptr || it->second.ran_with_addend)) {
    *plan = &it->second;  // every call after a shape's first
    return Status::Ok();
  }
  // Drain the device first (see the header): the kernels launched below may be loaded
  // now, and a load waits for the device to go idle while holding its context.
  JAX_UB_TRACE("first call of GEMM m=%lld k=%lld n=%lld%s: draining the device",
               static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n),
               addend != nullptr ? " with an addend" : "");
  JAX_UB_CUDA(cudaDeviceSynchronize());
  Plan* p = nullptr;
  if (it == plans_.end()) {
    JAX_UB_RETURN_IF_ERROR(MakePlan(key, a, b, c, tune_stream, &p));
    // Run the chosen algorithm once (autotuning already ran every candidate), so its
    // kernel is loaded before any call of this shape has a peer wait in flight.
    if (!options_.autotune) JAX_UB_RETURN_IF_ERROR(Run(*p, p->algo, a, b, c, tune_stream));
  } else {
    p = &it->second;
  }
  if (addend != nullptr) {  // its values do not matter here: c is rewritten by the caller
    JAX_UB_RETURN_IF_ERROR(Run(*p, p->algo, a, b, c, tune_stream, addend));
    if (p->trial != nullptr)  // any of them may run with an addend in the op
      for (const cublasLtMatmulAlgo_t& algo : p->trial->algos)
        JAX_UB_RETURN_IF_ERROR(Run(*p, algo, a, b, c, tune_stream, addend));
    p->ran_with_addend = true;
  }
  JAX_UB_CUDA(cudaStreamSynchronize(tune_stream));
  *plan = p;
  return Status::Ok();
}

Status CublasLtGemm::Matmul(Plan* p, const void* a, const void* b, void* c, cudaStream_t stream,
                            const void* addend) {
  if (p == nullptr) return Status::Ok();  // an empty shape
  if (p->trial != nullptr) return TrialMatmul(*p, a, b, c, stream, addend);
  return Run(*p, p->algo, a, b, c, stream, addend);
}

Status CublasLtGemm::TrialMatmul(Plan& p, const void* a, const void* b, void* c,
                                 cudaStream_t stream, const void* addend) {
  JAX_UB_RETURN_IF_ERROR(Harvest(p));
  if (p.trial == nullptr) return Run(p, p.algo, a, b, c, stream, addend);  // just decided
  Trial& tr = *p.trial;
  const int count = static_cast<int>(tr.algos.size());
  if (tr.last_call != call_) {  // this call's first GEMM of the shape: the next candidate
    tr.last_call = call_;
    ++tr.calls;
  }
  const int candidate = (tr.calls - 1) % count;
  // Past the warm-up round and the timed ones: the tuned pick until the timings are in.
  const int round = (tr.calls - 1) / count;
  if (round > kTrialRounds) return Run(p, p.algo, a, b, c, stream, addend);
  const cublasLtMatmulAlgo_t& algo = tr.algos[candidate];
  if (round == 0) return Run(p, algo, a, b, c, stream, addend);
  while (tr.spare.size() < 2) {  // events are owned by the trial from creation on
    cudaEvent_t e = nullptr;
    JAX_UB_CUDA(cudaEventCreate(&e));
    tr.spare.push_back(e);
  }
  const Trial::Timing timing{candidate, tr.spare[tr.spare.size() - 2], tr.spare.back()};
  Status st = CudaStatus(cudaEventRecord(timing.begin, stream), "cudaEventRecord");
  if (st.ok()) st = Run(p, algo, a, b, c, stream, addend);
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
      "GEMM m=%lld k=%lld n=%lld in the op, median ms by tile (tuned pick first): %s; "
      "keeping candidate %d",
      static_cast<long long>(p.m), static_cast<long long>(p.k), static_cast<long long>(p.n),
      times.c_str(), best);
  p.algo = tr.algos[best];
  DestroyTrial(tr);
  p.trial.reset();
  return Status::Ok();
}

}  // namespace jax_ub
