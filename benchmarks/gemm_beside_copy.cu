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
// Usage: gemm_beside_copy m,k,n copy_mib [seconds]
// (tp=2 AG at M=32768, K=8192, N=32768: 16384,8192,16384 with 128 MiB per GEMM.)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void Check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, cublasLtGetStatusName(s));
    std::exit(1);
  }
}

__global__ void FillRandom(__nv_bfloat16* p, int64_t count, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffff) / 32768.0f - 1.0f) * scale);
  }
}

// One GPU's GEMM (row-major c[m, n] = a[m, k] @ b[k, n], described column-major as jax_ub
// does by default) and its send / receive buffers.
struct Gpu {
  int device = 0;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo;
  void* workspace = nullptr;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  char *send = nullptr, *recv = nullptr;
  cudaStream_t compute = nullptr, copy = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr, copies_done = nullptr;
};

constexpr size_t kWorkspace = 32u << 20;

void Setup(Gpu& g, int device, long long m, long long k, long long n, size_t copy_bytes) {
  g.device = device;
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cublasLtCreate(&g.handle), "cublasLtCreate");
  Check(cudaMalloc(&g.workspace, kWorkspace), "workspace");
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
  FillRandom<<<1024, 256, 0, g.compute>>>(g.a, m * k, 1 + device, 1.0f);
  FillRandom<<<1024, 256, 0, g.compute>>>(g.b, k * n, 7 + device, 0.01f);
  FillRandom<<<1024, 256, 0, g.compute>>>(reinterpret_cast<__nv_bfloat16*>(g.send), copy_bytes / 2,
                                          13 + device, 1.0f);
  Check(cudaGetLastError(), "fill");
  Check(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  Check(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, n, k, n), "layout");  // B^T
  Check(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, k, m, k), "layout");  // A^T
  Check(cublasLtMatrixLayoutCreate(&g.lc, CUDA_R_16BF, n, m, n), "layout");  // C^T
  cublasLtMatmulPreference_t pref;
  Check(cublasLtMatmulPreferenceCreate(&pref), "pref");
  size_t ws = kWorkspace;
  Check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)),
        "pref ws");
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  Check(cublasLtMatmulAlgoGetHeuristic(g.handle, g.desc, g.la, g.lb, g.lc, g.lc, pref, 1, &result,
                                       &found),
        "heuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) {
    std::fprintf(stderr, "no cuBLASLt algorithm\n");
    std::exit(1);
  }
  g.algo = result.algo;
}

void Teardown(Gpu& g) {
  Check(cudaSetDevice(g.device), "cudaSetDevice");
  cudaEventDestroy(g.begin);
  cudaEventDestroy(g.end);
  cudaEventDestroy(g.copies_done);
  cudaStreamDestroy(g.compute);
  cudaStreamDestroy(g.copy);
  for (void* p : {static_cast<void*>(g.a), static_cast<void*>(g.b), static_cast<void*>(g.c),
                  static_cast<void*>(g.send), static_cast<void*>(g.recv), g.workspace})
    cudaFree(p);
  cublasLtMatrixLayoutDestroy(g.la);
  cublasLtMatrixLayoutDestroy(g.lb);
  cublasLtMatrixLayoutDestroy(g.lc);
  cublasLtMatmulDescDestroy(g.desc);
  cublasLtDestroy(g.handle);
}

void Gemm(Gpu& g) {
  const float alpha = 1.0f, beta = 0.0f;
  Check(cublasLtMatmul(g.handle, g.desc, &alpha, g.b, g.la, g.a, g.lb, &beta, g.c, g.lc, g.c, g.lc,
                       &g.algo, g.workspace, kWorkspace, g.compute),
        "matmul");
}

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
