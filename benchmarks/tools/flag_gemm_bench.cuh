// What the two drivers of the flag-waiting GEMM (flag_gemm.cu, paced_gemm.cu) share: setting
// flags, an output's error against its reference, and timing async calls interleaved one by one.
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

// `rounds` rounds, each at least `seconds` per implementation. A round is passes in which every
// implementation is called once, in an order shuffled per pass (seeded), with no host wait
// between calls; an event between consecutive calls times each. An implementation's time in
// a round is its calls' mean. Loops of one implementation at a time (the earlier way) read the
// same schedule, timed twice, 4-7% apart in every paced_gemm run: a loop's clocks depend on
// the loops before it (the power cap), so calls are interleaved one by one instead, and every
// implementation sees the same clocks.
inline void TimeRounds(std::vector<Timed>& impls, int rounds, double seconds) {
  const size_t n = impls.size();
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  // A warm-up call and a 3-call probe each: the passes a round needs.
  double pass_ms = 0;
  for (Timed& t : impls) {
    t.call();
    CHECK(cudaEventRecord(e0, t.s));
    for (int i = 0; i < 3; ++i) t.call();
    CHECK(cudaEventRecord(e1, t.s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    pass_ms += ms / 3;
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  const size_t kMaxCalls = 20000;  // events a round
  const size_t passes = std::min(std::max<size_t>(5, size_t(seconds * 1e3 * n / pass_ms)),
                                 std::max<size_t>(1, kMaxCalls / n));
  std::vector<cudaEvent_t> marks(passes * n + 1);
  for (cudaEvent_t& e : marks) CHECK(cudaEventCreate(&e));
  std::vector<size_t> order(n), who(passes * n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937 shuffle_bits(12345);
  std::vector<double> sum(n);
  for (int round = 0; round < rounds; ++round) {
    cudaStream_t last = impls[0].s;
    CHECK(cudaEventRecord(marks[0], last));
    for (size_t p = 0, c = 0; p < passes; ++p) {
      std::shuffle(order.begin(), order.end(), shuffle_bits);
      for (size_t i : order) {
        Timed& t = impls[i];
        if (t.s != last) CHECK(cudaStreamWaitEvent(t.s, marks[c]));
        t.call();
        CHECK(cudaEventRecord(marks[c + 1], t.s));
        who[c++] = i;
        last = t.s;
      }
    }
    CHECK(cudaEventSynchronize(marks.back()));
    std::fill(sum.begin(), sum.end(), 0.0);
    for (size_t c = 0; c + 1 < marks.size(); ++c) {
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, marks[c], marks[c + 1]));
      sum[who[c]] += ms;
    }
    for (size_t i = 0; i < n; ++i) impls[i].ms.push_back(float(sum[i] / passes));
  }
  for (cudaEvent_t e : marks) CHECK(cudaEventDestroy(e));
}

}  // namespace fg
