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
  JAX_UB_RETURN_IF_ERROR(Add(stream, op));
  return Added(stream);
}

namespace {
CUstreamBatchMemOpParams WriteOp(uint64_t* flag, uint64_t value) {
  CUstreamBatchMemOpParams op = {};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(flag);
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}
}  // namespace

Status MemOpRuns::Write(cudaStream_t stream, uint64_t* flag, uint64_t value) {
  JAX_UB_RETURN_IF_ERROR(Add(stream, WriteOp(flag, value)));
  return Added(stream);
}

Status MemOpRuns::Writes(cudaStream_t stream, uint64_t* flags, const uint64_t* values, int count) {
  for (int i = 0; i < count; ++i)
    JAX_UB_RETURN_IF_ERROR(Add(stream, WriteOp(flags + i, values[i])));
  return Added(stream);
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
    const auto cu = reinterpret_cast<CUstream>(stream);
    const CUstreamBatchMemOpParams& op = ops[0];
    // One operation: the driver's call for it alone.
    if (ops.size() == 1 && op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_64) {
      JAX_UB_CU(driver->wait(cu, op.waitValue.address, op.waitValue.value64, op.waitValue.flags));
    } else if (ops.size() == 1 && op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_64) {
      JAX_UB_CU(
          driver->write(cu, op.writeValue.address, op.writeValue.value64, op.writeValue.flags));
    } else {
      JAX_UB_CU(driver->batch(cu, static_cast<unsigned>(ops.size()), ops.data(), 0));
    }
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
