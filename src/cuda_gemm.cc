#include "cuda_gemm.h"

#include "cuda_check.h"

namespace jax_ub {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt asks for on Hopper

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

Status CublasLtGemm::Create(bool allow_tf32, CublasLtGemm** out) {
  auto* g = new CublasLtGemm();
  g->allow_tf32_ = allow_tf32;
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
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
  }
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

Status CublasLtGemm::GetPlan(const Key& key, Plan** plan) {
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    *plan = &it->second;
    return Status::Ok();
  }
  auto [t_raw, m, k, n, lda, ldb, ldc] = key;
  const DType t = static_cast<DType>(t_raw);
  const cudaDataType_t dt = CudaType(t);
  Plan p;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (t == DType::kF32 && allow_tf32_) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  // Row-major C = A @ B is column-major C^T = B^T @ A^T: pass B as the first operand.
  JAX_UB_CUBLAS(cublasLtMatmulDescCreate(&p.desc, compute, CUDA_R_32F));
  JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, dt, n, k, ldb));  // B^T: n x k
  JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, dt, k, m, lda));  // A^T: k x m
  JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, dt, n, m, ldc));  // C^T: n x m
  cublasLtMatmulPreference_t pref;
  JAX_UB_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  JAX_UB_CUBLAS(hs);
  if (found == 0)
    return Internal("cuBLASLt found no algorithm for m=" + std::to_string(m) +
                    " k=" + std::to_string(k) + " n=" + std::to_string(n));
  p.algo = result.algo;
  *plan = &plans_.emplace(key, p).first->second;
  return Status::Ok();
}

Status CublasLtGemm::Matmul(DType t, const void* a, int64_t lda, const void* b, int64_t ldb,
                            void* c, int64_t ldc, int64_t m, int64_t k, int64_t n,
                            cudaStream_t stream) {
  if (m == 0 || n == 0) return Status::Ok();
  Plan* p = nullptr;
  JAX_UB_RETURN_IF_ERROR(GetPlan(Key{static_cast<int>(t), m, k, n, lda, ldb, ldc}, &p));
  const float alpha = 1.0f, beta = 0.0f;
  JAX_UB_CUBLAS(cublasLtMatmul(handle_, p->desc, &alpha, b, p->a, a, p->b, &beta, c, p->c, c, p->c,
                               &p->algo, workspace_, workspace_bytes_, stream));
  return Status::Ok();
}

}  // namespace jax_ub
