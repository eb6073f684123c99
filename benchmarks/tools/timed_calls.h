// timed_calls.h: how the CUDA diagnostics in benchmarks/tools/ time implementations against each
// other: async calls interleaved one by one, an event between calls, so that every
// implementation runs at the same clocks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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
  double host_us = 0;  // the host's time to enqueue one call (mean over the rounds)
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

// The gate: holds its stream until the host opens it (*word reaches `open`), for at most
// timeout_ns (then counts the timeout in *timed_out, and lets the stream go).
static __global__ void GateKernel(const volatile unsigned long long* word, unsigned long long open,
                                  unsigned long long timeout_ns, unsigned long long* timed_out) {
  auto now = [] {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  };
  const unsigned long long start = now();
  while (*word < open) {
    if (now() - start > timeout_ns) {
      atomicAdd(timed_out, 1ull);
      return;
    }
    __nanosleep(1000);
  }
}

// `rounds` rounds, each at least `seconds` per implementation. A round is passes in which every
// implementation is called once, in an order shuffled per pass (seeded), with no host wait
// between calls; an event between consecutive calls times each. An implementation's time in
// a round is its calls' mean. Loops of one implementation at a time (the earlier way) read the
// same schedule, timed twice, 4-7% apart in every paced_gemm run: a loop's clocks depend on
// the loops before it (the power cap), so calls are interleaved one by one instead, and every
// implementation sees the same clocks.
// Where the host takes longer to enqueue a call than the GPU to run it, the GPU waits for the
// host and the times are the host's. With `gate_passes` > 0 each `gate_passes` passes are
// enqueued behind a gate the host opens once they all are (GateKernel), so that the GPU runs
// them at its own pace, as it runs a program's calls queued ahead of it; the first call behind
// each gate is not counted (its time holds the gate's). Returns the gates that timed out (the
// host was held enqueueing: those batches' times are the host's again).
inline int TimeRounds(std::vector<Timed>& impls, int rounds, double seconds, int gate_passes = 0) {
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
  std::vector<char> counted(passes * n, 1);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  unsigned long long* gate = nullptr;  // host-mapped: [0] the word, [1] the timeouts
  unsigned long long* gate_device = nullptr;
  unsigned long long gates = 0;
  if (gate_passes > 0) {
    Check(cudaHostAlloc(&gate, 2 * sizeof(unsigned long long), cudaHostAllocMapped), "gate");
    Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_device), gate, 0), "gate");
    gate[0] = gate[1] = 0;
  }
  auto open_gate = [&] { __atomic_store_n(&gate[0], gates, __ATOMIC_RELEASE); };
  cudaEvent_t gated;  // the latest gate's end, for a batch's first call on another stream
  Check(cudaEventCreateWithFlags(&gated, cudaEventDisableTiming), "cudaEventCreate");
  std::mt19937 shuffle_bits(12345);
  std::vector<double> sum(n), calls(n), host_s(n);
  for (int round = 0; round < rounds; ++round) {
    cudaStream_t last = impls[0].s;
    Check(cudaEventRecord(marks[0], last), "cudaEventRecord");
    for (size_t p = 0, c = 0; p < passes; ++p) {
      if (gate_passes > 0 && p % gate_passes == 0) {
        if (p > 0) open_gate();
        GateKernel<<<1, 1, 0, last>>>(gate_device, ++gates, 200000000ull, gate_device + 1);
        Check(cudaGetLastError(), "GateKernel");
        Check(cudaEventRecord(gated, last), "cudaEventRecord");
        counted[c] = 0;
      }
      std::shuffle(order.begin(), order.end(), shuffle_bits);
      for (size_t i : order) {
        Timed& t = impls[i];
        if (t.s != last)
          Check(cudaStreamWaitEvent(t.s, counted[c] ? marks[c] : gated), "cudaStreamWaitEvent");
        const auto t0 = std::chrono::steady_clock::now();
        t.call();
        host_s[i] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        Check(cudaEventRecord(marks[c + 1], t.s), "cudaEventRecord");
        who[c++] = i;
        last = t.s;
      }
    }
    if (gate_passes > 0) open_gate();
    Check(cudaEventSynchronize(marks.back()), "cudaEventSynchronize");
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(calls.begin(), calls.end(), 0.0);
    for (size_t c = 0; c + 1 < marks.size(); ++c) {
      if (!counted[c]) continue;
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, marks[c], marks[c + 1]), "cudaEventElapsedTime");
      sum[who[c]] += ms;
      calls[who[c]] += 1;
    }
    for (size_t i = 0; i < n; ++i)
      impls[i].ms.push_back(calls[i] > 0 ? float(sum[i] / calls[i]) : NAN);
  }
  for (size_t i = 0; i < n; ++i) impls[i].host_us = host_s[i] * 1e6 / (double(rounds) * passes);
  for (cudaEvent_t e : marks) Check(cudaEventDestroy(e), "cudaEventDestroy");
  Check(cudaEventDestroy(gated), "cudaEventDestroy");
  int timed_out = 0;
  if (gate != nullptr) {
    timed_out = static_cast<int>(__atomic_load_n(&gate[1], __ATOMIC_ACQUIRE));
    Check(cudaFreeHost(gate), "gate");
  }
  return timed_out;
}

}  // namespace jax_ub_tool
