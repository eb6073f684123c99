#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

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

// out[i] = addend[i] (float32, where given) + the sum over the partials j set in `which`, in
// ascending order, of parts[j * stride + i], accumulated in float32 and written as T, or as
// float32 to `out_f32` where that is given (a partial sum to be added to later). A fixed
// order (rank order, not arrival order) keeps results bitwise reproducible. `vector`: every
// pointer and the stride are 16-byte aligned, so each thread moves 16 bytes of T at a time;
// else (an odd number of columns can start a partial mid-word) element by element.
template <typename T>
__global__ void SumParts(const T* parts, int64_t stride, uint64_t which, const float* addend,
                         int64_t count, bool vector, T* out, float* out_f32) {
  constexpr int kVec = 16 / sizeof(T);  // a multiple of 4: whole float4s of accumulator
  const int64_t nvec = vector ? count / kVec : 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t v = first; v < nvec; v += step) {
    float acc[kVec] = {};
    if (addend != nullptr) {
#pragma unroll
      for (int q = 0; q < kVec; q += 4)
        *reinterpret_cast<float4*>(acc + q) =
            reinterpret_cast<const float4*>(addend + v * kVec)[q / 4];
    }
    for (uint64_t rest = which; rest != 0; rest &= rest - 1) {
      uint4 raw = reinterpret_cast<const uint4*>(parts + (__ffsll(rest) - 1) * stride)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int q = 0; q < kVec; ++q) acc[q] += ToF32(e[q]);
    }
    if (out_f32 != nullptr) {
#pragma unroll
      for (int q = 0; q < kVec; q += 4)
        reinterpret_cast<float4*>(out_f32 + v * kVec)[q / 4] = *reinterpret_cast<float4*>(acc + q);
      continue;
    }
    uint4 packed;
    T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int q = 0; q < kVec; ++q) o[q] = FromF32<T>(acc[q]);
    reinterpret_cast<uint4*>(out)[v] = packed;
  }
  for (int64_t i = nvec * kVec + first; i < count; i += step) {
    float acc = addend != nullptr ? addend[i] : 0.f;
    for (uint64_t rest = which; rest != 0; rest &= rest - 1)
      acc += ToF32(parts[(__ffsll(rest) - 1) * stride + i]);
    if (out_f32 != nullptr) {
      out_f32[i] = acc;
    } else {
      out[i] = FromF32<T>(acc);
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
Status LaunchSum(const void* parts, int64_t stride, uint64_t which, const float* addend,
                 int64_t count, void* out, bool out_f32, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  // Float32 operands need 4-byte alignment even element by element.
  if (reinterpret_cast<uintptr_t>(addend) % 4 != 0 ||
      (out_f32 && reinterpret_cast<uintptr_t>(out) % 4 != 0))
    return Internal("LaunchSum: a float32 accumulator must be 4-byte aligned");
  const bool vector = Aligned16(parts) && Aligned16(out) && Aligned16(addend) &&
                      stride * static_cast<int64_t>(sizeof(T)) % 16 == 0;
  const int threads = 256;
  const int64_t per_thread = vector ? 16 / sizeof(T) : 1;
  const int64_t work = (count + per_thread - 1) / per_thread;
  const int blocks = static_cast<int>(std::min<int64_t>((work + threads - 1) / threads, 132 * 8));
  SumParts<T><<<blocks, threads, 0, stream>>>(
      static_cast<const T*>(parts), stride, which, addend, count, vector,
      out_f32 ? nullptr : static_cast<T*>(out), out_f32 ? static_cast<float*>(out) : nullptr);
  return CudaStatus(cudaGetLastError(), "SumParts launch");
}

}  // namespace

Status LaunchSum(DType t, const void* parts, int64_t stride, uint64_t which, const float* addend,
                 int64_t count, void* out, bool out_f32, cudaStream_t stream) {
  switch (t) {
    case DType::kBF16:
      return LaunchSum<__nv_bfloat16>(parts, stride, which, addend, count, out, out_f32, stream);
    case DType::kF16:
      return LaunchSum<__half>(parts, stride, which, addend, count, out, out_f32, stream);
    default:
      return LaunchSum<float>(parts, stride, which, addend, count, out, out_f32, stream);
  }
}

Status LaunchSumStep(DType t, const Step& step, int64_t n, const void* src, const void* addend,
                     void* dst, cudaStream_t stream) {
  return LaunchSum(t, src, step.bytes / DTypeSize(t), step.parts, static_cast<const float*>(addend),
                   step.rows * n, dst, step.to_float, stream);
}

Status LaunchSum(DType t, const void* parts, int64_t count, int nparts, void* out,
                 cudaStream_t stream) {
  if (nparts < 1 || nparts > 64) return Internal("LaunchSum: nparts must be 1..64");
  const uint64_t all = nparts == 64 ? ~uint64_t{0} : (uint64_t{1} << nparts) - 1;
  return LaunchSum(t, parts, count, all, nullptr, count, out, false, stream);
}

Status PreloadSumKernels() {
  cudaFuncAttributes attr;
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<float>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<__nv_bfloat16>));
  JAX_UB_CUDA(cudaFuncGetAttributes(&attr, SumParts<__half>));
  return Status::Ok();
}

}  // namespace jax_ub
