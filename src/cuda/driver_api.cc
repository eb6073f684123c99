#include "cuda/driver_api.h"

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
  return Added();
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
  return Added();
}

Status MemOpRuns::Writes(cudaStream_t stream, uint64_t* flags, const uint64_t* values, int count) {
  for (int i = 0; i < count; ++i)
    JAX_UB_RETURN_IF_ERROR(Add(stream, WriteOp(flags + i, values[i])));
  return Added();
}

Status MemOpRuns::Add(cudaStream_t stream, const CUstreamBatchMemOpParams& op) {
  if (!ops_.empty() && stream != stream_) JAX_UB_RETURN_IF_ERROR(Flush());
  stream_ = stream;
  ops_.push_back(op);
  return ops_.size() < kMostABatch ? Status::Ok() : Flush();
}

Status MemOpRuns::Flush() {
  if (ops_.empty()) return Status::Ok();
  const DriverOps* driver;
  JAX_UB_RETURN_IF_ERROR(LoadDriverOps(&driver));
  const auto cu = reinterpret_cast<CUstream>(stream_);
  const CUstreamBatchMemOpParams& op = ops_[0];
  // One operation: the driver's call for it alone.
  if (ops_.size() == 1 && op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_64) {
    JAX_UB_CU(driver->wait(cu, op.waitValue.address, op.waitValue.value64, op.waitValue.flags));
  } else if (ops_.size() == 1 && op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_64) {
    JAX_UB_CU(driver->write(cu, op.writeValue.address, op.writeValue.value64, op.writeValue.flags));
  } else {
    JAX_UB_CU(driver->batch(cu, static_cast<unsigned>(ops_.size()), ops_.data(), 0));
  }
  ops_.clear();
  return Status::Ok();
}

}  // namespace jax_ub
