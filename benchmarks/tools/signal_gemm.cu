// signal_gemm: the reduce-scatter's compute side with one persistent GEMM that raises each
// row block's flag as the block is written (the library's SignalGemm, signal_gemm.cuh), on ONE
// GPU, for rank 0 of tp.
//
// First a check that a flag never rises before its block is written: D is filled with NaN, a
// watcher stream waits on each block's flag and copies the block to the host right then (copy
// engine), and every block must match cuBLASLt's GEMM. Then, interleaved call by call
// (timed_calls.h), 5 rounds of >= `seconds` each, median:
//   whole          cuBLASLt's whole GEMM (the no-communication bound's)
//   stock          the same CUTLASS kernel with CUTLASS's scheduler and epilogue
//   ordered        with FlagTileScheduler's block order (no flags): what the order costs
//   signal         SignalGemm, flags in device memory, nothing waiting: what signals cost on top
//                  (and its initialization at every call, as in the library)
//   cached         the same from parameters built once: whether that initialization costs the
//                  GPU time (on one H200 it did not, within 0.3%, at 8 shapes)
//   sum            the sum pass alone (the library's LaunchSum over tp partials)
//   signal+link    with gbps > 0: SignalGemm raising each partial's "done" word of solo_link.h's
//                  modelled link (a host thread: the peer's partial for us lands a transfer after
//                  our GEMM of the same step, one at a time), then the compute stream waits for
//                  every landing and sums the tp partials: the op, against solo_schedule's floor
//                  (the later of the whole GEMM and the last landing at the whole GEMM's pace,
//                  plus the sum pass); compare solo_schedule's `rs` rows at the same shape.
// Rank 0's blocks go in push order: block s at step s = 1..tp-1, its own block 0 last.
//
// Usage: signal_gemm tp m,k,n seconds [gbps]
//   m: a rank's output rows (the GEMM is [tp m, k] @ [k, n], m a multiple of 256); gbps: the
//   link's GB/s into a GPU (0: no signal+link row).
// Build: as paced_gemm (CUTLASS's headers; `ninja -C build/dev signal_gemm`).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/sum.h"
#include "flag_gemm_bench.cuh"
#include "signal_gemm.cuh"
#include "solo_link.h"

int main(int argc, char** argv) {
  using namespace fg;
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s tp m,k,n seconds [gbps]\n", argv[0]);
    return 2;
  }
  const int tp = std::atoi(argv[1]);
  long long m = 0, k = 0, n = 0;
  if (std::sscanf(argv[2], "%lld,%lld,%lld", &m, &k, &n) != 3) Fail("m,k,n", argv[2]);
  const double seconds = std::atof(argv[3]), gbps = argc > 4 ? std::atof(argv[4]) : 0.0;
  if (tp < 2 || tp > 16) Fail("tp", "must be 2..16");
  if (m <= 0 || m % 256 || k <= 0 || k % 8 || n <= 0 || n % 8)
    Fail("m,k,n", "m a positive multiple of 256, k and n of 8");
  if (!(seconds > 0) || gbps < 0) Fail("seconds, gbps", "seconds > 0, gbps >= 0");
  CHECK(cudaSetDevice(0));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const jax_ub::DriverOps* driver = nullptr;
  jax_ub_tool::Check(jax_ub::LoadDriverOps(&driver), "LoadDriverOps");
  jax_ub_tool::Check(jax_ub::PreloadSumKernels(), "PreloadSumKernels");

  const int rows = int(tp * m);
  const int64_t a_elems = int64_t(rows) * k, d_elems = int64_t(rows) * n, block = m * n;
  bf16 *a, *b, *d, *ref, *out;
  void* ws;
  const size_t ws_size = size_t(32) << 20;
  CHECK(cudaMalloc(&a, a_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&b, int64_t(k) * n * sizeof(bf16)));
  CHECK(cudaMalloc(&d, d_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&ref, d_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&out, block * sizeof(bf16)));
  CHECK(cudaMalloc(&ws, ws_size));
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(a), a_elems, 0x1234u, 1.0f, nullptr);
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(b), int64_t(k) * n, 0x9876u, 1.0f,
                          nullptr);
  cudaStream_t compute, watcher;
  CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&watcher, cudaStreamNonBlocking));

  // Push order: block s at step s (s = 1..tp-1), the own block 0 last and unsignalled.
  uint64_t order = 0;
  for (int s = 1; s < tp; ++s) order |= uint64_t(s) << (4 * (s - 1));
  const uint32_t tiles_per_block = uint32_t(m / 128) * uint32_t((n + 127) / 128);
  // Three sets of flags (block s's at s) and counters, each only ever used by one
  // implementation (a set's flags count its calls): the check, `signal`, and `signal+link`
  // (flags: the link's done words, Done(s) for block s).
  uint64_t* words;             // [4][16] flags, device (the 4th set: `cached`)
  unsigned long long* counts;  // [4][16]
  CHECK(cudaMalloc(&words, 4 * 16 * sizeof(uint64_t)));
  CHECK(cudaMalloc(&counts, 4 * 16 * sizeof(unsigned long long)));
  CHECK(cudaMemset(words, 0, 4 * 16 * sizeof(uint64_t)));
  CHECK(cudaMemset(counts, 0, 4 * 16 * sizeof(unsigned long long)));
  auto signals = [&](int set, uint64_t* flags) {
    sg::Signals s;
    s.flags = flags;
    s.counts = counts + 16 * set;
    s.signalled = ((1u << tp) - 1) & ~1u;  // every block but the own block 0
    s.block_rows = int(m);
    s.tiles_per_block = tiles_per_block;
    return s;
  };
  Problem whole{rows, int(k), int(n), 1, 0, sms};
  Lt lt{whole, b, ws, ws_size};
  lt.Create();
  std::vector<LtSpan> spans = {lt.Plan(0, rows)};
  lt.Run(spans[0], a, ref, compute);

  // The check, twice (the second call finds the counters the first reset): a NaN D; each
  // signalled block copied to the host as soon as its flag rises to the call's number.
  bool pass = true;
  sg::SignalOp checked(rows, int(k), int(n), tp, order, sms, a, b, d, signals(0, words));
  for (uint64_t call = 1; call <= 2; ++call) {
    bf16 *host, *expect;
    CHECK(cudaMallocHost(&host, d_elems * sizeof(bf16)));
    CHECK(cudaMallocHost(&expect, d_elems * sizeof(bf16)));
    CHECK(cudaMemcpy(expect, ref, d_elems * sizeof(bf16), cudaMemcpyDeviceToHost));
    CHECK(cudaMemset(d, 0xff, d_elems * sizeof(bf16)));
    CHECK(cudaDeviceSynchronize());
    checked.Run(compute);
    for (int s = 1; s < tp; ++s) {
      CHECK(driver->wait(watcher, CUdeviceptr(words + s), call, CU_STREAM_WAIT_VALUE_GEQ));
      CHECK(cudaMemcpyAsync(host + s * block, d + s * block, block * sizeof(bf16),
                            cudaMemcpyDeviceToHost, watcher));
    }
    CHECK(cudaStreamSynchronize(compute));  // the own block: after the kernel
    CHECK(cudaMemcpy(host, d, block * sizeof(bf16), cudaMemcpyDeviceToHost));
    // Every signalled flag is up once the kernel has ended; one that is not fails the check,
    // and is raised here so that the watcher's wait ends.
    uint64_t flags[16];
    CHECK(cudaMemcpy(flags, words, sizeof(flags), cudaMemcpyDeviceToHost));
    for (int s = 1; s < tp; ++s)
      if (flags[s] != call)
        CHECK(cudaMemcpy(words + s, &call, sizeof(call), cudaMemcpyHostToDevice));
    CHECK(cudaStreamSynchronize(watcher));
    for (int blk = 0; blk < tp; ++blk) {
      double e = 0, q = 0;
      long long bad = 0;
      for (int64_t i = blk * block; i < (blk + 1) * block; ++i) {
        const float x = float(host[i]), y = float(expect[i]);
        bad += !std::isfinite(x);
        e += double(x - y) * (x - y);
        q += double(y) * y;
      }
      const double rel = std::sqrt(e / std::max(q, 1e-30));
      const bool ok = rel < 1e-2 && bad == 0 && (blk == 0 || flags[blk] == call);
      pass &= ok;
      std::printf("call %llu, block %d (%s): rel_err %.2e, nonfinite %lld, flag %llu: %s\n",
                  (unsigned long long)call, blk,
                  blk ? "copied at its flag" : "own, after the kernel", rel, bad,
                  blk ? (unsigned long long)flags[blk] : 0ull, ok ? "PASS" : "FAIL");
    }
    std::printf("correctness: %s\n", pass ? "PASS" : "FAIL");
    CHECK(cudaFreeHost(host));
    CHECK(cudaFreeHost(expect));
  }

  // Timing.
  CutlassOp<Config<128, 128, 2, true, cutlass::gemm::PersistentScheduler>> stock(whole, a, b, d,
                                                                                 nullptr, nullptr);
  Problem in_order = whole;
  in_order.blocks = tp;
  in_order.order = order;
  CutlassOp<Config<128, 128, 2, true, FlagScheduler>> ordered(in_order, a, b, d, nullptr, nullptr);
  sg::SignalOp alone(rows, int(k), int(n), tp, order, sms, a, b, d, signals(1, words + 16));
  sg::SignalOp cached(rows, int(k), int(n), tp, order, sms, a, b, d, signals(3, words + 48));
  std::vector<Timed> impls;
  impls.push_back({"whole", compute, [&] { lt.Run(spans[0], a, d, compute); }});
  impls.push_back({"stock", compute, [&] { stock.Run(compute); }});
  impls.push_back({"ordered", compute, [&] { ordered.Run(compute); }});
  impls.push_back({"signal", compute, [&] { alone.Run(compute); }});
  impls.push_back({"cached", compute, [&] { cached.RunCached(compute); }});
  impls.push_back({"sum", compute, [&] {
                     jax_ub_tool::Check(
                         jax_ub::LaunchSum(jax_ub::DType::kBF16, d, block, tp, out, compute),
                         "LaunchSum");
                   }});
  std::unique_ptr<solo::HostLink> link;
  std::unique_ptr<sg::SignalOp> linked;
  const double transfer_us = gbps > 0 ? m * n * 2 / gbps * 1e-3 : 0.0;  // bytes / GB/s = ns
  uint64_t epoch = 0;
  if (gbps > 0) {
    link = std::make_unique<solo::HostLink>(tp, transfer_us);
    // The kernel's block s raises the link's Done(s): consecutive words from Done(0).
    linked = std::make_unique<sg::SignalOp>(rows, int(k), int(n), tp, order, sms, a, b, d,
                                            signals(2, reinterpret_cast<uint64_t*>(link->Done(0))));
    impls.push_back(
        {"signal+link", compute, [&] {
           ++epoch;
           linked->Run(compute);
           for (int p = 1; p < tp; ++p)
             CHECK(driver->wait(compute, link->Flag(p), epoch, CU_STREAM_WAIT_VALUE_GEQ));
           jax_ub_tool::Check(jax_ub::LaunchSum(jax_ub::DType::kBF16, d, block, tp, out, compute),
                              "LaunchSum");
         }});
  }
  TimeRounds(impls, 5, seconds);
  const double t_whole = impls[0].Median(), t_sum = impls[5].Median();
  std::printf("tp=%d, a rank's m=%lld k=%lld n=%lld: the GEMM %dx%lldx%lld, %u tiles a block\n", tp,
              m, k, n, rows, k, n, tiles_per_block);
  std::printf("%-12s %9s %8s %10s\n", "impl", "ms", "spread", "/whole");
  for (const Timed& t : impls)
    std::printf("%-12s %9.4f %7.1f%% %10.3f\n", t.name.c_str(), t.Median(), 100.0 * t.Spread(),
                t.Median() / t_whole);
  if (gbps > 0) {
    const double lands = solo::LastLanding(tp, t_whole, transfer_us);
    const double floor = std::max(t_whole, lands) + t_sum;
    std::printf(
        "link %.0f GB/s: a partial %.1f us, the last lands at %.4f ms at the whole GEMM's pace; "
        "floor %.4f ms; signal+link x%.4f of its floor\n",
        gbps, transfer_us, lands, floor, impls.back().Median() / floor);
  }
  lt.Destroy(spans);
  linked.reset();
  link.reset();
  CHECK(cudaStreamDestroy(compute));
  CHECK(cudaStreamDestroy(watcher));
  for (void* p :
       {(void*)a, (void*)b, (void*)d, (void*)ref, (void*)out, ws, (void*)words, (void*)counts})
    CHECK(cudaFree(p));
  return pass ? 0 : 1;
}
