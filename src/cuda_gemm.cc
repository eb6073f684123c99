#include "cuda_gemm.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "cuda_check.h"
#include "trace.h"

namespace jax_ub {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt asks for on Hopper
constexpr int kCandidates = 8;                 // heuristic results timed per description
constexpr int kTimedRounds = 3;                // a candidate's time: median of the rounds,
constexpr int kRunsPerRound = 3;               // each this many runs back to back
// Tuning stops trying candidates once a shape has taken this long, keeping the best so
// far: the heuristic lists its likeliest candidates first, and a GPU's peers wait for it
// (under the op's deadline) while its first call of a shape tunes.
constexpr double kTuneBudgetS = 2.0;

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

void CublasLtGemm::Destroy(Plan& p) {
  if (p.first != nullptr) cublasLtMatrixLayoutDestroy(p.first);
  if (p.second != nullptr) cublasLtMatrixLayoutDestroy(p.second);
  if (p.out != nullptr) cublasLtMatrixLayoutDestroy(p.out);
  if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

Status CublasLtGemm::Describe(const Key& key, bool row, Plan* p) const {
  auto [t_raw, m, k, n, lda, ldb, ldc, b_transposed] = key;
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
                              cudaStream_t stream, const Plan** plan) {
  const bool tune = options_.autotune;
  std::vector<bool> descriptions;  // GemmOrder::kRow or not, in the order tried
  if (options_.order != GemmOrder::kRow) descriptions.push_back(false);
  if (options_.order == GemmOrder::kRow || (options_.order == GemmOrder::kAuto && tune))
    descriptions.push_back(true);
  Plan best;
  float best_ms = -1.0f;
  std::string declined;  // why cuBLASLt served no description, should none be served
  const auto start = std::chrono::steady_clock::now();
  auto over_budget = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
           kTuneBudgetS;
  };
  for (bool row : descriptions) {
    if (best.desc != nullptr && over_budget()) break;
    Plan p;
    std::vector<cublasLtMatmulHeuristicResult_t> results;
    Status st = Describe(key, row, &p);
    if (st.ok()) st = Heuristic(p, tune ? kCandidates : 1, &results);
    if (!st.ok()) {  // a description cuBLASLt cannot serve; the other may do
      declined +=
          std::string(declined.empty() ? "" : "; ") + (row ? "row: " : "column: ") + st.message();
      Destroy(p);
      continue;
    }
    bool kept = false;
    for (const cublasLtMatmulHeuristicResult_t& r : results) {
      if (r.state != CUBLAS_STATUS_SUCCESS) continue;
      float ms = 0.0f;
      if (tune) {
        st = Time(p, r.algo, a, b, c, stream, &ms);
        if (!st.ok()) break;  // a CUDA failure, not a candidate that cannot run
        if (ms < 0) continue;
      }
      if (best_ms < 0 || ms < best_ms) {
        if (!kept) Destroy(best);  // best came from an earlier description
        best = p;
        best.algo = r.algo;
        best_ms = ms;
        kept = true;
      }
      if (!tune || over_budget()) break;  // the heuristic's first pick, or out of time
    }
    if (!kept) Destroy(p);
    if (!st.ok()) {
      Destroy(best);
      return st;
    }
  }
  if (best.desc == nullptr)
    return Internal("cuBLASLt has no algorithm for m=" + std::to_string(std::get<1>(key)) +
                    " k=" + std::to_string(std::get<2>(key)) +
                    " n=" + std::to_string(std::get<3>(key)) + " (" + declined + ")");
  JAX_UB_TRACE("GEMM m=%lld k=%lld n=%lld: %s description, %.3f ms",
               static_cast<long long>(std::get<1>(key)), static_cast<long long>(std::get<2>(key)),
               static_cast<long long>(std::get<3>(key)), best.row ? "row" : "column", best_ms);
  *plan = &plans_.emplace(key, best).first->second;
  return Status::Ok();
}

Status CublasLtGemm::Time(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a,
                          const void* b, void* c, cudaStream_t stream, float* ms) {
  const float alpha = 1.0f, beta = 0.0f;
  const void* first = p.row ? a : b;
  const void* second = p.row ? b : a;
  auto run = [&] {
    return cublasLtMatmul(handle_, p.desc, &alpha, first, p.first, second, p.second, &beta, c,
                          p.out, c, p.out, &algo, workspace_, workspace_bytes_, stream);
  };
  *ms = -1.0f;
  if (run() != CUBLAS_STATUS_SUCCESS) return Status::Ok();  // cannot run here: skipped
  cudaEvent_t begin = nullptr, end = nullptr;
  Status st = CudaStatus(cudaEventCreate(&begin), "cudaEventCreate");
  if (st.ok()) st = CudaStatus(cudaEventCreate(&end), "cudaEventCreate");
  std::vector<float> per_run;
  for (int r = 0; r < kTimedRounds && st.ok(); ++r) {
    st = CudaStatus(cudaEventRecord(begin, stream), "cudaEventRecord");
    for (int i = 0; i < kRunsPerRound && st.ok(); ++i)
      st = CublasStatus(run(), "cublasLtMatmul (autotune)");
    if (st.ok()) st = CudaStatus(cudaEventRecord(end, stream), "cudaEventRecord");
    if (st.ok()) st = CudaStatus(cudaEventSynchronize(end), "cudaEventSynchronize");
    float t = 0;
    if (st.ok()) st = CudaStatus(cudaEventElapsedTime(&t, begin, end), "cudaEventElapsedTime");
    per_run.push_back(t / kRunsPerRound);
  }
  if (begin != nullptr) cudaEventDestroy(begin);
  if (end != nullptr) cudaEventDestroy(end);
  JAX_UB_RETURN_IF_ERROR(st);
  std::sort(per_run.begin(), per_run.end());
  *ms = per_run[per_run.size() / 2];
  return Status::Ok();
}

Status CublasLtGemm::Prepare(DType t, const void* a, int64_t lda, const void* b, int64_t ldb,
                             bool b_transposed, void* c, int64_t ldc, int64_t m, int64_t k,
                             int64_t n, cudaStream_t tune_stream, const Plan** plan) {
  *plan = nullptr;
  if (m == 0 || n == 0) return Status::Ok();
  const Key key{static_cast<int>(t), m, k, n, lda, ldb, ldc, b_transposed};
  if (auto it = plans_.find(key); it != plans_.end()) {  // every call after a shape's first
    *plan = &it->second;
    return Status::Ok();
  }
  // Drain the device first (see the header): the kernels launched below may be loaded
  // now, and a load waits for the device to go idle while holding its context.
  JAX_UB_TRACE("first call of GEMM m=%lld k=%lld n=%lld: draining the device",
               static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n));
  JAX_UB_CUDA(cudaDeviceSynchronize());
  const Plan* p = nullptr;
  JAX_UB_RETURN_IF_ERROR(MakePlan(key, a, b, c, tune_stream, &p));
  // Run the chosen algorithm once (autotuning already did), so its kernel is loaded before
  // any call of this shape has a peer wait in flight.
  if (!options_.autotune) JAX_UB_RETURN_IF_ERROR(Matmul(p, a, b, c, tune_stream));
  JAX_UB_CUDA(cudaStreamSynchronize(tune_stream));
  *plan = p;
  return Status::Ok();
}

Status CublasLtGemm::Matmul(const Plan* p, const void* a, const void* b, void* c,
                            cudaStream_t stream) {
  if (p == nullptr) return Status::Ok();  // an empty shape
  const float alpha = 1.0f, beta = 0.0f;
  JAX_UB_CUBLAS(cublasLtMatmul(handle_, p->desc, &alpha, p->row ? a : b, p->first, p->row ? b : a,
                               p->second, &beta, c, p->out, c, p->out, &p->algo, workspace_,
                               workspace_bytes_, stream));
  return Status::Ok();
}

}  // namespace jax_ub
