// Stream memory operations (wait on, write and batch 64-bit flags from a stream) come from
// the CUDA driver API. They are resolved once through the runtime, so the module links no
// libcuda and imports on machines without a driver.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "protocol/status.h"

namespace jax_ub {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using StreamBatchFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
struct DriverOps {
  StreamValueFn wait = nullptr;
  StreamValueFn write = nullptr;
  StreamBatchFn batch = nullptr;
};

// The process-wide entry points (resolved on the first call), or why they are missing.
Status LoadDriverOps(const DriverOps** out);

// A call's stream memory operations (flag waits and writes). With batching on, those that
// follow one another on one stream in the call's step order go to the driver as one
// cuStreamBatchMemOp: the caller flushes the run before it enqueues anything else, and a
// Wait or Write on another stream flushes it too. So every operation enters the GPU's queues
// in the same order, relative to every stream's work, as when sent one by one: held back
// past other streams' work (a lane's run sent only before its own next step), the ops'
// signals hung ranks sharing a GPU (N = 4 and 8 on an H100), as streams share hardware
// queues and a wait enqueued ahead of the signal a peer needs can hold it. Off (the
// default), each goes to the driver at once (a descriptor's words in one batch). Its buffer
// is kept from call to call.
class MemOpRuns {
 public:
  void set_batching(bool on) { batching_ = on; }
  // Holds `stream` until the 64-bit word at `flag` is at least `target`.
  Status Wait(cudaStream_t stream, const uint64_t* flag, uint64_t target);
  // Writes `value` to `flag` (any GPU's memory) after `stream`'s earlier work, behind a
  // memory barrier: what the stream wrote before is visible once the flag is.
  Status Write(cudaStream_t stream, uint64_t* flag, uint64_t value);
  // Write for each of `count` consecutive words at `flags`, from `values`.
  Status Writes(cudaStream_t stream, uint64_t* flags, const uint64_t* values, int count);
  // Sends the run gathered so far, if any.
  Status Flush();
  // Forgets the run, enqueueing none of it (a call that failed midway).
  void Drop() { ops_.clear(); }

 private:
  // The driver takes fewer than 256 operations a batch.
  static constexpr size_t kMostABatch = 255;
  Status Add(cudaStream_t stream, const CUstreamBatchMemOpParams& op);
  // After an operation's Adds: unbatched, it goes to the driver now.
  Status Added() { return batching_ ? Status::Ok() : Flush(); }
  bool batching_ = false;
  cudaStream_t stream_ = nullptr;  // the run's
  std::vector<CUstreamBatchMemOpParams> ops_;
};

}  // namespace jax_ub
