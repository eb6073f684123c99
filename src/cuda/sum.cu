#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "cuda/check.h"
#include "cuda/sum.h"
#include "protocol/topology.h"

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

// Up to kMaxRanks partials, by address (a kernel parameter).
struct Parts {
  const void* at[kMaxRanks];
};

// out[i] = sum over j in order of parts.at[j][i], accumulated in float. A fixed order (rank
// order, not arrival order) keeps results bitwise reproducible. `out` may be a part.
template <typename T>
__global__ void SumParts(Parts parts, int64_t count, int nparts, T* out) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t nvec = count / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nvec;
       v += stride) {
    float acc[kVec] = {};
    for (int j = 0; j < nparts; ++j) {
      uint4 raw = static_cast<const uint4*>(parts.at[j])[v];
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
    for (int j = 0; j < nparts; ++j) acc += ToF32(static_cast<const T*>(parts.at[j])[i]);
    out[i] = FromF32<T>(acc);
  }
}

template <typename T>
Status LaunchSumParts(const Parts& parts, int64_t count, int nparts, void* out,
                      cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  const int threads = 256;
  const int64_t work = (count + 16 / sizeof(T) - 1) / (16 / sizeof(T));
  const int blocks = static_cast<int>(std::min<int64_t>((work + threads - 1) / threads, 132 * 8));
  SumParts<T><<<blocks, threads, 0, stream>>>(parts, count, nparts, static_cast<T*>(out));
  return CudaStatus(cudaGetLastError(), "SumParts launch");
}

Status LaunchSumParts(DType t, const Parts& parts, int64_t count, int nparts, void* out,
                      cudaStream_t stream) {
  switch (t) {
    case DType::kBF16:
      return LaunchSumParts<__nv_bfloat16>(parts, count, nparts, out, stream);
    case DType::kF16:
      return LaunchSumParts<__half>(parts, count, nparts, out, stream);
    default:
      return LaunchSumParts<float>(parts, count, nparts, out, stream);
  }
}

}  // namespace

Status LaunchSum(DType t, const void* parts, int64_t count, int nparts, void* out,
                 cudaStream_t stream) {
  if (nparts < 1 || nparts > kMaxRanks)
    return Internal("LaunchSum: " + std::to_string(nparts) + " partials, at most " +
                    std::to_string(kMaxRanks));
  Parts p{};
  for (int j = 0; j < nparts; ++j)
    p.at[j] = static_cast<const char*>(parts) + j * count * DTypeSize(t);
  return LaunchSumParts(t, p, count, nparts, out, stream);
}

Status LaunchAdd(DType t, const void* a, const void* b, int64_t count, void* out,
                 cudaStream_t stream) {
  Parts p{};
  p.at[0] = a;
  p.at[1] = b;
  return LaunchSumParts(t, p, count, 2, out, stream);
}

Status PreloadSumKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<float>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<__nv_bfloat16>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<__half>));
  return Status::Ok();
}

}  // namespace jax_ub
