// FlagGemm's and SignalGemm's launches (flag_gemm.h): the kernel of flag_gemm_kernel.cuh with
// 64-bit epoch flags, a 128 x 128 tile, clusters of two along M and the ping-pong warp schedule:
// on an H200 the fastest of three configurations at Llama 3's all-gather shapes
// (benchmarks/tools/flag_gemm.cu and paced_gemm.cu); SignalGemm's the same kernel with its blocks'
// flags raised by its epilogue (signal_epilogue.cuh) instead of awaited by its scheduler.
// Compiled for sm_90a alone (CMakeLists.txt).
#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/gemm/flag_gemm_kernel.cuh"

namespace jax_ub {
namespace {

// FlagGemm's kernels read our own row block from a tensor of its own (OwnBlockMainloop);
// SignalGemm's signal their blocks instead.
template <class LayoutB, bool Signals = false>
using LibraryConfig = flag_gemm::Config<128, 128, 2, true, flag_gemm::FlagScheduler<uint64_t>,
                                        LayoutB, !Signals, Signals>;
static_assert(LibraryConfig<cutlass::layout::RowMajor>::kRowUnit == kFlagGemmRowUnit);
constexpr int kTileRows = 128;  // the configurations' TM

Status CutlassStatus(cutlass::Status s, const char* what) {
  if (s == cutlass::Status::kSuccess) return Status::Ok();
  return Internal(std::string("FlagGemm: ") + what + ": " + cutlass::cutlassGetStatusString(s));
}

// Cfg's arguments for a call of either kind: the GEMM and its blocks' order.
template <class Cfg, class Call>
typename Cfg::Gemm::Arguments Arguments(const Call& c, int device, int sm_count) {
  using flag_gemm::bf16;
  const int m = static_cast<int>(c.block_rows * c.blocks);
  auto args = flag_gemm::MakeArguments<Cfg>(
      m, static_cast<int>(c.k), static_cast<int>(c.n), static_cast<const bf16*>(c.a),
      static_cast<const bf16*>(c.w), static_cast<bf16*>(c.d), device, sm_count);
  args.scheduler.blocks = c.blocks;
  args.scheduler.slots = c.count;
  args.scheduler.order = c.order;
  return args;
}

template <class Cfg>
Status Run(typename Cfg::Gemm::Arguments& args, cudaStream_t stream) {
  typename Cfg::Gemm gemm;
  if (Cfg::Gemm::get_workspace_size(args) != 0)
    return Internal("FlagGemm: the kernel asks for a workspace, which it is not given");
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.can_implement(args), "can_implement"));
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.initialize(args, nullptr, stream), "initialize"));
  JAX_UB_RETURN_IF_ERROR(CutlassStatus(gemm.run(stream), "run"));
  return CudaStatus(cudaGetLastError(), "FlagGemm's launch");
}

template <class Cfg>
Status Launch(const FlagGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  auto args = Arguments<Cfg>(c, device, sm_count);
  args.scheduler.flags = c.flags;
  args.scheduler.target = c.target;
  args.scheduler.ready_block = c.own_block;  // the op's input, there before the call: no wait
  args.scheduler.give_up = {c.fired, c.target, reinterpret_cast<unsigned long long*>(c.health)};
  args.mainloop.own = static_cast<const flag_gemm::bf16*>(c.own);
  args.mainloop.own_first_row = static_cast<int>(c.own_block * c.block_rows);
  args.mainloop.own_rows = static_cast<int>(c.block_rows);
  return Run<Cfg>(args, stream);
}

template <class Cfg>
Status LaunchSignals(const SignalGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  auto args = Arguments<Cfg>(c, device, sm_count);  // no flags to wait for
  flag_gemm::Signals& sig = args.epilogue.signals;
  sig.flags = c.flags;
  sig.counts = c.counts;
  sig.target = c.target;
  sig.signalled = c.signalled;
  sig.block_rows = static_cast<int>(c.block_rows);
  sig.tiles_per_block =
      static_cast<uint32_t>(c.block_rows / kTileRows * ((c.n + kTileRows - 1) / kTileRows));
  return Run<Cfg>(args, stream);
}

// A call `FlagGemmFits` refuses, or with arguments no launch may take (TMA reads and writes
// 16-byte aligned tensors), named.
template <class Call>
Status Unsupported(const Call& c, bool bad) {
  auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (!FlagGemmFits(DType::kBF16, DType::kBF16, DType::kBF16, false, c.block_rows, c.k, c.n,
                    c.blocks) ||
      c.count < 1 || c.count > c.blocks || c.flags == nullptr || misaligned(c.a) ||
      misaligned(c.w) || misaligned(c.d) || bad)
    return InvalidArgument("FlagGemm: unsupported call: " + std::to_string(c.blocks) +
                           " blocks of " + std::to_string(c.block_rows) +
                           " rows, k=" + std::to_string(c.k) + ", n=" + std::to_string(c.n) + ", " +
                           std::to_string(c.count) + " of them in its order");
  return Status::Ok();
}

template <class Cfg>
Status Preload() {
  cudaFuncAttributes attr;
  return CudaStatus(cudaFuncGetAttributes(&attr, cutlass::device_kernel<typename Cfg::Kernel>),
                    "loading FlagGemm's kernel");
}

}  // namespace

bool FlagGemmBuilt() { return true; }

Status LaunchFlagGemm(const FlagGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  JAX_UB_RETURN_IF_ERROR(Unsupported(c, sm_count < 1 || c.own == nullptr || c.own_block < 0 ||
                                            c.own_block >= c.blocks ||
                                            reinterpret_cast<uintptr_t>(c.own) % 16 != 0 ||
                                            (c.fired == nullptr) != (c.health == nullptr)));
  if (c.w_transposed)
    return Launch<LibraryConfig<cutlass::layout::ColumnMajor>>(c, device, sm_count, stream);
  return Launch<LibraryConfig<cutlass::layout::RowMajor>>(c, device, sm_count, stream);
}

Status LaunchSignalGemm(const SignalGemmCall& c, int device, int sm_count, cudaStream_t stream) {
  JAX_UB_RETURN_IF_ERROR(
      Unsupported(c, sm_count < 1 || c.counts == nullptr || c.signalled >> c.blocks != 0));
  using Col = cutlass::layout::ColumnMajor;
  using Row = cutlass::layout::RowMajor;
  if (c.w_transposed) return LaunchSignals<LibraryConfig<Col, true>>(c, device, sm_count, stream);
  return LaunchSignals<LibraryConfig<Row, true>>(c, device, sm_count, stream);
}

Status PreloadFlagGemms() {
  using Col = cutlass::layout::ColumnMajor;
  using Row = cutlass::layout::RowMajor;
  using RowSignals = LibraryConfig<Row, true>;
  using ColSignals = LibraryConfig<Col, true>;
  JAX_UB_RETURN_IF_ERROR(Preload<LibraryConfig<Row>>());
  JAX_UB_RETURN_IF_ERROR(Preload<LibraryConfig<Col>>());
  JAX_UB_RETURN_IF_ERROR(Preload<RowSignals>());
  return Preload<ColSignals>();
}

}  // namespace jax_ub
