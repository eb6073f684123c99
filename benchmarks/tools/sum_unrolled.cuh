// sum_unrolled.cuh: solo_schedule.cu's probe of the reduce-scatter's sum pass, the sum with the
// partials' count known when compiled. Not part of the library.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// The same sum with the partials' count known when compiled, so that each thread has all
// its loads in flight at once (the library's loop over a runtime count issues them one by
// one): whether the library's pass leaves memory bandwidth unused. bf16, 8 per 16 bytes.
template <int kParts>
__global__ void SumUnrolled(const uint4* __restrict__ parts, int64_t nvec,
                            uint4* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nvec;
       v += stride) {
    uint4 raw[kParts];
#pragma unroll
    for (int j = 0; j < kParts; ++j) raw[j] = parts[j * nvec + v];
    float acc[8] = {};
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw[j]);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += __bfloat162float(e[q]);
    }
    uint4 packed;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int q = 0; q < 8; ++q) o[q] = __float2bfloat16_rn(acc[q]);
    out[v] = packed;
  }
}

// SumUnrolled<parts> for parts of 2..8 (8: any more).
template <int kParts>
void LaunchUnrolled(int parts, int blocks, int threads, cudaStream_t stream, const uint4* in,
                    int64_t nvec, uint4* out) {
  if constexpr (kParts < 8) {
    if (parts != kParts)
      return LaunchUnrolled<kParts + 1>(parts, blocks, threads, stream, in, nvec, out);
  }
  SumUnrolled<kParts><<<blocks, threads, 0, stream>>>(in, nvec, out);
}
