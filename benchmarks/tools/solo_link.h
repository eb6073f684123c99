// solo_link.h: a modelled link for solo_schedule.cu's paced reduce-scatter (`rs ... GBPS`): the
// partials a rank receives land when its peers would deliver them, so that the step list's
// waits and sum pass are timed as on 2+ GPUs, with one GPU. Not part of the library.
//
// The model, for rank 0 of `tp` (its peers run the same list, so they keep its pace): at step
// s a rank multiplies the block of rank + s and then sends it, one partial at a time on its
// link, each taking `transfer` (a partial's bytes / the link's rate). So peer tp - s finishes
// our partial when we finish our s-th GEMM (the stream writes Done(s) then), and it lands at
// L(s) = max(that time, L(s - 1)) + transfer: our link also brought the one before.
//
// The link is a host thread, so that no GPU kernel holds an SM beside the GEMMs (cuBLASLt's
// kernels are sized for all of them): it polls the Done words in mapped host memory, spins
// on the host clock for the transfer and raises the peer's Flag, which the step list's wait
// (cuStreamWaitValue64) reads there. Call c of the loop is epoch c; the thread takes the
// epochs in order, as the stream runs the calls.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "cuda_tool.h"

namespace solo {

// When the last partial lands (ms) had every GEMM of the schedule run at the whole GEMM's pace
// (`whole_ms` / tp a step), each partial `transfer_us` on the link after its GEMM and the one
// before it: the model below. The op's floor is the later of it and the whole GEMM, plus the
// sum pass.
inline double LastLanding(int tp, double whole_ms, double transfer_us) {
  const double g = whole_ms / tp, t = transfer_us * 1e-3;
  double lands = 0;
  for (int step = 1; step < tp; ++step) lands = std::max(step * g, lands) + t;
  return lands;
}

class HostLink {
 public:
  HostLink(int tp, double transfer_us)
      : tp_(tp), transfer_(static_cast<int64_t>(transfer_us * 1e3)) {
    void* words = nullptr;
    jax_ub_tool::Check(cudaHostAlloc(&words, 2 * tp * sizeof(uint64_t), cudaHostAllocMapped),
                       "cudaHostAlloc (link words)");
    words_ = static_cast<volatile uint64_t*>(words);
    for (int i = 0; i < 2 * tp; ++i) words_[i] = 0;
    void* device = nullptr;
    jax_ub_tool::Check(cudaHostGetDevicePointer(&device, words, 0), "cudaHostGetDevicePointer");
    device_ = reinterpret_cast<CUdeviceptr>(device);
    thread_ = std::thread([this] { Serve(); });
  }
  ~HostLink() {
    stop_ = true;
    thread_.join();
    jax_ub_tool::Check(cudaFreeHost(const_cast<uint64_t*>(words_)), "cudaFreeHost (link words)");
  }
  HostLink(const HostLink&) = delete;
  HostLink& operator=(const HostLink&) = delete;

  // Raised to the call's epoch when peer `peer`'s partial for us has landed.
  CUdeviceptr Flag(int peer) const { return device_ + peer * sizeof(uint64_t); }
  // Written (the call's epoch) by our stream once its GEMM of step s (1..tp-1) has ended.
  CUdeviceptr Done(int step) const { return device_ + (tp_ + step) * sizeof(uint64_t); }

 private:
  using Clock = std::chrono::steady_clock;
  using Ns = std::chrono::nanoseconds;

  void Serve() {
    for (uint64_t epoch = 1; !stop_; ++epoch) {
      Clock::time_point free_at{};  // when our link has brought the partial before
      for (int s = 1; s < tp_; ++s) {
        while (words_[tp_ + s] < epoch)
          if (stop_) return;
        const Clock::time_point start = std::max(Clock::now(), free_at);
        free_at = start + transfer_;
        while (Clock::now() < free_at) {
        }
        words_[tp_ - s] = epoch;
      }
    }
  }

  const int tp_;
  const Ns transfer_;
  volatile uint64_t* words_ = nullptr;  // [0, tp): Flag by peer; [tp, 2 tp): Done by step
  CUdeviceptr device_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace solo
