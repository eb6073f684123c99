// Does a copy within one GPU hold back a kernel of another stream? Step profiles of the
// Llama model showed jax_ub's GEMMs starting only as XLA's saved-activation copies (on
// streams of their own) ended. Four experiments, each the median of 7 repeats:
//  1. A 256 MiB copy on stream C, then a kernel on stream S launched after it (one CTA, or
//     one per SM with 200 KB of shared memory as a GEMM, alone or in clusters of 2): when
//     S's kernel starts, for a cudaMemcpyAsync, a cudaMemcpyBatchAsync asking to overlap
//     compute, and an SM copy.
//  2. K1 (100 us, one CTA per SM, clusters of 2) on S, then the copy on C, then K2 on S,
//     for S sharing C's hardware queue or not (streams are dealt round-robin onto
//     CUDA_DEVICE_MAX_CONNECTIONS queues; run it with that unset, 32 and 1): does K2 start
//     as K1 ends, or as the copy does?
//  3. Part 2 with K1 and K2 (or K2 alone, after K1 through an event, or the copy) on streams
//     of the greatest (least) priority.
//  4. Part 2 with K1 of one CTA, K2 without shared memory, and the copy in pieces, asking to
//     overlap compute, as an SM kernel, or to GPU 1.
// Usage: copy_hold (GPU 0). Times are from the globaltimer, in us from the first stamp.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_tool.h"

using jax_ub_tool::Check;

namespace {

constexpr size_t kBytes = 256ull << 20;
constexpr int kSmem = 200 * 1024;
constexpr int kRepeats = 8;  // the first is a warm-up

__device__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Stamp(unsigned long long* at) { *at = Now(); }

// Spins `ns` from its start; records the earliest start and the latest end of its CTAs.
__global__ void Spin(unsigned long long* first, unsigned long long* last, uint64_t ns,
                     bool touch_smem) {
  extern __shared__ char smem[];
  const uint64_t t0 = Now();
  if (threadIdx.x == 0) atomicMin(first, static_cast<unsigned long long>(t0));
  if (touch_smem) smem[threadIdx.x] = 1;
  while (Now() - t0 < ns) {
  }
  if (threadIdx.x == 0) atomicMax(last, static_cast<unsigned long long>(Now()));
}

__global__ void CopyKernel(const int4* src, int4* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

enum class CopyKind { kMemcpy, kOverlapHint, kKernel };

// kBytes from src to dst (on this GPU or, for a plain copy, another); a plain copy in
// `pieces` copies of equal size.
void EnqueueCopy(CopyKind kind, void* dst, const void* src, int sms, cudaStream_t s,
                 int pieces = 1) {
  if (kind == CopyKind::kMemcpy) {
    const size_t piece = kBytes / pieces;
    for (int i = 0; i < pieces; ++i)
      Check(cudaMemcpyAsync(static_cast<char*>(dst) + i * piece,
                            static_cast<const char*>(src) + i * piece, piece, cudaMemcpyDefault, s),
            "cudaMemcpyAsync");
  } else if (kind == CopyKind::kOverlapHint) {
#if CUDART_VERSION < 13000
    std::fprintf(stderr, "the overlap hint's row needs a CUDA 13 build\n");
    std::exit(1);
#else
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    size_t sizes[1] = {kBytes};
    size_t first_of_attr = 0;
    Check(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &first_of_attr, 1, s),
          "cudaMemcpyBatchAsync");
#endif
  } else {
    CopyKernel<<<sms * 4, 512, 0, s>>>(static_cast<const int4*>(src), static_cast<int4*>(dst),
                                       kBytes / sizeof(int4));
    Check(cudaGetLastError(), "CopyKernel");
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  Check(cudaSetDevice(0), "cudaSetDevice");
  int sms = 0;
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  void *src = nullptr, *dst = nullptr;
  Check(cudaMalloc(&src, kBytes), "cudaMalloc");
  Check(cudaMalloc(&dst, kBytes), "cudaMalloc");
  Check(cudaMemset(src, 1, kBytes), "cudaMemset");
  // 0/1: the copy's start and end, 2/3: K1, 4/5: K2 (first start, last end)
  unsigned long long* t = nullptr;
  Check(cudaMallocManaged(&t, 8 * sizeof(*t)), "cudaMallocManaged");
  std::vector<cudaStream_t> streams(17);
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  Check(cudaFuncSetAttribute(Spin, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), "smem");
  auto reset = [&] {
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (int i = 0; i < 8; ++i) t[i] = (i == 2 || i == 4) ? ~0ull : 0;
  };
  // One CTA, or one per SM with a GEMM's shared memory, in clusters of `cluster` CTAs as
  // cuBLASLt's Hopper kernels launch (1x2).
  auto spin = [&](int grid, int cluster, unsigned long long* first, uint64_t ns, cudaStream_t s,
                  bool smem = true) {
    const bool big = grid > 1 && smem;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(128);
    config.dynamicSmemBytes = big ? kSmem : 0;
    config.stream = s;
    config.attrs = &attr;
    config.numAttrs = cluster > 1 ? 1 : 0;
    Check(cudaLaunchKernelEx(&config, Spin, first, first + 1, ns, big), "Spin");
  };
  const int full = sms - sms % 2;  // one CTA per SM, whole clusters of 2
  const char* copies[] = {"cudaMemcpyAsync", "cudaMemcpyBatchAsync, overlap hint",
                          "SM copy kernel"};
  std::printf("1. copy on stream 0, then a kernel on stream 1 (us from the copy's start)\n");
  for (int c = 0; c < 3; ++c) {
    for (int cluster : {0, 1, 2}) {  // 0: one CTA; else one per SM, in clusters of `cluster`
      const int grid = cluster == 0 ? 1 : full;
      std::vector<double> copy_end, start;
      for (int rep = 0; rep < kRepeats; ++rep) {
        reset();
        Stamp<<<1, 1, 0, streams[0]>>>(&t[0]);
        EnqueueCopy(static_cast<CopyKind>(c), dst, src, sms, streams[0]);
        Stamp<<<1, 1, 0, streams[0]>>>(&t[1]);
        spin(grid, std::max(cluster, 1), &t[4], 20000, streams[1]);
        Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        if (rep == 0) continue;
        copy_end.push_back((t[1] - t[0]) * 1e-3);
        start.push_back((double(t[4]) - double(t[0])) * 1e-3);
      }
      std::printf("  %-36s kernel of %3d CTA(s), clusters of %d: copy ends %7.1f, starts %7.1f\n",
                  copies[c], grid, std::max(cluster, 1), Median(copy_end), Median(start));
    }
  }
  // One measurement: K1 on k1 (one CTA per SM, or one CTA), the copy on `copy` between
  // stamps, K2 on k2 (after K1 through an event where k2 is not k1's stream).
  struct Case {
    std::string label;
    cudaStream_t k1, copy, k2;
    int k1_grid;
    int pieces = 1;       // the copy in this many copies of equal size
    void* to = nullptr;   // the copy's destination: dst, or another GPU's buffer
    bool k2_smem = true;  // K2 takes a GEMM's shared memory
    CopyKind kind = CopyKind::kMemcpy;
  };
  cudaEvent_t k1_done = nullptr;
  Check(cudaEventCreateWithFlags(&k1_done, cudaEventDisableTiming), "cudaEventCreate");
  auto hold = [&](const Case& c) {
    std::vector<double> k1_end, copy_start, copy_end, k2_start;
    for (int rep = 0; rep < kRepeats; ++rep) {
      reset();
      spin(c.k1_grid, c.k1_grid > 1 ? 2 : 1, &t[2], 100000, c.k1);
      Stamp<<<1, 1, 0, c.copy>>>(&t[0]);
      EnqueueCopy(c.kind, c.to != nullptr ? c.to : dst, src, sms, c.copy, c.pieces);
      Stamp<<<1, 1, 0, c.copy>>>(&t[1]);
      if (c.k2 != c.k1) {
        Check(cudaEventRecord(k1_done, c.k1), "cudaEventRecord");
        Check(cudaStreamWaitEvent(c.k2, k1_done), "cudaStreamWaitEvent");
      }
      spin(full, 2, &t[4], 20000, c.k2, c.k2_smem);
      Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (rep == 0) continue;
      const double t0 = double(t[2]);
      k1_end.push_back((t[3] - t0) * 1e-3);
      copy_start.push_back((double(t[0]) - t0) * 1e-3);
      copy_end.push_back((double(t[1]) - t0) * 1e-3);
      k2_start.push_back((double(t[4]) - t0) * 1e-3);
    }
    std::printf("  %-44s K1 ends %6.1f, copy %6.1f to %6.1f, K2 starts %6.1f\n", c.label.c_str(),
                Median(k1_end), Median(copy_start), Median(copy_end), Median(k2_start));
  };
  // Part 2's case: K1 and K2 on `s` (stream 1 unless named), the copy on stream 0.
  auto part2 = [&](const std::string& label, cudaStream_t s = nullptr) {
    s = s != nullptr ? s : streams[1];
    return Case{label, s, streams[0], s, full};
  };
  const char* env = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::printf(
      "2. K1 on stream S, copy on stream 0, K2 on S (us from K1's start; "
      "CUDA_DEVICE_MAX_CONNECTIONS=%s)\n",
      env != nullptr ? env : "unset");
  for (int s : {1, 8, 16}) hold(part2("S = stream " + std::to_string(s), streams[s]));
  // Whether stream priorities let K2 past the copy: XLA's copies run on streams of default
  // priority, and a custom call may fork its kernels onto a stream of its own.
  int least = 0, greatest = 0;
  Check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t high = nullptr, low = nullptr;
  Check(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, greatest), "high stream");
  Check(cudaStreamCreateWithPriority(&low, cudaStreamNonBlocking, least), "low stream");
  std::printf("3. the same with stream priorities (greatest %d, least %d)\n", greatest, least);
  hold(part2("K1, K2 on a stream of the greatest priority", high));
  Case c = part2("K1 on S, K2 on one of the greatest priority");
  c.k2 = high;
  hold(c);
  c = part2("K1, K2 on S, the copy on one of the least");
  c.copy = low;
  hold(c);
  std::printf("4. part 2 (S = stream 1) with other kernels or copies\n");
  c = part2("K1 of 1 CTA");
  c.k1_grid = 1;
  hold(c);
  for (int pieces : {16, 128}) {
    c = part2("the copy in " + std::to_string(pieces) + " pieces");
    c.pieces = pieces;
    hold(c);
  }
  c = part2("K2 without shared memory");
  c.k2_smem = false;
  hold(c);
  c = part2("the copy asking to overlap compute");
  c.kind = CopyKind::kOverlapHint;
  hold(c);
  c = part2("an SM copy kernel");
  c.kind = CopyKind::kKernel;
  hold(c);
  int gpus = 0, peer_ok = 0;
  Check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  if (gpus > 1) Check(cudaDeviceCanAccessPeer(&peer_ok, 0, 1), "cudaDeviceCanAccessPeer");
  if (peer_ok != 0) {
    void* remote = nullptr;
    Check(cudaSetDevice(1), "cudaSetDevice");
    Check(cudaMalloc(&remote, kBytes), "cudaMalloc");
    Check(cudaSetDevice(0), "cudaSetDevice");
    Check(cudaDeviceEnablePeerAccess(1, 0), "cudaDeviceEnablePeerAccess");
    c = part2("the copy to GPU 1 (peer access)");
    c.to = remote;
    hold(c);
    Check(cudaFree(remote), "cudaFree");
  }
  Check(cudaStreamDestroy(high), "cudaStreamDestroy");
  Check(cudaStreamDestroy(low), "cudaStreamDestroy");
  Check(cudaEventDestroy(k1_done), "cudaEventDestroy");
  for (cudaStream_t s : streams) Check(cudaStreamDestroy(s), "cudaStreamDestroy");
  Check(cudaFree(t), "cudaFree");
  Check(cudaFree(src), "cudaFree");
  Check(cudaFree(dst), "cudaFree");
  return 0;
}
