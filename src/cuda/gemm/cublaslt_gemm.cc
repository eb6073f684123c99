// The cuBLASLt wrapper itself: its lifetime, how a plan describes a row-major GEMM to
// cuBLASLt, running a plan, and Prepare and Matmul, which choose (kernel_choice.cc) or
// compare (trials.cc) a shape's kernel the first time it is seen.
#include "cuda/gemm/cublaslt_gemm.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/trace.h"

namespace jax_ub {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt asks for on Hopper

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kF8E4M3FN:
      return CUDA_R_8F_E4M3;
    case DType::kF8E5M2:
      return CUDA_R_8F_E5M2;
    default:
      return CUDA_R_32F;
  }
}

// Sets `ep` on `desc`, a column description (MakePlan uses no other with an epilogue): its
// output is C^T, n x m column-major, so cuBLASLt's per-row bias is our per-column one, and
// the pre-GELU output is laid out as C, leading dimension n.
Status DescribeEpilogue(const Epilogue& ep, cudaDataType_t out_type, bool fp8, int64_t n,
                        cublasLtMatmulDesc_t desc) {
  if (!ep.Any()) return Status::Ok();
  cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
  if (ep.dgelu) {
    e = CUBLASLT_EPILOGUE_DGELU;
  } else if (ep.gelu && ep.aux) {
    e = ep.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  } else if (ep.gelu) {
    e = ep.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
  }
  JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
  // fp8 GEMMs default to other bias and aux types than the output's, which ours are.
  if (ep.bias && fp8)
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                 &out_type, sizeof(out_type)));
  if (ep.UsesAux()) {
    const int64_t ld = n;
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                                 sizeof(ld)));
    if (fp8)
      JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &out_type, sizeof(out_type)));
  }
  return Status::Ok();
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
  g->choices_ = GemmChoiceFile(options.autotune ? options.choices_path : std::string());
  Status st = CudaStatus(cudaGetDevice(&g->device_), "cudaGetDevice");
  cudaDeviceProp prop;
  if (st.ok())
    st = CudaStatus(cudaGetDeviceProperties(&prop, g->device_), "cudaGetDeviceProperties");
  if (st.ok()) g->gpu_name_ = prop.name;
  if (st.ok()) st = CublasStatus(cublasLtCreate(&g->handle_), "cublasLtCreate");
  if (st.ok())
    st = CudaStatus(cudaMalloc(&g->workspace_, kWorkspaceBytes), "cudaMalloc(workspace)");
  float ones[2 * kScaleStride];
  std::fill(ones, ones + 2 * kScaleStride, 1.0f);
  if (st.ok()) st = CudaStatus(cudaMalloc(&g->ones_, sizeof(ones)), "cudaMalloc(ones)");
  if (st.ok())
    st = CudaStatus(cudaMemcpy(g->ones_, ones, sizeof(ones), cudaMemcpyHostToDevice),
                    "cudaMemcpy(ones)");
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
  if (second_workspace_ != nullptr) cudaFree(second_workspace_);
  if (ones_ != nullptr) cudaFree(ones_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

void CublasLtGemm::Destroy(Plan& p) {
  if (p.trial != nullptr) DestroyTrial(*p.trial);
  if (p.first != nullptr) cublasLtMatrixLayoutDestroy(p.first);
  if (p.second != nullptr) cublasLtMatrixLayoutDestroy(p.second);
  if (p.out != nullptr) cublasLtMatrixLayoutDestroy(p.out);
  if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

bool CublasLtGemm::FastAccumulation(const PlanKey& key) const {
  return options_.fp8_fast_accumulation && key.a_type == DType::kF8E4M3FN &&
         key.b_type == DType::kF8E4M3FN;
}

Status CublasLtGemm::Describe(const PlanKey& key, bool row, Plan* p) const {
  const int64_t m = key.m, k = key.k, n = key.n;
  const bool b_transposed = key.b_transposed;
  // Dense row-major operands: a[m, k], b[k, n] (stored [n, k] when transposed), c[m, n].
  const int64_t lda = k, ldb = b_transposed ? k : n, ldc = n;
  const DType in = key.a_type;
  // a's, b's and c's types.
  const cudaDataType_t at = CudaType(in), bt = CudaType(key.b_type), ct = CudaType(key.out_type);
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (in == DType::kF32 && options_.allow_tf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  p->row = row;
  JAX_UB_CUBLAS(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
  p->scaled = IsFp8(in);
  if (p->scaled) JAX_UB_RETURN_IF_ERROR(SetScales(*p, ones_));
  if (FastAccumulation(key)) {
    const int8_t fast = 1;
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                 sizeof(fast)));
  }
  JAX_UB_RETURN_IF_ERROR(DescribeEpilogue(p->epilogue, ct, IsFp8(in), n, p->desc));
  // The stored transpose of b is read with op T on whichever operand b is.
  const cublasOperation_t op_t = CUBLAS_OP_T;
  if (b_transposed)
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(
        p->desc, row ? CUBLASLT_MATMUL_DESC_TRANSB : CUBLASLT_MATMUL_DESC_TRANSA, &op_t,
        sizeof(op_t)));
  if (row) {
    // C[m, n] = A[m, k] @ B[k, n] as stored; B's stored transpose is [n, k].
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, at, m, k, lda));
    if (b_transposed) {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, bt, n, k, ldb));
    } else {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, bt, k, n, ldb));
    }
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->out, ct, m, n, ldc));
    const cublasLtOrder_t order = CUBLASLT_ORDER_ROW;
    for (cublasLtMatrixLayout_t l : {p->first, p->second, p->out})
      JAX_UB_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)));
  } else {
    // Row-major C = A @ B is column-major C^T = B^T @ A^T: B is the first operand. A
    // transposed B [n, k] row-major is B^T stored column-major as k x n: cuBLASLt
    // transposes it on the fly.
    if (b_transposed) {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, bt, k, n, ldb));  // (B^T)^T: k x n
    } else {
      JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->first, bt, n, k, ldb));  // B^T: n x k
    }
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->second, at, k, m, lda));  // A^T: k x m
    JAX_UB_CUBLAS(cublasLtMatrixLayoutCreate(&p->out, ct, n, m, ldc));     // C^T: n x m
  }
  return Status::Ok();
}

Status CublasLtGemm::SetScales(const Plan& p, const float* scales) const {
  // Read by the kernel from device memory. fp8 plans use the column description, where
  // cuBLASLt's A is our b and its B our a. The addend (C) is not scaled.
  const float* a_scale = scales;
  const float* b_scale = scales + kScaleStride;
  JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                               &b_scale, sizeof(b_scale)));
  JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                               &a_scale, sizeof(a_scale)));
  return Status::Ok();
}

Status CublasLtGemm::SetEpilogueOperands(const Plan& p, const GemmArgs& args) const {
  if (p.epilogue.bias)
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                 &args.bias, sizeof(args.bias)));
  if (p.epilogue.UsesAux())
    JAX_UB_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                 &args.aux, sizeof(args.aux)));
  return Status::Ok();
}

Status CublasLtGemm::Run(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a,
                         const void* b, void* c, cudaStream_t stream, const GemmArgs& args) {
  const void* addend = args.addend;
  const float alpha = 1.0f, beta = addend == nullptr ? 0.0f : 1.0f;
  // Every run of an fp8 plan sets its scales, and of an epilogue plan its operands: a
  // pointer left from an earlier call may point at memory XLA has freed since.
  if (p.scaled) JAX_UB_RETURN_IF_ERROR(SetScales(p, args.scales != nullptr ? args.scales : ones_));
  if (p.epilogue.bias && args.bias == nullptr) return Internal("epilogue GEMM without its bias");
  if (p.epilogue.UsesAux() && args.aux == nullptr)
    return Internal("epilogue GEMM without GELU's input");
  JAX_UB_RETURN_IF_ERROR(SetEpilogueOperands(p, args));
  void* workspace = args.second_workspace ? second_workspace_ : workspace_;
  if (workspace == nullptr) return Internal("a GEMM in the second workspace before it was added");
  return CublasStatus(cublasLtMatmul(handle_, p.desc, &alpha, p.row ? a : b, p.first, p.row ? b : a,
                                     p.second, &beta, addend == nullptr ? c : addend, p.out, c,
                                     p.out, &algo, workspace, workspace_bytes_, stream),
                      "cublasLtMatmul");
}

Status CublasLtGemm::Prepare(DType ta, DType tb, DType out, const void* a, const void* b,
                             bool b_transposed, void* c, int64_t m, int64_t k, int64_t n,
                             const Epilogue& ep, const GemmArgs& args, cudaStream_t tune_stream,
                             Plan** plan) {
  *plan = nullptr;
  if (m == 0 || n == 0) return Status::Ok();
  const void* addend = args.addend;
  if (addend != nullptr && ep.Any()) return Internal("a GEMM with an addend takes no epilogue");
  const PlanKey key{ta, tb, out, m, k, n, b_transposed, ep.Code()};
  auto it = plans_.find(key);
  if (it != plans_.end() && (addend == nullptr || it->second.ran_with_addend)) {
    *plan = &it->second;  // every call after a shape's first
    return Status::Ok();
  }
  // Drain the device first (see the header): the kernels launched below may be loaded
  // now, and a load waits for the device to go idle while holding its context.
  JAX_UB_TRACE("GPU %d first call of GEMM m=%lld k=%lld n=%lld%s: draining the device", device_,
               static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n),
               addend != nullptr ? " with an addend" : "");
  JAX_UB_CUDA(cudaDeviceSynchronize());
  Plan* p = nullptr;
  if (it == plans_.end()) {
    JAX_UB_RETURN_IF_ERROR(MakePlan(key, ep, a, b, c, args, tune_stream, &p));
    // Run the chosen algorithm once (autotuning already ran every candidate), so its
    // kernel is loaded before any call of this shape has a peer wait in flight.
    GemmArgs no_addend = args;
    no_addend.addend = nullptr;
    if (!options_.autotune)
      JAX_UB_RETURN_IF_ERROR(Run(*p, p->algo, a, b, c, tune_stream, no_addend));
  } else {
    p = &it->second;
  }
  if (addend != nullptr) {  // its values do not matter here: c is rewritten by the caller
    JAX_UB_RETURN_IF_ERROR(Run(*p, p->algo, a, b, c, tune_stream, args));
    if (p->trial != nullptr)  // any of them may run with an addend in the op
      for (const cublasLtMatmulAlgo_t& algo : p->trial->algos)
        JAX_UB_RETURN_IF_ERROR(Run(*p, algo, a, b, c, tune_stream, args));
    p->ran_with_addend = true;
  }
  JAX_UB_CUDA(cudaStreamSynchronize(tune_stream));
  *plan = p;
  return Status::Ok();
}

Status CublasLtGemm::AddSecondWorkspace() {
  if (second_workspace_ != nullptr) return Status::Ok();
  return CudaStatus(cudaMalloc(&second_workspace_, workspace_bytes_), "cudaMalloc(workspace)");
}

Status CublasLtGemm::Matmul(Plan* p, const void* a, const void* b, void* c, cudaStream_t stream,
                            const GemmArgs& args) {
  if (p == nullptr) return Status::Ok();  // an empty shape
  if (p->trial != nullptr) return TrialMatmul(*p, a, b, c, stream, args);
  return Run(*p, p->algo, a, b, c, stream, args);
}

}  // namespace jax_ub
