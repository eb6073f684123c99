// What the two drivers of the flag-waiting GEMM (flag_gemm.cu, paced_gemm.cu) share: setting
// flags, an output's error against its reference, and timing interleaved loops of async calls.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "flag_gemm_kernel.cuh"

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

// One timed implementation: `call` enqueues one call, ending on stream s.
struct Timed {
  std::string name;
  cudaStream_t s;
  std::function<void()> call;
  std::vector<float> ms = {};
  float Median() const {
    std::vector<float> v = ms;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }
  float Spread() const {
    const auto [lo, hi] = std::minmax_element(ms.begin(), ms.end());
    return (*hi - *lo) / Median();
  }
};

// ms per call of a loop of at least `seconds`, after a warm-up call and a 3-call probe.
inline float TimeLoop(Timed& t, double seconds, cudaEvent_t e0, cudaEvent_t e1) {
  auto loop = [&](int n) {
    CHECK(cudaEventRecord(e0, t.s));
    for (int i = 0; i < n; ++i) t.call();
    CHECK(cudaEventRecord(e1, t.s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / n;
  };
  t.call();
  const float ms = loop(3);
  return loop(std::max(5, int(seconds * 1e3 / std::max(ms, 1e-3f))));
}

// `rounds` interleaved rounds: each times every implementation once, in an order of its own
// (shuffled, seeded), since a loop's time depends on what ran before it: the same schedule
// timed right after another in every round read up to 6% slower than in the next slot.
inline void TimeRounds(std::vector<Timed>& impls, int rounds, double seconds) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<size_t> order(impls.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 shuffle_bits(12345);
  for (int round = 0; round < rounds; ++round) {
    std::shuffle(order.begin(), order.end(), shuffle_bits);
    for (size_t i : order) impls[i].ms.push_back(TimeLoop(impls[i], seconds, e0, e1));
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
}

}  // namespace fg
