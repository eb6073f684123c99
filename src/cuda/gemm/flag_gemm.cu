// FlagGemm's launch (flag_gemm.h): the kernel of flag_gemm_kernel.cuh with 64-bit epoch flags,
// a 128 x 128 tile, clusters of two along M and the ping-pong warp schedule: on an H200 the
// fastest of three configurations at Llama 3's all-gather shapes (benchmarks/tools/
// flag_gemm.cu and paced_gemm.cu). Compiled for sm_90a alone (CMakeLists.txt).
#include <string>

#include "cuda/check.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/gemm/flag_gemm_kernel.cuh"

namespace jax_ub {
namespace {

template <class LayoutB>
using LibraryConfig =
    flag_gemm::Config<128, 128, 2, true, flag_gemm::FlagScheduler<uint64_t>, LayoutB>;
static_assert(LibraryConfig<cutlass::layout::RowMajor>::kRowUnit == kFlagGemmRowUnit);

Status CutlassStatus(cutlass::Status s, const char* what) {
  if (s == cutlass::Status::kSuccess) return Status::Ok();
  return Internal(std::string("FlagGemm: ") + what + ": " + cutlass::cutlassGetStatusString(s));
}

template <class Cfg>
Status Launch(const FlagGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  using flag_gemm::bf16;
  const int m = static_cast<int>(c.block_rows * c.blocks);
  auto args = flag_gemm::MakeArguments<Cfg>(
      m, static_cast<int>(c.k), static_cast<int>(c.n), static_cast<const bf16*>(c.a),
      static_cast<const bf16*>(c.w), static_cast<bf16*>(c.d), device, sm_count);
  args.scheduler.flags = c.flags;
  args.scheduler.target = c.target;
  args.scheduler.blocks = c.blocks;
  args.scheduler.slots = c.count;
  args.scheduler.order = c.order;
  typename Cfg::Gemm gemm;
  if (Cfg::Gemm::get_workspace_size(args) != 0)
    return Internal("FlagGemm: the kernel asks for a workspace, which it is not given");
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.can_implement(args), "can_implement"));
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.initialize(args, nullptr, stream), "initialize"));
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.run(stream), "run"));
  return CudaStatus(cudaGetLastError(), "FlagGemm's launch");
}

}  // namespace

bool FlagGemmBuilt() { return true; }

Status LaunchFlagGemm(const FlagGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  if (!FlagGemmFits(DType::kBF16, DType::kBF16, DType::kBF16, false, c.block_rows, c.k, c.n,
                    c.blocks) ||
      c.count < 1 || c.count > c.blocks || c.flags == nullptr || sm_count < 1)
    return InvalidArgument("FlagGemm: unsupported call: " + std::to_string(c.blocks) +
                           " blocks of " + std::to_string(c.block_rows) +
                           " rows, k=" + std::to_string(c.k) + ", n=" + std::to_string(c.n) + ", " +
                           std::to_string(c.count) + " of them in its order");
  if (c.w_transposed)
    return Launch<LibraryConfig<cutlass::layout::ColumnMajor>>(c, device, sm_count, stream);
  return Launch<LibraryConfig<cutlass::layout::RowMajor>>(c, device, sm_count, stream);
}

}  // namespace jax_ub
