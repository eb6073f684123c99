// What the standalone CUDA diagnostics in benchmarks/tools/ share: fail-fast checks and random
// bf16 operands (values that toggle bits like real data, so power draw is realistic).
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "protocol/status.h"

namespace jax_ub_tool {

inline void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

inline void Check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, cublasLtGetStatusName(s));
    std::exit(1);
  }
}

// The driver API's (stream memory operations, through jax_ub's DriverOps).
inline void Check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s failed (CUresult %d)\n", what, static_cast<int>(r));
    std::exit(1);
  }
}

// The library's own calls (its GEMM class, the sum kernel).
inline void Check(const jax_ub::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    std::exit(1);
  }
}

static __global__ void FillRandomKernel(__nv_bfloat16* p, int64_t count, uint32_t seed,
                                        float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffff) / 32768.0f - 1.0f) * scale);
  }
}

// `count` values uniform in [-scale, scale), enqueued on `stream`.
inline void FillRandom(__nv_bfloat16* p, int64_t count, uint32_t seed, float scale,
                       cudaStream_t stream) {
  FillRandomKernel<<<1024, 256, 0, stream>>>(p, count, seed, scale);
  Check(cudaGetLastError(), "FillRandom launch");
}

}  // namespace jax_ub_tool
