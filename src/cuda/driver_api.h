// Stream memory operations (wait on, write and batch 64-bit flags from a stream) come from
// the CUDA driver API. They are resolved once through the runtime, so the module links no
// libcuda and imports on machines without a driver.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
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

// A call's stream memory operations (flag waits and writes). With batching on they gather
// per stream, and each stream's run goes to the driver as one cuStreamBatchMemOp, in order,
// when the caller flushes that stream: a call at tp=8 has 35 such steps (a descriptor's is
// 5 writes), in 17 (reduce-scatter) or 22 (all-gather) runs, each otherwise a driver call of
// its own. The caller flushes a stream before it enqueues anything else on it or records an
// event on it, and every stream at the end. Off (the default), each goes to the driver at
// once (a descriptor's words in one batch). Its buffers are kept from call to call.
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
  Status Flush(cudaStream_t stream);
  Status FlushAll();
  // Forgets what is gathered, enqueueing none of it (a call that failed midway).
  void Drop();

 private:
  // The driver takes fewer than 256 operations a batch.
  static constexpr size_t kMostABatch = 255;
  Status Add(cudaStream_t stream, const CUstreamBatchMemOpParams& op);
  // After an operation's Adds: unbatched, it goes to the driver now.
  Status Added(cudaStream_t stream) { return batching_ ? Status::Ok() : Flush(stream); }
  bool batching_ = false;
  std::vector<std::pair<cudaStream_t, std::vector<CUstreamBatchMemOpParams>>> runs_;
};

}  // namespace jax_ub
