#include "cuda/driver_api.h"

#include <algorithm>

#include "cuda/check.h"

namespace jax_ub {

Status LoadDriverOps(const DriverOps** out) {
  static DriverOps ops;
  static Status status = [] {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWaitValue64");
    ops.wait = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000,
                                                 cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamWriteValue64");
    ops.write = reinterpret_cast<StreamValueFn>(fn);
    JAX_UB_CUDA(
        cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr)
      return Internal("driver has no cuStreamBatchMemOp");
    ops.batch = reinterpret_cast<StreamBatchFn>(fn);
    return Status::Ok();
  }();
  *out = &ops;
  return status;
}

Status MemOpRuns::Wait(cudaStream_t stream, const uint64_t* flag, uint64_t target) {
  CUstreamBatchMemOpParams op = {};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(flag);
  op.waitValue.value64 = target;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return Add(stream, op);
}

Status MemOpRuns::Write(cudaStream_t stream, uint64_t* flag, uint64_t value) {
  CUstreamBatchMemOpParams op = {};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(flag);
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return Add(stream, op);
}

Status MemOpRuns::Add(cudaStream_t stream, const CUstreamBatchMemOpParams& op) {
  auto run =
      std::find_if(runs_.begin(), runs_.end(), [&](const auto& r) { return r.first == stream; });
  if (run == runs_.end()) run = runs_.insert(run, {stream, {}});
  run->second.push_back(op);
  return run->second.size() < kMostABatch ? Status::Ok() : Flush(stream);
}

Status MemOpRuns::Flush(cudaStream_t stream) {
  for (auto& [s, ops] : runs_) {
    if (s != stream || ops.empty()) continue;
    const DriverOps* driver;
    JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&driver));
    JAX_UB_CU(driver->batch(reinterpret_cast<CUstream>(stream), static_cast<unsigned>(ops.size()),
                            ops.data(), 0));
    ops.clear();
  }
  return Status::Ok();
}

void MemOpRuns::Drop() {
  for (auto& run : runs_) run.second.clear();
}

Status MemOpRuns::FlushAll() {
  for (auto& run : runs_) JAX_UB_RETURN_IF_ERROR(Flush(run.first));
  return Status::Ok();
}

}  // namespace jax_ub
