// Every CUDA, driver and cuBLASLt call goes through these: a failure becomes a Status
// that names the call, never a silent continue.
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "protocol/status.h"

namespace jax_ub {

inline Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")");
}

inline Status CuStatus(CUresult err, const char* what) {
  if (err == CUDA_SUCCESS) return Status::Ok();
  return Internal(std::string(what) + " failed with CUresult " + std::to_string(err));
}

inline Status CublasStatus(cublasStatus_t err, const char* what) {
  if (err == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal(std::string(what) + " failed: " + cublasLtGetStatusName(err));
}

#define JAX_UB_CUDA(expr) JAX_UB_RETURN_IF_ERROR(::jax_ub::CudaStatus((expr), #expr))
#define JAX_UB_CU(expr) JAX_UB_RETURN_IF_ERROR(::jax_ub::CuStatus((expr), #expr))
#define JAX_UB_CUBLAS(expr) JAX_UB_RETURN_IF_ERROR(::jax_ub::CublasStatus((expr), #expr))

}  // namespace jax_ub
