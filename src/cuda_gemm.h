// Row-major GEMM on one device through cuBLASLt (the library JAX's CUDA plugin ships).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "dtype.h"
#include "status.h"

namespace jax_ub {

class CublasLtGemm {
 public:
  // Creates the handle and a workspace on the current device.
  static Status Create(bool allow_tf32, CublasLtGemm** out);
  ~CublasLtGemm();

  // c[m, n] = a[m, k] @ b[k, n], row-major, with leading dims lda/ldb/ldc (elements).
  // Accumulates in float32; output in `t`.
  Status Matmul(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, void* c,
                int64_t ldc, int64_t m, int64_t k, int64_t n, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo;
  };
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
  Status GetPlan(const Key& key, Plan** plan);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool allow_tf32_ = false;
  std::map<Key, Plan> plans_;  // one per shape; only the owning device's thread uses it
};

}  // namespace jax_ub
