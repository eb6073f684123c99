// timed_calls.h: how the CUDA diagnostics in benchmarks/tools/ time implementations against each
// other: async calls interleaved one by one, an event between calls, so that every
// implementation runs at the same clocks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda_tool.h"

namespace jax_ub_tool {

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
  Check(cudaEventCreate(&e0), "cudaEventCreate");
  Check(cudaEventCreate(&e1), "cudaEventCreate");
  // A warm-up call and a 3-call probe each: the passes a round needs.
  double pass_ms = 0;
  for (Timed& t : impls) {
    t.call();
    Check(cudaEventRecord(e0, t.s), "cudaEventRecord");
    for (int i = 0; i < 3; ++i) t.call();
    Check(cudaEventRecord(e1, t.s), "cudaEventRecord");
    Check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    pass_ms += ms / 3;
  }
  Check(cudaEventDestroy(e0), "cudaEventDestroy");
  Check(cudaEventDestroy(e1), "cudaEventDestroy");
  const size_t kMaxCalls = 20000;  // events a round
  const size_t passes = std::min(std::max<size_t>(5, size_t(seconds * 1e3 * n / pass_ms)),
                                 std::max<size_t>(1, kMaxCalls / n));
  std::vector<cudaEvent_t> marks(passes * n + 1);
  for (cudaEvent_t& e : marks) Check(cudaEventCreate(&e), "cudaEventCreate");
  std::vector<size_t> order(n), who(passes * n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937 shuffle_bits(12345);
  std::vector<double> sum(n);
  for (int round = 0; round < rounds; ++round) {
    cudaStream_t last = impls[0].s;
    Check(cudaEventRecord(marks[0], last), "cudaEventRecord");
    for (size_t p = 0, c = 0; p < passes; ++p) {
      std::shuffle(order.begin(), order.end(), shuffle_bits);
      for (size_t i : order) {
        Timed& t = impls[i];
        if (t.s != last) Check(cudaStreamWaitEvent(t.s, marks[c]), "cudaStreamWaitEvent");
        t.call();
        Check(cudaEventRecord(marks[c + 1], t.s), "cudaEventRecord");
        who[c++] = i;
        last = t.s;
      }
    }
    Check(cudaEventSynchronize(marks.back()), "cudaEventSynchronize");
    std::fill(sum.begin(), sum.end(), 0.0);
    for (size_t c = 0; c + 1 < marks.size(); ++c) {
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, marks[c], marks[c + 1]), "cudaEventElapsedTime");
      sum[who[c]] += ms;
    }
    for (size_t i = 0; i < n; ++i) impls[i].ms.push_back(float(sum[i] / passes));
  }
  for (cudaEvent_t e : marks) Check(cudaEventDestroy(e), "cudaEventDestroy");
}

}  // namespace jax_ub_tool
