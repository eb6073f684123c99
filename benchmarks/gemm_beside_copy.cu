// Does a peer copy that runs beside a GEMM, neither waiting on the other, slow the GEMM?
//
// On GPUs 0 and 1 at once, each runs the same bf16 GEMM back to back for `seconds`:
// first alone, then with, for every GEMM, a copy of `copy_mib` MiB pushed by the other GPU
// into this one (cudaMemcpyAsync on the sender's copy stream, peer access, copy engines:
// what jax_ub's all-gather does). Prints ms per GEMM in each phase and the copies' rate.
// If the GEMM slows by what jax_ub's overlapped op costs over GEMM alone, that cost is
// the hardware's price of moving the data at the power cap, not the protocol's.
// Not part of the library.
//
// The GEMM is jax_ub's own CublasLtGemm (same autotuned plan as the ops), so the time is
// the chunk GEMM jax_ub runs.
//
// Usage: gemm_beside_copy m,k,n copy_mib [seconds]
// (tp=2 AG at M=32768, K=8192, N=32768: 16384,8192,16384 with 128 MiB per GEMM.)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cuda_gemm.h"
#include "cuda_tool.h"

namespace {

using jax_ub_tool::Check;
using jax_ub_tool::FillRandom;

void Check(const jax_ub::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    std::exit(1);
  }
}

// One GPU's GEMM c[m, n] = a[m, k] @ b[k, n] (row-major) and its send / receive buffers.
struct Gpu {
  int device = 0;
  jax_ub::CublasLtGemm* gemm = nullptr;
  const jax_ub::CublasLtGemm::Plan* plan = nullptr;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  char *send = nullptr, *recv = nullptr;
  cudaStream_t compute = nullptr, copy = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr, copies_done = nullptr;
};

void Setup(Gpu& g, int device, long long m, long long k, long long n, size_t copy_bytes) {
  g.device = device;
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaMalloc(&g.a, m * k * 2), "a");
  Check(cudaMalloc(&g.b, k * n * 2), "b");
  Check(cudaMalloc(&g.c, m * n * 2), "c");
  Check(cudaMalloc(&g.send, copy_bytes), "send");
  Check(cudaMalloc(&g.recv, copy_bytes), "recv");
  Check(cudaStreamCreateWithFlags(&g.compute, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking), "stream");
  Check(cudaEventCreate(&g.begin), "event");
  Check(cudaEventCreate(&g.end), "event");
  Check(cudaEventCreate(&g.copies_done), "event");
  FillRandom(g.a, m * k, 1 + device, 1.0f, g.compute);
  FillRandom(g.b, k * n, 7 + device, 0.01f, g.compute);
  FillRandom(reinterpret_cast<__nv_bfloat16*>(g.send), copy_bytes / 2, 13 + device, 1.0f,
             g.compute);
  Check(cudaStreamSynchronize(g.compute), "fill");
  Check(jax_ub::CublasLtGemm::Create(jax_ub::GemmOptions{}, &g.gemm), "CublasLtGemm::Create");
  Check(g.gemm->Prepare(jax_ub::DType::kBF16, g.a, k, g.b, n, false, g.c, n, m, k, n, g.compute,
                        &g.plan),
        "CublasLtGemm::Prepare");
}

void Teardown(Gpu& g) {
  Check(cudaSetDevice(g.device), "cudaSetDevice");
  delete g.gemm;
  cudaEventDestroy(g.begin);
  cudaEventDestroy(g.end);
  cudaEventDestroy(g.copies_done);
  cudaStreamDestroy(g.compute);
  cudaStreamDestroy(g.copy);
  for (void* p : {static_cast<void*>(g.a), static_cast<void*>(g.b), static_cast<void*>(g.c),
                  static_cast<void*>(g.send), static_cast<void*>(g.recv)})
    cudaFree(p);
}

void Gemm(Gpu& g) { Check(g.gemm->Matmul(g.plan, g.a, g.b, g.c, g.compute), "Matmul"); }

// `iters` GEMMs on both GPUs at once, each GPU pushing `copy_bytes` into the other per
// GEMM when `copies`; returns ms per GEMM, averaged over the two GPUs, and the rate at
// which the pushes actually completed (from the first GEMM's start to the last copy).
double Phase(Gpu* gpus, int iters, bool copies, size_t copy_bytes, double* copy_gbps) {
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(gpus[i].device), "cudaSetDevice");
    Check(cudaDeviceSynchronize(), "sync");
    Check(cudaEventRecord(gpus[i].begin, gpus[i].compute), "record");
    // Copies start with the GEMMs, not before them.
    Check(cudaStreamWaitEvent(gpus[i].copy, gpus[i].begin), "wait");
  }
  for (int it = 0; it < iters; ++it) {
    for (int i = 0; i < 2; ++i) {
      Gpu& g = gpus[i];
      Check(cudaSetDevice(g.device), "cudaSetDevice");
      Gemm(g);
      if (copies)
        Check(
            cudaMemcpyAsync(gpus[1 - i].recv, g.send, copy_bytes, cudaMemcpyDeviceToDevice, g.copy),
            "push");
    }
  }
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(gpus[i].device), "cudaSetDevice");
    Check(cudaEventRecord(gpus[i].end, gpus[i].compute), "record");
    Check(cudaEventRecord(gpus[i].copies_done, gpus[i].copy), "record");
  }
  double gemm_ms = 0, copy_ms = 0;
  for (int i = 0; i < 2; ++i) {
    Check(cudaSetDevice(gpus[i].device), "cudaSetDevice");
    Check(cudaEventSynchronize(gpus[i].end), "sync");
    Check(cudaEventSynchronize(gpus[i].copies_done), "sync");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, gpus[i].begin, gpus[i].end), "elapsed");
    gemm_ms += ms / 2;
    Check(cudaEventElapsedTime(&ms, gpus[i].begin, gpus[i].copies_done), "elapsed");
    copy_ms += ms / 2;
  }
  if (copy_gbps != nullptr)
    *copy_gbps = copies ? double(copy_bytes) * iters / (copy_ms * 1e-3) / 1e9 : 0;
  return gemm_ms / iters;
}

}  // namespace

int main(int argc, char** argv) {
  long long m, k, n;
  if (argc < 3 || std::sscanf(argv[1], "%lld,%lld,%lld", &m, &k, &n) != 3) {
    std::fprintf(stderr, "usage: %s m,k,n copy_mib [seconds]\n", argv[0]);
    return 2;
  }
  const size_t copy_bytes = size_t(std::atof(argv[2]) * (1 << 20));
  const double seconds = argc > 3 ? std::atof(argv[3]) : 3.0;
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
  for (int i = 0; i < 2; ++i) Setup(gpus[i], i, m, k, n, copy_bytes);
  const double estimate = Phase(gpus, 3, false, copy_bytes, nullptr);
  const int iters = std::max(3, int(seconds * 1e3 / estimate));
  std::printf("GEMM m=%lld k=%lld n=%lld, %.0f MiB pushed each way per GEMM, %d GEMMs a phase\n", m,
              k, n, copy_bytes / double(1 << 20), iters);
  for (int round = 0; round < 2; ++round) {
    double gbps = 0;
    const double alone = Phase(gpus, iters, false, copy_bytes, nullptr);
    const double beside = Phase(gpus, iters, true, copy_bytes, &gbps);
    std::printf(
        "round %d: GEMM alone %.4f ms, beside copies %.4f ms (x%.4f); copies %.0f GB/s "
        "each way\n",
        round, alone, beside, beside / alone, gbps);
  }
  for (Gpu& g : gpus) Teardown(g);
  return 0;
}
