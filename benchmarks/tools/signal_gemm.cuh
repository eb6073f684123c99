// signal_gemm.cuh: a prototype for the reduce-scatter side (not in the library). The reduce-
// scatter's GEMM makes tp row blocks of partials, one per destination; the library runs a GEMM
// per block (or run of blocks) so that each block's push can start after its GEMM, paying each
// GEMM's last partial wave and, at short k, its start. Here one persistent GEMM makes them all,
// the blocks in push order (FlagTileScheduler's order, with no flags to wait for), and raises a
// block's flag once every tile of it is written: the push of a block then waits on its flag
// (a stream memory operation, no SM), as the all-gather's FlagGemm waits on its blocks' flags.
//
// SignalEpilogue wraps CUTLASS's SM90 TMA epilogue. After a tile's stores (the base waits only
// until the TMA has read them out of shared memory), the warp that issued them waits until they
// are written, every thread of the warp group orders them before what follows (fence.proxy.async,
// then a named barrier), and one thread counts the tile into its block's counter (acq_rel); the
// thread that counts a block's last tile raises the block's flag at system scope to the number of
// calls that have completed the block (counters and flags start at 0 and only grow, so call c of
// a counter sets c: no epoch argument). Timed by signal_gemm.cu.
#pragma once

#include <cstdint>

#include "flag_gemm_kernel.cuh"

namespace sg {

using fg::bf16;

// Where a block's tiles are counted and its flag raised. Blocks of `block_rows` rows; block b is
// signalled at flags[slot], slot = (slot_of_block >> 4 b) & 15, where slot < signalled (the rest,
// the rank's own block, raise nothing). counts: one word per block, device memory.
struct Signals {
  uint64_t* flags = nullptr;  // nullptr: no signals
  unsigned long long* counts = nullptr;
  uint64_t slot_of_block = 0;
  int signalled = 0;
  int block_rows = 1;
  uint32_t tiles_per_block = 1;  // CTA tiles
};

template <class Base, int TileM>
struct SignalEpilogue : Base {
  struct Arguments : Base::Arguments {
    Signals signals;
  };
  struct Params : Base::Params {
    Signals signals;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void* ws) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, a, ws);
    p.signals = a.signals;
    return p;
  }

  CUTLASS_HOST_DEVICE SignalEpilogue(Params const& p, typename Base::TensorStorage& smem)
      : Base(p, smem), signals_(p.signals) {}

  // The base's store of one tile; remembers the tile's block for store_tail.
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState,
            class ProblemShape, class TileShape, class TileCoord, class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state,
                            StorePipeline store_pipeline, StoreState store_state,
                            ProblemShape shape, TileShape tile, TileCoord coord, Rest&&... rest) {
    block_ = int(cute::get<0>(coord)) * TileM / signals_.block_rows;
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, shape, tile, coord,
                       static_cast<Rest&&>(rest)...);
  }

  template <class... Args>
  CUTLASS_DEVICE auto store_tail(Args... args) {
    auto next = Base::store_tail(args...);
    Signal();
    return next;
  }

 private:
  CUTLASS_DEVICE void Signal() {
    if (signals_.flags == nullptr || block_ < 0) return;
    const int t = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
    // Warp 0 of the group issued the tile's TMA stores: wait until they have written.
    if (t < cutlass::NumThreadsPerWarp) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    // Each consumer warp group its own barrier (user IDs 0 and 1; CUTLASS reserves those below).
    const int group = int(threadIdx.x) / cutlass::NumThreadsPerWarpGroup;  // 1, 2: consumers
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, uint32_t(group - 1));
    if (t == 0) {
      const int slot = int((signals_.slot_of_block >> (4 * block_)) & 15u);
      if (slot < signals_.signalled) {
        unsigned long long old;
        asm volatile("fence.acq_rel.sys;\n\tatom.acq_rel.gpu.global.add.u64 %0, [%1], 1;"
                     : "=l"(old)
                     : "l"(signals_.counts + block_)
                     : "memory");
        const unsigned long long done = old + 1;
        if (done % signals_.tiles_per_block == 0) {
          const uint64_t calls = done / signals_.tiles_per_block;
          asm volatile(
              "fence.sc.sys;\n\tst.release.sys.global.u64 [%0], %1;" ::"l"(signals_.flags + slot),
              "l"(calls)
              : "memory");
        }
      }
    }
    block_ = -1;
  }

  Signals const& signals_;
  int block_ = -1;
};

// The library FlagGemm's configuration (128 x 128 x 64 tiles, clusters of 2 x 1, ping-pong), its
// epilogue signalling, its tiles in the order of FlagTileScheduler (flags left null: no waits).
struct SignalConfig {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Epilogue = SignalEpilogue<
      jax_ub::flag_gemm::Sm90Epilogue<Tile, Cluster, cutlass::epilogue::TmaWarpSpecialized>, 128>;
  using Mainloop =
      jax_ub::flag_gemm::Sm90Mainloop<Tile, Cluster, cutlass::layout::RowMajor, Epilogue,
                                      cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, fg::FlagScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// One initialized SignalGemm: D[m, n] = A[m, k] @ B[k, n] (row-major bf16) in `blocks` row
// blocks taken in `order` (block order[s] in bits [4s, 4s + 4)), signalling as `s` says.
struct SignalOp : fg::Op {
  SignalConfig::Gemm gemm;
  SignalOp(int m, int k, int n, int blocks, uint64_t order, int sm_count, const bf16* a,
           const bf16* b, bf16* d, const Signals& s) {
    using K = SignalConfig::Kernel;
    typename K::StrideA sa = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(m) * k);
    typename K::StrideB sb = cute::make_stride(cute::Int<1>{}, int64_t(n), int64_t(n) * k);
    typename K::StrideD sd = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(m) * n);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename SignalConfig::Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {m, n, k, 1};
    args.mainloop.ptr_A = a;
    args.mainloop.dA = sa;
    args.mainloop.ptr_B = b;
    args.mainloop.dB = sb;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = sd;
    args.epilogue.ptr_D = d;
    args.epilogue.dD = sd;
    args.epilogue.signals = s;
    args.hw_info = hw;
    args.scheduler.blocks = blocks;
    args.scheduler.order = order;
    if (SignalConfig::Gemm::get_workspace_size(args) != 0) Fail("SignalOp", "asks for a workspace");
    CHECK(gemm.can_implement(args));
    CHECK(gemm.initialize(args, nullptr));
  }
  void Run(cudaStream_t st) override { CHECK(gemm.run(st)); }
};

}  // namespace sg
