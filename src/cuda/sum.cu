#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/check.h"
#include "cuda/sum.h"

namespace jax_ub {
namespace {

__device__ inline float ToF32(float v) { return v; }
__device__ inline float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float ToF32(__half v) { return __half2float(v); }
template <typename T>
__device__ inline T FromF32(float v);
template <>
__device__ inline float FromF32<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ inline __half FromF32<__half>(float v) {
  return __float2half_rn(v);
}

// out[i] = sum over j in rank order of parts[j * count + i], accumulated in float.
// Rank order (not arrival order) keeps results bitwise reproducible.
template <typename T>
__global__ void SumChunks(const T* __restrict__ parts, int64_t count, int nparts,
                          T* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t nvec = count / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nvec;
       v += stride) {
    float acc[kVec] = {};
    for (int j = 0; j < nparts; ++j) {
      uint4 raw = reinterpret_cast<const uint4*>(parts + j * count)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int q = 0; q < kVec; ++q) acc[q] += ToF32(e[q]);
    }
    uint4 packed;
    T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int q = 0; q < kVec; ++q) o[q] = FromF32<T>(acc[q]);
    reinterpret_cast<uint4*>(out)[v] = packed;
  }
  for (int64_t i = nvec * kVec + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += stride) {
    float acc = 0.f;
    for (int j = 0; j < nparts; ++j) acc += ToF32(parts[j * count + i]);
    out[i] = FromF32<T>(acc);
  }
}

template <typename T>
Status LaunchSum(const void* parts, int64_t count, int nparts, void* out, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  const int threads = 256;
  const int64_t work = (count + 16 / sizeof(T) - 1) / (16 / sizeof(T));
  const int blocks = static_cast<int>(std::min<int64_t>((work + threads - 1) / threads, 132 * 8));
  SumChunks<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(parts), count, nparts,
                                               static_cast<T*>(out));
  return CudaStatus(cudaGetLastError(), "SumChunks launch");
}

}  // namespace

Status LaunchSum(DType t, const void* parts, int64_t count, int nparts, void* out,
                 cudaStream_t stream) {
  switch (t) {
    case DType::kBF16:
      return LaunchSum<__nv_bfloat16>(parts, count, nparts, out, stream);
    case DType::kF16:
      return LaunchSum<__half>(parts, count, nparts, out, stream);
    default:
      return LaunchSum<float>(parts, count, nparts, out, stream);
  }
}

Status PreloadSumKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumChunks<float>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumChunks<__nv_bfloat16>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumChunks<__half>));
  return Status::Ok();
}

}  // namespace jax_ub
