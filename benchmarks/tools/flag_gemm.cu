// flag_gemm: the driver (data, checks, timing, main) of the flag-waiting CUTLASS SM90 bf16 GEMM
// in flag_gemm_kernel.cuh, whose header says how its scheduler waits for the flag of each tile's
// row block of A. D[M,N] = A[M,K] @ B[K,N] (B: the weight w[k,n]), row-major bf16, fp32 accum.
// Build (CUTLASS 4.2 headers, e.g. the nvidia-cutlass wheel's cutlass_library/source/include;
// cuBLASLt; CUDA 13; about 3 minutes on 2 cores; `ninja -C build/dev flag_gemm` where CMake
// found CUTLASS, as benchmarks/device_run.sh flaggemm does):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -Isrc -I<cutlass>/include
//        -I<cublas>/include benchmarks/tools/flag_gemm.cu -o build/flag_gemm
//        -L<cublas>/lib -lcublasLt   (the pip wheel's library: -l:libcublasLt.so.13)
// Usage: flag_gemm M,K,N blocks seconds [configs|all] [order]
//   configs: comma list of coop_128x256_c2, coop_128x128_c1, ping_128x128_c2 (default all);
//   order: comma list of the row blocks in arrival order (default 0,1,...,blocks-1).
// Prints correctness (flags set before the call; flags released late by a kernel that copies
// each row block into a NaN-filled A and then sets its flag; a no-wait control on the same late
// data; a wait that gives up where the library's watchdog fires the call, its flags never
// raised: within a few ms, the health word raised), then the median ms per call over 3 rounds of >=
// `seconds` s per implementation, calls interleaved one by one (TimeRounds), of: cuBLASLt (its
// heuristic's first pick); per config: flags pre-set, no wait, stock scheduler; and the schedule
// the library runs today, data in place: cuBLASLt per contiguous span of row blocks (the first
// block in the order, the blocks after it, those before it). Blocks landing while the GEMM runs:
// paced_gemm.cu (a modelled link; within one GPU a device-to-device copy runs on SMs, which a
// persistent GEMM waiting for it holds).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flag_gemm_bench.cuh"

namespace fg {
// Marks itself started (host-mapped word), waits `delay_ns`, then per slot copies the row block
// from src to dst and releases its flag; one CTA, so it needs no cross-CTA ordering.
__global__ void __launch_bounds__(512)
    ReleaseLate(const uint4* src, uint4* dst, int64_t vec_per_block, int blocks, uint64_t order,
                int* flags, int target, volatile int* started, uint64_t delay_ns) {
  if (threadIdx.x == 0) {
    *started = 1;
    __threadfence_system();
  }
  for (uint64_t t0 = Now(); Now() - t0 < delay_ns;) __nanosleep(1000);
  for (int s = 0; s < blocks; ++s) {
    const int64_t base = int64_t((order >> (4 * s)) & 15u) * vec_per_block;
    constexpr int kUnroll = 8;
    for (int64_t i = threadIdx.x; i < vec_per_block; i += int64_t(blockDim.x) * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + int64_t(u) * blockDim.x;
        if (j < vec_per_block) v[u] = src[base + j];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + int64_t(u) * blockDim.x;
        if (j < vec_per_block) dst[base + j] = v[u];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      StoreRelease(flags + ((order >> (4 * s)) & 15u), target);
    }
  }
}

struct Buffers {
  bf16 *a, *a_late, *b, *d, *ref;
  int *flags, *err;
  ErrorCheck check;
  int* started;  // host-mapped
  void* ws;
};

double RelError(const Problem& p, Buffers& m, bf16* d, unsigned long long* nans) {
  return m.check.Rel(d, m.ref, int64_t(p.m) * p.n, nans);
}

// Prints d's error (and a wait's timeout, if any) and whether that passes; clears d.
bool Report(const Problem& p, Buffers& m, bf16* d, const char* name, const char* what) {
  unsigned long long nans = 0;
  const double rel = RelError(p, m, d, &nans);
  int err = 0;
  CHECK(cudaMemcpy(&err, m.err, sizeof(int), cudaMemcpyDeviceToHost));
  const bool pass = rel < 1e-2 && nans == 0 && err == 0;
  std::printf("%-16s %-34s rel_err %.2e  nonfinite %llu  %s%s\n", name, what, rel, nans,
              err ? "TIMEOUT " : "", pass ? "PASS" : "FAIL");
  return pass;
}

// Late arrival: A_late all NaN, flags 0; ReleaseLate starts first on s2, then `op` on s1.
void RunLate(const Problem& p, Buffers& m, Op& op, cudaStream_t s1, cudaStream_t s2) {
  const int64_t a_elems = int64_t(p.m) * p.k;
  CHECK(cudaMemset(m.a_late, 0xff, a_elems * sizeof(bf16)));
  CHECK(cudaMemset(m.flags, 0, 16 * sizeof(int)));
  CHECK(cudaMemset(m.err, 0, sizeof(int)));
  CHECK(cudaDeviceSynchronize());
  *reinterpret_cast<volatile int*>(m.started) = 0;
  ReleaseLate<<<1, 512, 0, s2>>>(reinterpret_cast<const uint4*>(m.a),
                                 reinterpret_cast<uint4*>(m.a_late), a_elems / p.blocks / 8,
                                 p.blocks, p.order, m.flags, 1, m.started, 200000);
  CHECK(cudaGetLastError());
  const auto t0 = std::chrono::steady_clock::now();
  while (*reinterpret_cast<volatile int*>(m.started) == 0) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(5))
      Fail("ReleaseLate", "did not start within 5 s");
  }
  op.Run(s1);
  CHECK(cudaDeviceSynchronize());
}

// The library's way out of a stalled wait (GiveUp): flags never raised, the call fired from
// the host 20 ms in (a host-mapped word, as the watchdog's board). Passes where the kernel ends
// well before the tools' 2 s timeout, with the health word raised and no timeout.
bool RunFired(const Problem& p, const ConfigEntry& c, Buffers& m, cudaStream_t s1) {
  uint64_t* fired = nullptr;
  unsigned long long* health = nullptr;
  CHECK(cudaHostAlloc(&fired, sizeof(uint64_t), cudaHostAllocMapped));
  CHECK(cudaMalloc(&health, sizeof(unsigned long long)));
  *reinterpret_cast<volatile uint64_t*>(fired) = 0;
  uint64_t* fired_device = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&fired_device), fired, 0));
  CHECK(cudaMemset(health, 0, sizeof(unsigned long long)));
  CHECK(cudaMemset(m.flags, 0, 16 * sizeof(int)));
  CHECK(cudaMemset(m.err, 0, sizeof(int)));
  CHECK(cudaDeviceSynchronize());
  constexpr uint64_t kCall = 7;
  Problem q = p;
  q.give_up = {fired_device, kCall, health};
  auto op = c.make(q, m.a, m.b, m.d, m.flags, m.err, false);
  op->Run(s1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = std::chrono::steady_clock::now();
  *reinterpret_cast<volatile uint64_t*>(fired) = kCall;
  cudaError_t e;
  while ((e = cudaStreamQuery(s1)) == cudaErrorNotReady) std::this_thread::yield();
  CHECK(e);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  unsigned long long raised = 0;
  int err = 0;
  CHECK(cudaMemcpy(&raised, health, sizeof(raised), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&err, m.err, sizeof(int), cudaMemcpyDeviceToHost));
  const bool pass = ms < 500 && raised == 1 && err == 0;
  std::printf("%-16s %-34s ended %.1f ms after the fire, health %llu, timeout %d  %s\n", c.name,
              "fired, flags never raised", ms, raised, err, pass ? "PASS" : "FAIL");
  CHECK(cudaFreeHost(fired));
  CHECK(cudaFree(health));
  return pass;
}

}  // namespace fg

int main(int argc, char** argv) {
  using namespace fg;
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s M,K,N blocks seconds [configs|all] [order]\n", argv[0]);
    return 2;
  }
  Problem p{};
  if (std::sscanf(argv[1], "%d,%d,%d", &p.m, &p.k, &p.n) != 3 || p.m <= 0 || p.k <= 0 || p.n <= 0)
    Fail("M,K,N", argv[1]);
  p.blocks = std::atoi(argv[2]);
  const double seconds = std::atof(argv[3]);
  const std::string want = argc > 4 ? argv[4] : "all";
  if (p.blocks < 1 || p.blocks > 16) Fail("blocks", "must be 1..16");
  if (p.k % 8 || p.n % 8) Fail("K,N", "must be multiples of 8");
  std::vector<int> order;
  for (const char* at = argc > 5 ? argv[5] : ""; *at;) {  // "i,j,...", no empty item
    char* end = nullptr;
    order.push_back(int(std::strtol(at, &end, 10)));
    if (end == at || (*end && (*end != ',' || !end[1]))) Fail("order", argv[5]);
    at = *end ? end + 1 : end;
  }
  if (order.empty())
    for (int i = 0; i < p.blocks; ++i) order.push_back(i);
  std::vector<int> seen(p.blocks, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    if (order.size() != size_t(p.blocks) || order[i] < 0 || order[i] >= p.blocks ||
        seen[order[i]]++)
      Fail("order", "must be a permutation of 0..blocks-1");
    p.order |= uint64_t(order[i]) << (4 * i);
  }
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceGetAttribute(&p.sm_count, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; M,K,N = %d,%d,%d, blocks %d, order %s, CUTLASS %d.%d.%d\n",
              prop.name, p.sm_count, p.m, p.k, p.n, p.blocks, argc > 5 ? argv[5] : "0..blocks-1",
              CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH);

  std::vector<ConfigEntry> all = {Entry<128, 256, 2, false>("coop_128x256_c2"),
                                  Entry<128, 128, 1, false>("coop_128x128_c1"),
                                  Entry<128, 128, 2, true>("ping_128x128_c2")};
  std::vector<ConfigEntry> configs;
  for (auto& c : all) {
    if (want != "all" &&
        ("," + want + ",").find(std::string(",") + c.name + ",") == std::string::npos)
      continue;
    if (p.m % (p.blocks * c.row_unit)) {
      std::printf("%s: skipped (M/blocks not a multiple of %d)\n", c.name, c.row_unit);
      continue;
    }
    configs.push_back(c);
  }

  Buffers m{};
  const int64_t a_elems = int64_t(p.m) * p.k, b_elems = int64_t(p.k) * p.n,
                d_elems = int64_t(p.m) * p.n;
  for (auto [ptr, elems] : {std::pair{&m.a, a_elems},
                            {&m.a_late, a_elems},
                            {&m.b, b_elems},
                            {&m.d, d_elems},
                            {&m.ref, d_elems}})
    CHECK(cudaMalloc(ptr, elems * sizeof(bf16)));
  CHECK(cudaMalloc(&m.flags, 16 * sizeof(int)));
  CHECK(cudaMalloc(&m.err, sizeof(int)));
  m.check.Create();
  CHECK(cudaHostAlloc(&m.started, sizeof(int), cudaHostAllocMapped));
  const size_t ws_size = size_t(32) << 20;
  CHECK(cudaMalloc(&m.ws, ws_size));
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(m.a), a_elems, 0x1234u, 1.0f, nullptr);
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(m.b), b_elems, 0x9876u, 1.0f, nullptr);
  cudaStream_t s1, s2;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  Lt lt{p, m.b, m.ws, ws_size};
  lt.Create();
  std::vector<LtSpan> spans = {lt.Plan(0, p.m)};  // [0]: the whole GEMM; then the chunks
  auto cublas = [&](bf16* out) { lt.Run(spans[0], m.a, out, s1); };
  cublas(m.ref);
  CHECK(cudaDeviceSynchronize());

  // Correctness.
  bool all_pass = true;
  std::vector<std::unique_ptr<Op>> flag_ops, nowait_ops, stock_ops;
  for (auto& c : configs) {
    flag_ops.push_back(c.make(p, m.a, m.b, m.d, m.flags, m.err, false));
    nowait_ops.push_back(c.make(p, m.a, m.b, m.d, nullptr, m.err, false));
    stock_ops.push_back(c.make(p, m.a, m.b, m.d, nullptr, m.err, true));
    auto late = c.make(p, m.a_late, m.b, m.d, m.flags, m.err, false);
    auto late_nowait = c.make(p, m.a_late, m.b, m.d, nullptr, m.err, false);
    CHECK(cudaMemset(m.err, 0, sizeof(int)));
    SetFlags<<<1, 32>>>(m.flags, 16, 1);
    CHECK(cudaGetLastError());
    flag_ops.back()->Run(s1);
    CHECK(cudaDeviceSynchronize());
    all_pass &= Report(p, m, m.d, c.name, "flags set before");
    stock_ops.back()->Run(s1);
    CHECK(cudaDeviceSynchronize());
    all_pass &= Report(p, m, m.d, c.name, "stock scheduler");
    RunLate(p, m, *late, s1, s2);
    all_pass &= Report(p, m, m.d, c.name, "flags released late");
    RunLate(p, m, *late_nowait, s1, s2);
    unsigned long long nans = 0;
    const double rel = RelError(p, m, m.d, &nans);
    std::printf("%-16s %-34s rel_err %.2e  nonfinite %llu  %s\n", c.name,
                "control: no wait, late data", rel, nans,
                nans ? "ok (saw unreleased rows, as expected)" : "UNEXPECTED (race not caught)");
    all_pass &= RunFired(p, c, m, s1);
  }
  std::printf("correctness: %s\n", all_pass ? "PASS" : "FAIL");

  // Timing: flags pre-set to the target for the flag variants.
  SetFlags<<<1, 32>>>(m.flags, 16, 1);
  CHECK(cudaGetLastError());
  CHECK(cudaMemset(m.err, 0, sizeof(int)));
  CHECK(cudaDeviceSynchronize());
  std::vector<Timed> impls;
  impls.push_back({"cublaslt", s1, [&] { cublas(m.d); }});
  for (size_t i = 0; i < configs.size(); ++i) {
    Op* f = flag_ops[i].get();
    Op* w = nowait_ops[i].get();
    Op* s = stock_ops[i].get();
    impls.push_back({std::string(configs[i].name) + ":flags", s1, [f, s1] { f->Run(s1); }});
    impls.push_back({std::string(configs[i].name) + ":nowait", s1, [w, s1] { w->Run(s1); }});
    impls.push_back({std::string(configs[i].name) + ":stock", s1, [s, s1] { s->Run(s1); }});
  }
  // The library's schedule: block r's GEMM, then the blocks after it, then those before it.
  const int rb = p.m / p.blocks, r = order[0];
  spans.push_back(lt.Plan(r * rb, rb));
  if (r + 1 < p.blocks) spans.push_back(lt.Plan((r + 1) * rb, p.m - (r + 1) * rb));
  if (r > 0) spans.push_back(lt.Plan(0, r * rb));
  impls.push_back({"chunked:steps", s1, [&] {
                     for (size_t i = 1; i < spans.size(); ++i) lt.Run(spans[i], m.a, m.d, s1);
                   }});
  TimeRounds(impls, 3, seconds);
  int err = 0;
  CHECK(cudaMemcpy(&err, m.err, sizeof(int), cudaMemcpyDeviceToHost));
  if (err) std::printf("TIMEOUT during timing (block %d)\n", err - 1);
  const double flops = 2.0 * p.m * p.n * double(p.k);
  std::printf("%-24s %9s %8s %8s %8s\n", "impl", "ms", "vs_cublas", "spread", "TFLOP/s");
  for (auto& t : impls) {
    const float med = t.Median();
    std::printf("%-24s %9.4f %8.3f %7.1f%% %8.1f\n", t.name.c_str(), med, med / impls[0].Median(),
                100.0 * t.Spread(), flops / med * 1e-9);
  }
  flag_ops.clear(), nowait_ops.clear(), stock_ops.clear();
  lt.Destroy(spans);
  CHECK(cudaStreamDestroy(s1));
  CHECK(cudaStreamDestroy(s2));
  for (void* ptr : {(void*)m.a, (void*)m.a_late, (void*)m.b, (void*)m.d, (void*)m.ref,
                    (void*)m.flags, (void*)m.err, m.ws})
    CHECK(cudaFree(ptr));
  m.check.Destroy();
  CHECK(cudaFreeHost(m.started));
  return all_pass ? 0 : 1;
}
