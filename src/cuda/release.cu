// The watchdog's device side (release.h): each call's release, armed when it is enqueued.
#include <cstddef>

#include "cuda/check.h"
#include "cuda/driver_api.h"
#include "cuda/release.h"

namespace jax_ub {
namespace {

// One thread: a released call's waits are at most a few dozen words, read and raised in order.
__global__ void ReleaseWaits(const ReleaseBatch b, ReleaseBoard* board) {
  volatile ReleaseBoard* v = board;
  if (v->fired != b.epoch) return;  // the call ended: nothing to release
  if (b.first == 0) {
    // Before any wait is released, so that the released call fills its outputs with NaN
    // (VerifyCall) instead of computing on data that never came; a mismatch's mark stays.
    atomicCAS(reinterpret_cast<unsigned long long*>(b.health), 0ull, 1ull);
    __threadfence_system();
  }
  for (int i = 0; i < b.count; ++i) {
    auto* flag = reinterpret_cast<unsigned long long*>(b.flags[i]);
    const uint64_t seen = *reinterpret_cast<volatile uint64_t*>(flag);
    const bool met = static_cast<int64_t>(seen - b.targets[i]) >= 0;
    v->met[b.first + i] = met;
    v->progress[b.first + i] = *reinterpret_cast<const volatile uint64_t*>(b.progress[i]);
    if (!met) atomicMax(flag, static_cast<unsigned long long>(b.targets[i]));
  }
  __threadfence_system();
  if (b.last) v->released = b.epoch;
}

}  // namespace

Status LaunchReleaseWaits(const ReleaseBatch& batch, ReleaseBoard* board, cudaStream_t stream) {
  if (batch.first == 0) {
    const DriverOps* ops;
    JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&ops));
    const auto gate = reinterpret_cast<CUdeviceptr>(board) + offsetof(ReleaseBoard, gate);
    JAX_UB_CU(
        ops->wait(reinterpret_cast<CUstream>(stream), gate, batch.epoch, CU_STREAM_WAIT_VALUE_GEQ));
  }
  ReleaseWaits<<<1, 1, 0, stream>>>(batch, board);
  return CudaStatus(cudaGetLastError(), "ReleaseWaits launch");
}

Status PreloadReleaseWaits() {
  cudaFuncAttributes attr;
  return CudaStatus(cudaFuncGetAttributes(&attr, ReleaseWaits), "cudaFuncGetAttributes");
}

}  // namespace jax_ub
