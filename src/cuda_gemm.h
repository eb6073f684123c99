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

struct GemmOptions {
  bool allow_tf32 = false;  // float32 GEMMs may use TF32 tensor cores
  bool autotune = true;     // time cuBLASLt's candidates once per shape (see Prepare)
};

class CublasLtGemm {
 public:
  // Creates the handle and a workspace on the current device.
  static Status Create(GemmOptions options, CublasLtGemm** out);
  ~CublasLtGemm();

  // Chooses the algorithm for this GEMM's shape if it has none yet (later calls with the
  // shape return at once) and runs it once on `tune_stream`, overwriting `c`; the calling
  // thread waits. With autotuning, cuBLASLt's best few candidates are timed there with the
  // real operands (XLA's own dot is autotuned; the heuristic's first pick alone ran up to
  // ~5% slower than it at some of our chunk shapes).
  //
  // Call it before the op enqueues anything that waits on a peer. A shape's first call
  // drains the device: CUDA loads kernels lazily, and the first launch of a cuBLASLt
  // kernel waits for the device to go idle while holding its context lock. Were the device
  // then waiting on a peer whose host thread needs that lock to enqueue its copy into our
  // memory, both would hang (seen on 2x H200 with autotuning).
  Status Prepare(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, bool b_transposed,
                 void* c, int64_t ldc, int64_t m, int64_t k, int64_t n, cudaStream_t tune_stream);

  // c[m, n] = a[m, k] @ b[k, n], row-major, with leading dims lda/ldb/ldc (elements). With
  // `b_transposed`, b is stored as its transpose [n, k] (a backward pass's w.T, read in
  // place instead of copied). Accumulates in float32; output in `t`.
  Status Matmul(DType t, const void* a, int64_t lda, const void* b, int64_t ldb, bool b_transposed,
                void* c, int64_t ldc, int64_t m, int64_t k, int64_t n, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo;
  };
  // dtype, m, k, n, lda, ldb, ldc, b transposed
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
  // A new plan for `key` (cuBLASLt's heuristic pick, or with options_.autotune the fastest
  // of its candidates, timed on `stream`), stored in plans_.
  Status MakePlan(const Key& key, const void* a, const void* b, void* c, cudaStream_t stream,
                  Plan** plan);
  // Fastest of `count` candidate algorithms on `stream`, by the median of a few runs.
  Status PickFastest(Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count,
                     const void* a, const void* b, void* c, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  GemmOptions options_;
  std::map<Key, Plan> plans_;  // one per shape; only the owning device's thread uses it
};

}  // namespace jax_ub
