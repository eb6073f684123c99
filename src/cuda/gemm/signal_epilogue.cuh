// SignalEpilogue: CUTLASS's SM90 TMA epilogue, raising a row block's flag once every tile of the
// block is written. The reduce-scatter's signal GEMM (SignalGemm, flag_gemm.h) computes every
// row block of partials in one persistent kernel, in push order, and the push of a block waits
// for the block's flag (a stream memory operation, no SM) instead of for a GEMM's end: no GEMM
// boundary and no partial last wave a block. Included by flag_gemm_kernel.cuh (Config's
// `Signals`) and by the tool that times it (benchmarks/tools/signal_gemm.cu).
//
// After a tile's stores (the base waits only until the TMA has read them out of shared memory),
// the warp that issued them waits until they are written, every thread of the warp group orders
// them before what follows (fence.proxy.async, then a named barrier of the group), and one thread
// counts the tile into its block's counter, acq_rel at GPU scope. (A fence at system scope there,
// every tile, took the kernel at k = 512 from 0.96x cuBLASLt's GEMM, unsignalled, to 1.40x on an
// H200; without it, 1.23x: the wait for the stores remains, where mainloops are short.) The
// thread that counts a block's last tile has acquired every other tile's writes through that
// counter; it resets the counter (no other tile of the block is left in this call; the next
// call's kernel comes after this one on its stream) and raises the block's flag at system scope
// to `target`, the call's epoch, behind a fence at system scope (once a block), where a copy
// engine's stream wait sees it. Ping-pong kernels only: one warp group a tile, user barrier ids
// 0 and 1 (CUTLASS reserves the ids below them).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

namespace jax_ub::flag_gemm {

// Where a kernel's blocks are counted and raised: block b of `block_rows` rows at flags[b], where
// bit b of `signalled` is set. flags null: no signals (a plain GEMM).
struct Signals {
  uint64_t* flags = nullptr;
  unsigned long long* counts = nullptr;  // counts[b], device memory, 0 between calls
  uint64_t target = 0;
  uint32_t signalled = 0;
  int block_rows = 1;
  uint32_t tiles_per_block = 1;  // CTA tiles of a block
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
    // Each consumer warp group (1, 2) its own barrier, its id a constant.
    if (int(threadIdx.x) / cutlass::NumThreadsPerWarpGroup == 1) {
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, 0);
    } else {
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, 1);
    }
    if (t == 0 && (signals_.signalled >> block_ & 1u)) {
      unsigned long long old;
      asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;"
                   : "=l"(old)
                   : "l"(signals_.counts + block_)
                   : "memory");
      if (old + 1 == signals_.tiles_per_block) {
        asm volatile("st.relaxed.gpu.global.u64 [%0], 0;" ::"l"(signals_.counts + block_)
                     : "memory");
        asm volatile(
            "fence.sc.sys;\n\tst.release.sys.global.u64 [%0], %1;" ::"l"(signals_.flags + block_),
            "l"(signals_.target)
            : "memory");
      }
    }
    block_ = -1;
  }

  Signals const& signals_;
  int block_ = -1;
};

}  // namespace jax_ub::flag_gemm
