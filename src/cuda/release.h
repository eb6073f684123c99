// The watchdog's device side: a stuck call's flag waits released with no CUDA call from the
// watchdog's thread.
//
// Loading a module (CUDA's lazy loading at a kernel's first launch, or a program XLA loads)
// holds the context's lock until the device's queued work has drained, and every other
// thread's copy waits for that lock. Work stuck on a dead peer never drains, so a watchdog
// that released it with a copy would wait forever (benchmarks/tools/lazy_load.cu). So each
// call arms its own release when it is enqueued: on a stream of the slot's own, a wait for the
// board's gate and a kernel (ReleaseWaits) that releases the call's waits only where the
// watchdog fired it. The call's end opens the gate from the device and the kernel finds nothing
// to do; the watchdog fires a stuck call with two stores to host memory. The kernel needs an
// SM: a flag GEMM waiting inside the call, which holds them all, gives up on the same store
// (GiveUp, gemm/flag_gemm_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol/status.h"
#include "protocol/topology.h"

namespace jax_ub {

// A call's waits at most: four flags a peer (data, first piece, credit, descriptor).
constexpr int kMaxReleaseWaits = 4 * kMaxRanks;

// One per slot, in host-mapped memory: the host and the device read and write it directly.
struct ReleaseBoard {
  // The last call let through the release stream's wait: written by each armed call's end
  // (from the device) and by the watchdog when it fires the oldest call in flight, whose
  // earlier calls have all ended: it only grows.
  uint64_t gate;
  uint64_t fired;     // the call the watchdog fired (the host's store)
  uint64_t released;  // the last fired call whose waits were released (ReleaseWaits)
  // Per wait of the released call, in its order: whether the flag had reached its target,
  // and the value of its progress flag (the last call the peer delivered) then.
  uint64_t met[kMaxReleaseWaits];
  uint64_t progress[kMaxReleaseWaits];
};

// A launch's share of a call's waits (kernel parameters: at most kReleaseWaitsPerLaunch).
constexpr int kReleaseWaitsPerLaunch = 32;
struct ReleaseBatch {
  uint64_t epoch = 0;
  uint64_t* health = nullptr;  // raised by the call's first launch, before any release
  int first = 0;               // the index of this launch's first wait in the call's
  int count = 0;
  bool last = false;  // this launch writes `released`
  uint64_t* flags[kReleaseWaitsPerLaunch] = {};
  uint64_t targets[kReleaseWaitsPerLaunch] = {};
  const uint64_t* progress[kReleaseWaitsPerLaunch] = {};
};

// Enqueues on `stream` a wait until `board`'s gate reaches `batch.epoch` (on the first launch
// of a call), then the kernel: where the board's `fired` is the call, it raises the health
// word, records each wait's state and raises each unmet flag to its target (an atomic max:
// a peer's later signal is never undone); otherwise nothing. `board` is the device's view.
Status LaunchReleaseWaits(const ReleaseBatch& batch, ReleaseBoard* board, cudaStream_t stream);

// Loads the kernel on the current device now (no lazy loading once calls are in flight).
Status PreloadReleaseWaits();

}  // namespace jax_ub
