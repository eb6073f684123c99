// Where tp=2's overlapped ops spend their time over GEMM alone, using jax_ub's own GEMM
// (CublasLtGemm, the autotuned plans the ops run) and its data movement (peer access,
// copy engines), without the rest of the protocol (flags, descriptors, XLA).
//
// On GPUs 0 and 1 at once, each phase runs back to back for `seconds` (long enough to
// reach the power-capped clock a training loop sees), phases interleaved, 3 rounds:
//   gemm      one GEMM c[2m, n] = a[2m, k] @ b[k, n]: "GEMM alone"
//   halves    the same as two GEMMs of m rows each: the overlapped ops' chunking
//   ag        halves, while a[0:m] is pushed into the peer's a[m:2m]; the second GEMM waits
//             for the peer's push: all_gather_matmul's schedule at tp=2
//   rs        halves; c[0:m] (the peer's partial) is pushed into the peer's c[2m:3m]
//             while the second GEMM runs, then the library's sum of c[m:2m] and the
//             received partial -> out: matmul_reduce_scatter's schedule at tp=2
//   rs_nosum  rs without the final sum pass
//   quarters  the GEMM as four GEMMs of m/2 rows: the folded schedule's chunking
//   rs_fold   matmul_reduce_scatter's folded schedule at tp=2 (Schedule::ReduceScatterFolds):
//             the peer's partial in two pieces of m/2 rows, each pushed while the next GEMM
//             runs, then our own two pieces, each adding the peer's piece that landed for
//             it in the GEMM's epilogue, straight into out; no sum pass
// A push waits until the peer has finished its previous iteration (jax_ub's credit).
// Prints ms per iteration (median of rounds) and its ratio to "gemm". Not part of the
// library.
//
// Usage: overlap_cost m,k,n [seconds]   (m: rows of one rank's chunk)
// tp=2 at M=32768, K=8192, N=32768: AG 16384,8192,16384; RS 16384,16384,8192.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/sum.h"
#include "cuda_tool.h"

namespace {

using jax_ub_tool::Check;
using jax_ub_tool::FillRandom;

enum Phase { kGemm, kHalves, kAg, kRs, kRsNoSum, kQuarters, kRsFold, kPhases };
const char* const kNames[kPhases] = {"gemm",     "halves",   "ag",     "rs",
                                     "rs_nosum", "quarters", "rs_fold"};

// One GPU: a[2m, k], b[k, n], c[3m, n] (rows 2m.. receive the peer's partial, next to
// the second half's, as the library's sum reads them), out[m, n].
struct Gpu {
  int device = 0;
  jax_ub::CublasLtGemm* gemm = nullptr;
  jax_ub::CublasLtGemm::Plan *full = nullptr, *half = nullptr, *quarter = nullptr;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr, *out = nullptr;
  cudaStream_t compute = nullptr, copy = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;  // timing
  cudaEvent_t start = nullptr, half_done = nullptr, pushed = nullptr, done = nullptr;
  cudaEvent_t pushed_first = nullptr;  // rs_fold: the first piece has landed in the peer
};

struct Shape {
  long long m, k, n;
};

void Setup(Gpu& g, int device, Shape s) {
  g.device = device;
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaMalloc(&g.a, 2 * s.m * s.k * 2), "a");
  Check(cudaMalloc(&g.b, s.k * s.n * 2), "b");
  Check(cudaMalloc(&g.c, 3 * s.m * s.n * 2), "c");
  Check(cudaMalloc(&g.out, s.m * s.n * 2), "out");
  Check(cudaStreamCreateWithFlags(&g.compute, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking), "stream");
  for (cudaEvent_t* e : {&g.begin, &g.end}) Check(cudaEventCreate(e), "event");
  for (cudaEvent_t* e : {&g.start, &g.half_done, &g.pushed, &g.done, &g.pushed_first})
    Check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event");
  FillRandom(g.a, 2 * s.m * s.k, 1 + device, 1.0f, g.compute);
  FillRandom(g.b, s.k * s.n, 7 + device, 0.01f, g.compute);
  Check(cudaStreamSynchronize(g.compute), "fill");
  // The tuned pick throughout: in-op trials would change kernels between phases.
  jax_ub::GemmOptions options;
  options.trials = 0;
  Check(jax_ub::CublasLtGemm::Create(options, &g.gemm), "CublasLtGemm::Create");
  Check(g.gemm->Prepare(jax_ub::DType::kBF16, g.a, g.b, false, g.c, 2 * s.m, s.k, s.n, nullptr,
                        g.compute, &g.full),
        "Prepare (full)");
  Check(g.gemm->Prepare(jax_ub::DType::kBF16, g.a, g.b, false, g.c, s.m, s.k, s.n, nullptr,
                        g.compute, &g.half),
        "Prepare (half)");
  // With an addend, as rs_fold runs it: out plus the received partial's first piece.
  Check(g.gemm->Prepare(jax_ub::DType::kBF16, g.a, g.b, false, g.out, s.m / 2, s.k, s.n,
                        g.c + 2 * s.m * s.n, g.compute, &g.quarter),
        "Prepare (quarter)");
}

void Teardown(Gpu& g) {
  Check(cudaSetDevice(g.device), "cudaSetDevice");
  delete g.gemm;
  for (cudaEvent_t e : {g.begin, g.end, g.start, g.half_done, g.pushed, g.done, g.pushed_first})
    cudaEventDestroy(e);
  cudaStreamDestroy(g.compute);
  cudaStreamDestroy(g.copy);
  for (void* p : {static_cast<void*>(g.a), static_cast<void*>(g.b), static_cast<void*>(g.c),
                  static_cast<void*>(g.out)})
    cudaFree(p);
}

// Enqueues one iteration of `phase` on both GPUs.
void Iteration(Gpu* gpus, Phase phase, Shape s) {
  const size_t a_half = size_t(s.m) * s.k, c_half = size_t(s.m) * s.n;
  auto gemm = [&](Gpu& g, jax_ub::CublasLtGemm::Plan* plan, size_t row0) {
    Check(g.gemm->Matmul(plan, g.a + row0 * s.k, g.b, g.c + row0 * s.n, g.compute), "Matmul");
  };
  // Pushes `bytes` from this GPU's `src` into the peer's `dst` once `after` (an event of
  // this GPU) and the peer's previous iteration are done.
  auto push = [&](Gpu& g, Gpu& peer, cudaEvent_t after, const void* src, void* dst, size_t bytes) {
    Check(cudaStreamWaitEvent(g.copy, after), "wait");
    Check(cudaStreamWaitEvent(g.copy, peer.done), "wait");
    Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.copy), "push");
    Check(cudaEventRecord(g.pushed, g.copy), "record");
  };
  for (int i = 0; i < 2; ++i) {
    Gpu& g = gpus[i];
    Gpu& peer = gpus[1 - i];
    Check(cudaSetDevice(g.device), "cudaSetDevice");
    switch (phase) {
      case kGemm:
        gemm(g, g.full, 0);
        break;
      case kHalves:
        gemm(g, g.half, 0);
        gemm(g, g.half, s.m);
        break;
      case kQuarters:
        for (int q = 0; q < 4; ++q) gemm(g, g.quarter, q * s.m / 2);
        break;
      case kRsFold:  // the peer's partial in two pieces, each pushed once computed
        for (int q = 0; q < 2; ++q) {
          gemm(g, g.quarter, q * s.m / 2);
          Check(cudaEventRecord(g.half_done, g.compute), "record");
          push(g, peer, g.half_done, g.c + q * c_half / 2, peer.c + 2 * c_half + q * c_half / 2,
               c_half);
          if (q == 0) Check(cudaEventRecord(g.pushed_first, g.copy), "record");
        }
        break;
      case kAg:
        Check(cudaEventRecord(g.start, g.compute), "record");
        push(g, peer, g.start, g.a, peer.a + a_half, a_half * 2);
        gemm(g, g.half, 0);
        break;
      default:  // kRs, kRsNoSum
        gemm(g, g.half, 0);
        Check(cudaEventRecord(g.half_done, g.compute), "record");
        push(g, peer, g.half_done, g.c, peer.c + 2 * c_half, c_half * 2);
        gemm(g, g.half, s.m);
        break;
    }
  }
  if (phase == kGemm || phase == kHalves || phase == kQuarters) return;
  // Second halves: after the peer's push has landed (both pushes are enqueued by now).
  for (int i = 0; i < 2; ++i) {
    Gpu& g = gpus[i];
    Check(cudaSetDevice(g.device), "cudaSetDevice");
    if (phase != kRsFold) Check(cudaStreamWaitEvent(g.compute, gpus[1 - i].pushed), "wait");
    if (phase == kAg) gemm(g, g.half, s.m);
    if (phase == kRsFold) {  // our own pieces, each adding the peer's piece for it
      for (int q = 0; q < 2; ++q) {
        Check(
            cudaStreamWaitEvent(g.compute, q == 0 ? gpus[1 - i].pushed_first : gpus[1 - i].pushed),
            "wait");
        jax_ub::GemmArgs args;
        args.addend = g.c + 2 * c_half + q * c_half / 2;
        Check(g.gemm->Matmul(g.quarter, g.a + (s.m + q * s.m / 2) * s.k, g.b,
                             g.out + q * c_half / 2, g.compute, args),
              "Matmul (addend)");
      }
    }
    if (phase == kRs) {
      Check(jax_ub::LaunchSum(jax_ub::DType::kBF16, g.c + c_half, c_half, 2, g.out, g.compute),
            "LaunchSum");
    }
    Check(cudaEventRecord(g.done, g.compute), "record");
  }
}

// ms per iteration of `phase`, `iters` of them, averaged over the two GPUs.
double Time(Gpu* gpus, Phase phase, Shape s, int iters) {
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(gpus[i].device), "cudaSetDevice");
    Check(cudaDeviceSynchronize(), "sync");
    Check(cudaEventRecord(gpus[i].begin, gpus[i].compute), "record");
    Check(cudaEventRecord(gpus[i].done, gpus[i].compute), "record");
  }
  for (int it = 0; it < iters; ++it) Iteration(gpus, phase, s);
  double ms_sum = 0;
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(gpus[i].device), "cudaSetDevice");
    Check(cudaEventRecord(gpus[i].end, gpus[i].compute), "record");
    Check(cudaEventSynchronize(gpus[i].end), "sync");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, gpus[i].begin, gpus[i].end), "elapsed");
    ms_sum += ms;
  }
  return ms_sum / 2 / iters;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  if (argc < 2 || std::sscanf(argv[1], "%lld,%lld,%lld", &s.m, &s.k, &s.n) != 3) {
    std::fprintf(stderr, "usage: %s m,k,n [seconds]\n", argv[0]);
    return 2;
  }
  const double seconds = argc > 2 ? std::atof(argv[2]) : 2.0;
  if (s.m % 2 != 0) {
    std::fprintf(stderr, "m must be even (rs_fold splits it in two pieces), got %lld\n", s.m);
    return 2;
  }
  int count = 0;
  Check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count < 2) {
    std::fprintf(stderr, "needs 2 GPUs, found %d\n", count);
    return 2;
  }
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(i), "cudaSetDevice");
    cudaError_t e = cudaDeviceEnablePeerAccess(1 - i, 0);
    if (e != cudaErrorPeerAccessAlreadyEnabled) Check(e, "cudaDeviceEnablePeerAccess");
    cudaGetLastError();  // clears an "already enabled"
  }
  Gpu gpus[2];
  for (int i = 0; i < 2; ++i) Setup(gpus[i], i, s);
  const int iters = std::max(3, int(seconds * 1e3 / Time(gpus, kGemm, s, 3)));
  std::printf("chunk m=%lld k=%lld n=%lld (GEMM %lldx%lldx%lld), %d iterations a phase\n", s.m, s.k,
              s.n, 2 * s.m, s.k, s.n, iters);
  std::vector<double> ms[kPhases];
  for (int round = 0; round < 3; ++round) {
    std::printf("round %d:", round);
    for (int p = 0; p < kPhases; ++p) {
      ms[p].push_back(Time(gpus, Phase(p), s, iters));
      std::printf(" %s %.4f", kNames[p], ms[p].back());
    }
    std::printf("\n");
  }
  double gemm_ms = 0;
  for (int p = 0; p < kPhases; ++p) {
    std::sort(ms[p].begin(), ms[p].end());
    const double med = ms[p][1];
    if (p == kGemm) gemm_ms = med;
    std::printf("%-9s %.4f ms  x%.4f  (rounds %.4f..%.4f)\n", kNames[p], med, med / gemm_ms,
                ms[p].front(), ms[p].back());
  }
  for (Gpu& g : gpus) Teardown(g);
  return 0;
}
