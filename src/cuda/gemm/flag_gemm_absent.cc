// FlagGemm and SignalGemm where this build has no kernel (CUTLASS's headers were not found): the
// schedule never asks for it (FlagGemmBuilt), and a direct call is an error.
#include "cuda/gemm/flag_gemm.h"

namespace jax_ub {

bool FlagGemmBuilt() { return false; }

Status LaunchFlagGemm(const FlagGemmCall&, int, int, cudaStream_t) {
  return FailedPrecondition(
      "FlagGemm: this build of jax_ub has no flag GEMM (CUTLASS's headers were not found: "
      "pip install nvidia-cutlass, or set JAX_UB_CUTLASS_INCLUDE, and rebuild)");
}

Status LaunchSignalGemm(const SignalGemmCall&, int, int, cudaStream_t) {
  return FailedPrecondition(
      "SignalGemm: this build of jax_ub has no signal GEMM (CUTLASS's headers were not found: "
      "pip install nvidia-cutlass, or set JAX_UB_CUTLASS_INCLUDE, and rebuild)");
}

Status PreloadFlagGemms() { return Status::Ok(); }

}  // namespace jax_ub
