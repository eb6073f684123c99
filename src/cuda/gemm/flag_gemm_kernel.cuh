// The kernel of FlagGemm (flag_gemm.h), CUTLASS-only, included by flag_gemm.cu and by the tools
// that measure it (benchmarks/tools/flag_gemm_kernel.cuh). A CUTLASS SM90 bf16 GEMM, D[M,N] =
// A[M,K] @ B[K,N] (A and D row-major; B row-major, or column-major: w stored transposed; fp32
// accumulation) whose persistent tile scheduler waits, before each output tile, until the
// flag of the tile's row block of A reaches a target: the GEMM side of an all-gather GEMM,
// where A arrives as `blocks` row blocks of M / blocks rows, taken in a given order.
//
// FlagTileScheduler derives from CUTLASS's PersistentTileSchedulerSm90 and keeps its own
// cluster-level work index: work unit u of the grid-stride walk belongs to slot
// u / units_per_block, whose row block is order[slot]; inside a row block the walk goes down M
// first (the cluster rows of the block), then across N. The slots may be fewer than the
// blocks: the blocks in no slot are not computed (the library's own block, which a GEMM of its
// own multiplies before). Every warp role asks the scheduler through get_current_work /
// fetch_next_work, so every role sees the same tile. The producer warp group waits there
// (an acquire load at system scope, polled with __nanosleep, then fence.proxy.async so that
// the TMA loads of A come after it) before it loads anything of the tile; the math warps only
// read what those loads put in shared memory. A wait never gives up on its own unless given a
// timeout (the tools). The library's waits give up where its watchdog fired the call
// (GiveUp): the kernel holds every SM, so the call's armed release (release.h) could not run
// before it ends, and the call's outputs become NaN.
// CUTLASS's device-side asserts make ptxas serialize the wgmma pipeline (C7510): keep them out.
#pragma once
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "signal_epilogue.cuh"

namespace jax_ub::flag_gemm {

// Flags are 32-bit (the tools) or 64-bit words (the library's epoch flags), raised by another
// GPU's stream memory operation or a kernel; read at system scope.
__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int LoadAcquire(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Where the library's watchdog fires a call whose waits are overdue: `fired` (host-mapped,
// the board's word of release.h) holds the call, and a wait gives up, raising `health` (the
// call's outputs become NaN). A host read crosses PCIe: it is made only in a wait that has
// lasted kFirstLookNs, once each kLookEveryNs. Once health is raised (this call given up, or
// an earlier one failed) every wait gives up at once: a device read.
struct GiveUp {
  const uint64_t* fired = nullptr;  // nullptr: never (the tools)
  uint64_t call = 0;
  unsigned long long* health = nullptr;
};
constexpr uint64_t kFirstLookNs = 1000000, kLookEveryNs = 100000;

// Polls until *flag >= target, then orders the caller's TMA loads after it (the data was written
// through the generic proxy, TMA reads through the async proxy). With a timeout (the tools) it
// gives up after timeout_ns, writing error_value to *error, or once another wait has given up;
// with `give_up`, as GiveUp says.
template <class Word>
__device__ __forceinline__ void AwaitFlag(const Word* flag, Word target, int* error,
                                          uint64_t timeout_ns, int error_value,
                                          const GiveUp& give_up = {}) {
  if (LoadAcquire(flag) < target) {
    const uint64_t start = Now();
    uint64_t look = start + kFirstLookNs;
    while (LoadAcquire(flag) < target) {
      __nanosleep(256);
      if (give_up.fired != nullptr) {
        if (*reinterpret_cast<volatile unsigned long long*>(give_up.health) != 0) break;
        const uint64_t now = Now();
        if (now > look) {
          look = now + kLookEveryNs;
          if (*reinterpret_cast<const volatile uint64_t*>(give_up.fired) == give_up.call) {
            atomicCAS(give_up.health, 0ull, 1ull);
            break;
          }
        }
      }
      if (timeout_ns == 0) continue;
      volatile int* err = error;
      if (err != nullptr && *err != 0) break;  // another wait gave up
      if (Now() - start > timeout_ns) {
        if (err != nullptr) *err = error_value;
        break;
      }
    }
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The tag GemmUniversal is given; TileSchedulerSelector maps it to FlagTileScheduler below.
template <class Word>
struct FlagScheduler {};

template <class ClusterShape, class Word>
class FlagTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kCM = cute::size<0>(ClusterShape{});
  static constexpr int kCN = cute::size<1>(ClusterShape{});

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  struct Arguments : Base::Arguments {
    const Word* flags = nullptr;  // flags[block]; nullptr: no wait (same tile order)
    int* error = nullptr;         // with a timeout: set to 1 + block when a wait gives up
    Word target = 1;              // a block has landed once its flag holds at least this
    int blocks = 1;               // row blocks of A and D
    int slots = 0;                // how many are computed (0: all), the first `slots` of order
    uint64_t order = 0;           // slot s's row block in bits [4s, 4s+4)
    uint64_t timeout_ns = 0;      // 0: wait until the flag rises
    int ready_block = -1;         // a block there before the call (the own chunk): no wait
    GiveUp give_up;               // the library's: where its watchdog fired the call
  };
  struct Extra {
    const Word* flags;
    int* error;
    uint64_t order, timeout_ns;
    Word target;
    uint32_t units, units_per_block, rows_per_block;  // in clusters
    int ready_block;
    GiveUp give_up;
  };
  struct Params : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params {
    Extra x;
  };

  template <class ProblemMNKL, class TileShape, class CS>
  static Params to_underlying_arguments(ProblemMNKL problem, TileShape tile, CS cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& a,
                                        void* ws = nullptr, const uint32_t epi_subtile = 1,
                                        uint32_t k_align = 1u) {
    Params p;
    static_cast<cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params&>(p) =
        Base::to_underlying_arguments(problem, tile, cluster, hw, a, ws, epi_subtile, k_align);
    const int tm = cute::size<0>(tile), tn = cute::size<1>(tile);
    const uint32_t rows = (int(cute::get<0>(problem)) + tm * kCM - 1) / (tm * kCM);
    const uint32_t cols = (int(cute::get<1>(problem)) + tn * kCN - 1) / (tn * kCN);
    const uint32_t blocks = a.blocks > 0 ? uint32_t(a.blocks) : 1u;  // callers: rows % blocks == 0
    const uint32_t slots = a.slots > 0 ? uint32_t(a.slots) : blocks;
    p.x = {a.flags,
           a.error,
           a.order,
           a.timeout_ns,
           a.target,
           rows / blocks * cols * slots,
           rows / blocks * cols,
           rows / blocks,
           a.ready_block,
           a.give_up};
    return p;
  }

  CUTLASS_DEVICE explicit FlagTileScheduler(Params const& p) : Base(p), x_(p.x) {
    const dim3 grid = cute::cluster_grid_dims(), id = cute::cluster_id_in_grid();
    unit_ = id.x + grid.x * (id.y + grid.y * id.z);
    stride_ = grid.x * grid.y * grid.z;
    const dim3 in_cluster = cute::block_id_in_cluster();
    cta_m_ = int(in_cluster.x);
    cta_n_ = int(in_cluster.y);
  }

  template <class CS>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(CS) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    if (unit_ >= x_.units) return WorkTileInfo::invalid_work_tile();
    const uint32_t slot = unit_ / x_.units_per_block;
    const uint32_t within = unit_ - slot * x_.units_per_block;
    const int block = int((x_.order >> (4 * slot)) & 15u);
    const uint32_t row = block * x_.rows_per_block + within % x_.rows_per_block;
    const uint32_t col = within / x_.rows_per_block;
    Wait(block);
    return {int(row) * kCM + cta_m_, int(col) * kCN + cta_n_, 0, true};
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) { unit_ += stride_ * count; }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) {
    return fetch_next_work(w);
  }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return unit_ + stride_ * count >= x_.units;
  }

 private:
  // Only the producer warp group (0 in both kernels) waits: it issues the TMA loads, and the
  // consumers read A only from the shared memory those loads fill, so nothing of a tile is
  // read or written before its flag; the math warps skip the flag's load latency per tile.
  CUTLASS_DEVICE void Wait(int block) const {
    if (x_.flags == nullptr || block == x_.ready_block ||
        threadIdx.x >= cutlass::NumThreadsPerWarpGroup)
      return;
    AwaitFlag(x_.flags + block, x_.target, x_.error, x_.timeout_ns, 1 + block, x_.give_up);
  }

  Extra x_;
  uint32_t unit_, stride_;
  int cta_m_, cta_n_;
};

}  // namespace jax_ub::flag_gemm

namespace cutlass::gemm::kernel::detail {
template <class Word, class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<jax_ub::flag_gemm::FlagScheduler<Word>, ArchTag, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = jax_ub::flag_gemm::FlagTileScheduler<ClusterShape, Word>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace jax_ub::flag_gemm {

// A mainloop that reads one row block of A from a tensor of its own: the all-gather's own chunk,
// left where the op's input holds it instead of copied into the userbuffer first (the copy cost
// 2-3% of the op at Llama 3 8B's gate/up, tp=8). Its Params carry a second set of the base
// mainloop's, made for that block alone (own_rows x K at `own`, row-major like A): TMA reads its
// descriptor from the kernel's parameter space, so a tile of the block is loaded by the base
// mainloop itself, given that second set and the block's tiles counted from 0. With `own` null
// every tile reads A. Only where A's rows come from, nothing else, differs from the base.
template <class Base>
struct OwnBlockMainloop : Base {
  using BaseParams = typename Base::Params;
  static constexpr int kTileM = cute::size<0>(typename Base::TileShape{});
  struct Arguments : Base::Arguments {
    typename Base::ElementA const* own = nullptr;
    int own_first_row = 0;  // where the block starts in A and D: a multiple of kTileM
    int own_rows = 0;       // likewise a multiple of kTileM
  };
  struct Params : BaseParams {
    BaseParams own;
    int own_first_tile = 0, own_tiles = 0;  // in tiles of kTileM rows; 0 tiles: no such block
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void* ws) {
    Params p;
    static_cast<BaseParams&>(p) = Base::to_underlying_arguments(shape, a, ws);
    p.own = static_cast<BaseParams const&>(p);
    if (a.own != nullptr && a.own_rows > 0) {
      typename Base::Arguments own_args = a;
      own_args.ptr_A = a.own;
      const auto mnkl = cute::append<4>(shape, 1);
      p.own = Base::to_underlying_arguments(
          cute::make_shape(a.own_rows, cute::get<1>(mnkl), cute::get<2>(mnkl), cute::get<3>(mnkl)),
          own_args, ws);
      p.own_first_tile = a.own_first_row / kTileM;
      p.own_tiles = a.own_rows / kTileM;
    }
    return p;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    Base::prefetch_tma_descriptors(p);
    if (p.own_tiles > 0) Base::prefetch_tma_descriptors(p.own);
  }

  // The base's (A's and B's tiled TMA tensors), then the block's A.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, Params const& p) const {
    auto whole = Base::load_init(shape, p);
    auto own = Base::load_init(cute::make_shape(p.own_tiles * kTileM, cute::get<1>(shape),
                                                cute::get<2>(shape), cute::get<3>(shape)),
                               p.own);
    return cute::make_tuple(cute::get<0>(whole), cute::get<1>(whole), cute::get<0>(own));
  }

  // The producer's loads of one output tile: from the block's tensor where the tile is in it.
  template <class TensorA, class TensorB, class TensorOwn, class BlockCoord, class... Rest>
  CUTLASS_DEVICE void load(Params const& p, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state,
                           cute::tuple<TensorA, TensorB, TensorOwn> const& in,
                           BlockCoord const& blk, Rest&&... rest) {
    const int tile = int(cute::get<0>(blk)) - p.own_first_tile;
    if (tile >= 0 && tile < p.own_tiles) {
      Base::load(p.own, pipeline, state, cute::make_tuple(cute::get<2>(in), cute::get<1>(in)),
                 cute::make_coord(tile, cute::get<1>(blk), cute::get<2>(blk), cute::get<3>(blk)),
                 static_cast<Rest&&>(rest)...);
    } else {
      Base::load(p, pipeline, state, cute::make_tuple(cute::get<0>(in), cute::get<1>(in)), blk,
                 static_cast<Rest&&>(rest)...);
    }
  }
};

using bf16 = cutlass::bfloat16_t;

// CUTLASS's SM90 collectives for bf16 row-major A and D, fp32 accumulation, 16-byte alignment:
// the epilogue of schedule EpiSchedule (no C), and the mainloop of KernelSchedule with B of
// layout LayoutB, its stages what shared memory leaves beside Epilogue's.
template <class Tile, class Cluster, class EpiSchedule>
using Sm90Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor,
    8, bf16, cutlass::layout::RowMajor, 8, EpiSchedule>::CollectiveOp;
template <class Tile, class Cluster, class LayoutB, class Epilogue, class KernelSchedule>
using Sm90Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, cutlass::layout::RowMajor, 8, bf16,
    LayoutB, 8, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<int(
        sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

// One kernel: a TM x TN x 64 tile, clusters of CM x 1, the ping-pong or cooperative warp
// schedule, B of layout LayoutB, tiles from SchedTag's scheduler; with OwnBlock, one row block
// of A may be read from a tensor of its own (OwnBlockMainloop); with Signals, the epilogue raises
// each row block's flag once the block is written (SignalEpilogue; ping-pong only).
template <int TM, int TN, int CM, bool Pingpong, class SchedTag,
          class LayoutB = cutlass::layout::RowMajor, bool OwnBlock = false, bool Signals = false>
struct Config {
  static_assert(Pingpong || !Signals, "SignalEpilogue counts a tile per warp group: ping-pong");
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::_1, cute::_1>;
  using KernelSchedule =
      std::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpiSchedule = std::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                         cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using Epilogue =
      std::conditional_t<Signals, SignalEpilogue<Sm90Epilogue<Tile, Cluster, EpiSchedule>, TM>,
                         Sm90Epilogue<Tile, Cluster, EpiSchedule>>;
  using BuiltMainloop = Sm90Mainloop<Tile, Cluster, LayoutB, Epilogue, KernelSchedule>;
  using Mainloop = std::conditional_t<OwnBlock, OwnBlockMainloop<BuiltMainloop>, BuiltMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, SchedTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kRowUnit = TM * CM;  // a row block must be a multiple of it
  static constexpr bool kRowMajorB = std::is_same_v<LayoutB, cutlass::layout::RowMajor>;
};

// The arguments of one call of Cfg's GEMM, D[m, n] = A[m, k] @ B on `sm_count` SMs of
// `device`; with FlagScheduler, `sched` the scheduler's (flags, blocks, order...).
template <class Cfg>
typename Cfg::Gemm::Arguments MakeArguments(int m, int k, int n, const bf16* a, const bf16* b,
                                            bf16* d, int device, int sm_count) {
  using K = typename Cfg::Kernel;
  // CUTLASS's B is N x K: w[k, n] row-major is its column-major, w stored as [n, k] its row-major.
  typename K::StrideA sa = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(m) * k);
  typename K::StrideB sb{};
  if constexpr (Cfg::kRowMajorB) {
    cute::get<1>(sb) = int64_t(n);
  } else {
    cute::get<0>(sb) = int64_t(k);
  }
  cute::get<2>(sb) = int64_t(n) * k;
  typename K::StrideD sd = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(m) * n);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename Cfg::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k, 1}, {a, sa, b, sb}, {}, hw};
  // Field by field: a SignalEpilogue's arguments add a member to the base's.
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = sd;
  args.epilogue.ptr_D = d;
  args.epilogue.dD = sd;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

}  // namespace jax_ub::flag_gemm
