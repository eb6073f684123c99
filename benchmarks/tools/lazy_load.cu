// Whether a kernel's first launch (CUDA's lazy loading: a module loaded at its first use)
// waits for work already queued on the device that cannot finish yet, and what that does to
// another thread's CUDA calls (jax_ub's watchdog releases a stuck wait with a copy).
//
//   lazy_load local      first launches while another stream is parked on a flag (a stream
//                        wait or a spinning kernel), each timed, with another thread's event
//                        query and copy meanwhile; a host thread releases the parked stream
//                        after 2 s, so nothing here can hang
//   lazy_load deadlock   the parked stream waits on a flag in device memory that only another
//                        thread's copy releases, as the watchdog does, while this thread loads
//                        a module; each step's time is printed as it returns: a run that ends
//                        in its caller's time limit stopped where its last line says
//   lazy_load latency    a flag's round trip between two streams (a write, then a wait for the
//                        other's write), the flags in device memory and in host-mapped memory
#include <chrono>
#include <cuda/std/atomic>
#include <string>
#include <thread>
#include <utility>

#include "cuda/driver_api.h"
#include "cuda_tool.h"

namespace {

using jax_ub_tool::Check;

__global__ void FreshAdd(float* x) { x[threadIdx.x] += 1.f; }
__global__ void FreshScale(float* x) { x[threadIdx.x] *= 2.f; }
__global__ void SpinOn(const uint64_t* word) {
  while (cuda::std::atomic_ref<const uint64_t>(*word).load(cuda::std::memory_order_acquire) == 0) {
    __nanosleep(1000);
  }
}

double Now() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A host-mapped word a stream can wait on, released by a host thread `after` seconds from now.
struct Parked {
  uint64_t* host = nullptr;
  uint64_t* dev = nullptr;
  std::thread releaser;
  double release_at = 0;

  explicit Parked(double after) {
    Check(cudaHostAlloc(&host, sizeof(uint64_t), cudaHostAllocMapped), "cudaHostAlloc");
    Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), "device pointer");
    __atomic_store_n(host, 0, __ATOMIC_SEQ_CST);
    release_at = Now() + after;
    releaser = std::thread([this] {
      std::this_thread::sleep_until(std::chrono::steady_clock::now() +
                                    std::chrono::duration<double>(release_at - Now()));
      __atomic_store_n(host, 1, __ATOMIC_SEQ_CST);
    });
  }
  ~Parked() {
    releaser.join();
    Check(cudaDeviceSynchronize(), "synchronize after release");
    Check(cudaFreeHost(host), "cudaFreeHost");
  }
};

void ParkWithWait(const Parked& p, cudaStream_t s) {
  const jax_ub::DriverOps* ops = nullptr;
  if (!jax_ub::LoadDriverOps(&ops).ok()) {
    std::fprintf(stderr, "no stream memory operations\n");
    std::exit(1);
  }
  Check(ops->wait(s, reinterpret_cast<CUdeviceptr>(p.dev), 1, CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue64");
}

// The calls another thread makes meanwhile, as the watchdog does: an event query, then a
// one-word copy from pinned memory on a stream of its own, polled until done.
struct OtherThread {
  uint64_t* pinned = nullptr;
  uint64_t* word = nullptr;
  cudaStream_t stream = nullptr;
  OtherThread() {
    Check(cudaHostAlloc(&pinned, sizeof(uint64_t), cudaHostAllocDefault), "cudaHostAlloc");
    Check(cudaMalloc(&word, sizeof(uint64_t)), "cudaMalloc");
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  }
  ~OtherThread() {
    cudaFreeHost(pinned), cudaFree(word);
    cudaStreamDestroy(stream);
  }
  // Seconds the query took, and the copy (its call and its polling).
  std::pair<double, double> Run(cudaEvent_t parked) {
    double t = Now();
    cudaError_t e = cudaEventQuery(parked);
    if (e != cudaErrorNotReady && e != cudaSuccess) Check(e, "cudaEventQuery");
    const double query_s = Now() - t;
    t = Now();
    Check(cudaMemcpyAsync(word, pinned, sizeof(uint64_t), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync");
    while ((e = cudaStreamQuery(stream)) == cudaErrorNotReady) std::this_thread::yield();
    Check(e, "cudaStreamQuery");
    return {query_s, Now() - t};
  }
};

// Times `launch` (a first launch) and, meanwhile, another thread's calls (OtherThread).
template <typename F>
void Timed(const char* what, const Parked& p, cudaEvent_t parked, F launch) {
  OtherThread other;
  std::pair<double, double> other_s{-1, -1};
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    other_s = other.Run(parked);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double t = Now();
  launch();
  const double took = Now() - t;
  watchdog.join();
  std::printf(
      "%-44s returned in %6.3f s (the parked work released %5.3f s after it began); "
      "another thread's event query meanwhile %6.3f s, its copy %6.3f s\n",
      what, took, p.release_at - t, other_s.first, other_s.second);
  std::fflush(stdout);
}

struct Gemm {
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulHeuristicResult_t pick;
  void* work;
  __nv_bfloat16 *x, *y, *z;
  int m, k, n;
  static constexpr size_t kWork = 32 << 20;

  Gemm(int m_, int k_, int n_) : m(m_), k(k_), n(n_) {
    Check(cublasLtCreate(&lt), "cublasLtCreate");
    Check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    Check(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, m, k), "a");
    Check(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, n, k, n), "b");
    Check(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, n, m, n), "c");
    cublasLtMatmulPreference_t pref;
    Check(cublasLtMatmulPreferenceCreate(&pref), "pref");
    Check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &kWork, sizeof(kWork)),
          "pref workspace");
    int found = 0;
    // Row-major C = A B as column-major C^T = B^T A^T.
    Check(cublasLtMatmulAlgoGetHeuristic(lt, op, b, a, c, c, pref, 1, &pick, &found), "heuristic");
    if (found == 0) std::exit(1);
    cublasLtMatmulPreferenceDestroy(pref);
    Check(cudaMalloc(&work, kWork), "workspace");
    Check(cudaMalloc(&x, sizeof(*x) * m * k), "x");
    Check(cudaMalloc(&y, sizeof(*y) * k * n), "y");
    Check(cudaMalloc(&z, sizeof(*z) * m * n), "z");
    Check(cudaMemset(x, 0, sizeof(*x) * m * k), "x");
    Check(cudaMemset(y, 0, sizeof(*y) * k * n), "y");
  }
  void Run(cudaStream_t s) {
    const float one = 1, zero = 0;
    Check(cublasLtMatmul(lt, op, &one, y, b, x, a, &zero, z, c, z, c, &pick.algo, work, kWork, s),
          "cublasLtMatmul");
  }
  ~Gemm() {
    cudaFree(work), cudaFree(x), cudaFree(y), cudaFree(z);
    cublasLtMatrixLayoutDestroy(a), cublasLtMatrixLayoutDestroy(b), cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(lt);
  }
};

void PrintMode() {
  CUmoduleLoadingMode mode;
  // Through the runtime's entry point: this tool links no libcuda.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  Check(
      cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &q),
      "entry point");
  Check(reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(fn)(&mode), "cuModuleGetLoadingMode");
  std::printf("module loading: %s (CUDA_MODULE_LOADING=%s)\n",
              mode == CU_MODULE_LAZY_LOADING ? "lazy" : "eager",
              std::getenv("CUDA_MODULE_LOADING") ? std::getenv("CUDA_MODULE_LOADING") : "unset");
}

void Local() {
  cudaStream_t parked_stream, other;
  Check(cudaStreamCreateWithFlags(&parked_stream, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "stream");
  float* buf;
  Check(cudaMalloc(&buf, 64 * sizeof(float)), "buf");
  cudaEvent_t ev;
  Check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event");
  Gemm gemm(512, 384, 640);  // created (handle, heuristic) before anything is parked
  {
    Parked p(2.0);
    ParkWithWait(p, parked_stream);
    Check(cudaEventRecord(ev, parked_stream), "record");
    Timed("first launch of a kernel, a stream waiting", p, ev,
          [&] { FreshAdd<<<1, 32, 0, other>>>(buf); });
  }
  {
    Parked p(2.0);
    SpinOn<<<1, 1, 0, parked_stream>>>(p.dev);
    Check(cudaEventRecord(ev, parked_stream), "record");
    Timed("first launch of a kernel, a kernel spinning", p, ev,
          [&] { FreshScale<<<1, 32, 0, other>>>(buf); });
  }
  {
    Parked p(2.0);
    ParkWithWait(p, parked_stream);
    Check(cudaEventRecord(ev, parked_stream), "record");
    Timed("first cuBLASLt GEMM, a stream waiting", p, ev, [&] { gemm.Run(other); });
  }
  {
    Parked p(2.0);
    ParkWithWait(p, parked_stream);
    Check(cudaEventRecord(ev, parked_stream), "record");
    Timed("a kernel launched before, a stream waiting", p, ev,
          [&] { FreshAdd<<<1, 32, 0, other>>>(buf); });
  }
  Check(cudaGetLastError(), "launches");
  cudaEventDestroy(ev);
  cudaFree(buf);
  cudaStreamDestroy(parked_stream);
  cudaStreamDestroy(other);
}

// Loads a module of its own (cuModuleLoadData, as XLA loads a program) while a stream waits on
// a flag in device memory that only another thread's copy releases, 0.5 s after the load
// begins. Each step says when it returns: where the lines stop, the run is stuck.
void Deadlock() {
  cudaStream_t parked;
  Check(cudaStreamCreateWithFlags(&parked, cudaStreamNonBlocking), "stream");
  uint64_t* flag;
  Check(cudaMalloc(&flag, sizeof(uint64_t)), "cudaMalloc");
  Check(cudaMemset(flag, 0, sizeof(uint64_t)), "cudaMemset");
  OtherThread other;
  *other.pinned = 1;
  Check(cudaDeviceSynchronize(), "synchronize");
  const jax_ub::DriverOps* ops = nullptr;
  if (!jax_ub::LoadDriverOps(&ops).ok()) std::exit(1);
  Check(ops->wait(parked, reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue64");
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    std::printf("%6.3f s: the other thread copies the release\n", Now());
    std::fflush(stdout);
    Check(
        cudaMemcpyAsync(flag, other.pinned, sizeof(uint64_t), cudaMemcpyHostToDevice, other.stream),
        "cudaMemcpyAsync");
    std::printf("%6.3f s: its copy is enqueued\n", Now());
    std::fflush(stdout);
  });
  static const char kPtx[] =
      ".version 7.8\n.target sm_90\n.address_size 64\n"
      ".visible .entry lazy_probe_nop() { ret; }\n";
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  Check(cudaGetDriverEntryPointByVersion("cuModuleLoadData", &fn, 12000, cudaEnableDefault, &q),
        "entry point");
  CUmodule module;
  std::printf("%6.3f s: this thread loads a module\n", Now());
  std::fflush(stdout);
  Check(reinterpret_cast<CUresult (*)(CUmodule*, const void*)>(fn)(&module, kPtx),
        "cuModuleLoadData");
  std::printf("%6.3f s: the module is loaded\n", Now());
  std::fflush(stdout);
  releaser.join();
  Check(cudaStreamSynchronize(parked), "parked stream");
  std::printf("%6.3f s: the parked stream is released: no deadlock\n", Now());
  cudaFree(flag);
  cudaStreamDestroy(parked);
}

// A flag's round trip between two streams: a writes i to its flag and waits for b's to reach
// i; b waits for a's, then writes its own; `rounds` times, enqueued at once, timed by events.
double RoundTripUs(uint64_t* flags, int rounds) {
  const jax_ub::DriverOps* ops = nullptr;
  if (!jax_ub::LoadDriverOps(&ops).ok()) std::exit(1);
  cudaStream_t a, b;
  Check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "stream");
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  const auto at = [&](int i) { return reinterpret_cast<CUdeviceptr>(flags + i); };
  Check(cudaEventRecord(begin, a), "record");
  for (int i = 1; i <= rounds; ++i) {
    Check(ops->write(a, at(0), i, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
    Check(ops->wait(b, at(0), i, CU_STREAM_WAIT_VALUE_GEQ), "wait");
    Check(ops->write(b, at(1), i, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
    Check(ops->wait(a, at(1), i, CU_STREAM_WAIT_VALUE_GEQ), "wait");
  }
  Check(cudaEventRecord(end, a), "record");
  Check(cudaEventSynchronize(end), "synchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, begin, end), "elapsed");
  cudaEventDestroy(begin), cudaEventDestroy(end);
  cudaStreamDestroy(a), cudaStreamDestroy(b);
  return 1e3 * ms / rounds;
}

void Latency() {
  constexpr int kRounds = 20000;
  uint64_t* dev;
  Check(cudaMalloc(&dev, 2 * sizeof(uint64_t)), "cudaMalloc");
  uint64_t* host;
  Check(cudaHostAlloc(&host, 2 * sizeof(uint64_t), cudaHostAllocMapped), "cudaHostAlloc");
  uint64_t* host_dev;
  Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0), "pointer");
  for (int rep = 0; rep < 3; ++rep) {  // interleaved: the device's clocks move between rounds
    Check(cudaMemset(dev, 0, 2 * sizeof(uint64_t)), "cudaMemset");
    host[0] = host[1] = 0;
    const double d = RoundTripUs(dev, kRounds);
    const double h = RoundTripUs(host_dev, kRounds);
    std::printf("round trip of a flag, %d rounds: device memory %.2f us, host-mapped %.2f us\n",
                kRounds, d, h);
  }
  cudaFree(dev);
  cudaFreeHost(host);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "local";
  Check(cudaSetDevice(0), "cudaSetDevice");
  Check(cudaFree(nullptr), "context");
  PrintMode();
  if (mode == "local") {
    Local();
  } else if (mode == "deadlock") {
    Deadlock();
  } else if (mode == "latency") {
    Latency();
  } else {
    std::fprintf(stderr, "usage: lazy_load local | deadlock | latency\n");
    return 2;
  }
  return 0;
}
