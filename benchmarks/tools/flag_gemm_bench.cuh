// What the two drivers of the flag-waiting GEMM (flag_gemm.cu, paced_gemm.cu) share: setting
// flags and an output's error against its reference (timing: timed_calls.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "flag_gemm_kernel.cuh"
#include "timed_calls.h"

namespace fg {

__global__ void SetFlags(int* flags, int n, int value) {
  if (threadIdx.x < n) flags[threadIdx.x] = value;
}

// sums[0] += sum (d - r)^2, sums[1] += sum r^2; *nans += NaN/inf count of d.
__global__ void Compare(const bf16* d, const bf16* r, int64_t n, double* sums,
                        unsigned long long* nans) {
  double e = 0, q = 0;
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = float(d[i]), y = float(r[i]);
    if (!isfinite(x)) ++bad;
    e += double(x - y) * (x - y);
    q += double(y) * y;
  }
  for (int o = 16; o > 0; o >>= 1) {
    e += __shfl_down_sync(0xffffffffu, e, o);
    q += __shfl_down_sync(0xffffffffu, q, o);
    bad += __shfl_down_sync(0xffffffffu, bad, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(sums, e);
    atomicAdd(sums + 1, q);
    atomicAdd(nans, bad);
  }
}

// ||d - ref|| / ||ref|| over n values and the count of non-finite d; clears d afterwards.
struct ErrorCheck {
  double* sums = nullptr;
  unsigned long long* nans = nullptr;
  void Create() {
    CHECK(cudaMalloc(&sums, 2 * sizeof(double)));
    CHECK(cudaMalloc(&nans, sizeof(unsigned long long)));
  }
  void Destroy() {
    CHECK(cudaFree(sums));
    CHECK(cudaFree(nans));
  }
  double Rel(bf16* d, const bf16* ref, int64_t n, unsigned long long* nonfinite) const {
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemset(sums, 0, 2 * sizeof(double)));
    CHECK(cudaMemset(nans, 0, sizeof(unsigned long long)));
    Compare<<<1024, 256>>>(d, ref, n, sums, nans);
    CHECK(cudaGetLastError());
    double s[2];
    CHECK(cudaMemcpy(s, sums, sizeof(s), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(nonfinite, nans, sizeof(*nonfinite), cudaMemcpyDeviceToHost));
    CHECK(cudaMemset(d, 0, n * sizeof(bf16)));
    return std::sqrt(s[0] / std::max(s[1], 1e-30));
  }
};

using jax_ub_tool::Timed;
using jax_ub_tool::TimeRounds;

}  // namespace fg
