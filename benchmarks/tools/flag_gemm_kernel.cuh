// flag_gemm_kernel.cuh: the GEMMs of benchmarks/tools/flag_gemm.cu (its driver: data, checks,
// timing, main). A CUTLASS 4.2 SM90 bf16 GEMM, D[M,N] = A[M,K] @ B[K,N] (row-major, fp32
// accumulation), whose persistent tile scheduler waits, before each output tile, until the flag
// of the tile's row block of A reaches a target value: the GEMM side of an all-gather GEMM, where
// A arrives as `blocks` row blocks of M/blocks rows, taken in a given order (own block first).
//
// FlagTileScheduler derives from CUTLASS's PersistentTileSchedulerSm90 and keeps its own
// cluster-level work index: work unit u of the grid-stride walk belongs to block slot
// u / units_per_block, whose row block is order[slot]; inside a row block the walk goes down M
// first (the cluster rows of the block), then across N. Every warp role of the kernels asks the
// scheduler through get_current_work / fetch_next_work, so every role sees the same tile. The
// producer warp group waits there (ld.acquire.gpu poll with __nanosleep, then fence.proxy.async
// so that the TMA loads of A come after it) before it loads anything of the tile; the math warps
// only read what those loads put in shared memory. A wait longer than 2 s writes 1 + block to
// an error word and gives up (the driver then reports TIMEOUT instead of hanging).
// Also here: Config (the CUTLASS kernel types), CutlassOp (one initialized GEMM), Entry (a named
// config the driver can build with the flag scheduler or CUTLASS's stock one), and Lt, the
// cuBLASLt GEMMs the drivers compare with: the whole of D, or one contiguous span of its rows.
// CUTLASS's device-side asserts make ptxas serialize the wgmma pipeline (C7510): keep them out.
#pragma once
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_tool.h"  // the tools' checks (CUDA, cuBLASLt) and random bf16 operands
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/version.h"

namespace jax_ub_tool {
inline void Check(cutlass::Status s, const char* what) {
  if (s != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cutlass::cutlassGetStatusString(s));
    std::exit(1);
  }
}
}  // namespace jax_ub_tool
#define CHECK(x) jax_ub_tool::Check((x), #x)

// A bad argument or an unexpected state: say which and stop.
[[noreturn]] inline void Fail(const char* what, const char* msg) {
  std::fprintf(stderr, "%s: %s\n", what, msg);
  std::exit(1);
}

namespace fg {

__device__ __forceinline__ int LoadAcquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreRelease(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct FlagScheduler {};  // the tag GemmUniversal is given; TileSchedulerSelector maps it below

template <class ClusterShape>
class FlagTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kCM = cute::size<0>(ClusterShape{});
  static constexpr int kCN = cute::size<1>(ClusterShape{});

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  struct Arguments : Base::Arguments {
    const int* flags = nullptr;  // flags[block]; nullptr: no wait (same tile order)
    int* error = nullptr;        // set to 1 + block when a wait times out
    int target = 1;
    int blocks = 1;
    uint64_t order = 0;  // slot s's row block in bits [4s, 4s+4)
    uint64_t timeout_ns = 2000000000ull;
  };
  struct Extra {
    const int* flags;
    int* error;
    uint64_t order, timeout_ns;
    int target;
    uint32_t units, units_per_block, rows_per_block;  // in clusters
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
    const uint32_t blocks = a.blocks > 0 ? uint32_t(a.blocks) : 1u;
    p.x = {
        a.flags,      a.error, a.order, a.timeout_ns, a.target, rows * cols, rows / blocks * cols,
        rows / blocks};  // the tool checks rows % blocks == 0
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
    if (x_.flags == nullptr || threadIdx.x >= cutlass::NumThreadsPerWarpGroup) return;
    const int* flag = x_.flags + block;
    if (LoadAcquire(flag) < x_.target) {
      const uint64_t start = Now();
      while (LoadAcquire(flag) < x_.target) {
        __nanosleep(256);
        volatile int* error = x_.error;
        if (error != nullptr && *error != 0) break;  // another wait gave up
        if (Now() - start > x_.timeout_ns) {
          if (error != nullptr) *error = 1 + block;
          break;
        }
      }
    }
    // The data was written through the generic proxy; TMA reads through the async proxy.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  Extra x_;
  uint32_t unit_, stride_;
  int cta_m_, cta_n_;
};

}  // namespace fg

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<fg::FlagScheduler, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = fg::FlagTileScheduler<ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace fg {

using bf16 = cutlass::bfloat16_t;

template <int TM, int TN, int CM, bool Pingpong, class SchedTag>
struct Config {
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::_1, cute::_1>;
  using KernelSchedule =
      std::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpiSchedule = std::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                         cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using RowMajor = cutlass::layout::RowMajor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, 8, bf16,
      RowMajor, 8, EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, RowMajor, 8, bf16, RowMajor, 8,
      float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<int(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, SchedTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

struct Problem {
  int m, k, n, blocks;
  uint64_t order;
  int sm_count;
};

struct Op {  // one initialized GEMM (fixed pointers); run() enqueues one call
  virtual ~Op() = default;
  virtual void Run(cudaStream_t s) = 0;
};

template <class Cfg>
struct CutlassOp : Op {
  typename Cfg::Gemm gemm;
  CutlassOp(const Problem& p, const bf16* a, const bf16* b, bf16* d, const int* flags, int* err) {
    using K = typename Cfg::Kernel;
    typename K::StrideA sa = cute::make_stride(int64_t(p.k), cute::Int<1>{}, int64_t(p.m) * p.k);
    typename K::StrideB sb = cute::make_stride(cute::Int<1>{}, int64_t(p.n), int64_t(p.n) * p.k);
    typename K::StrideD sd = cute::make_stride(int64_t(p.n), cute::Int<1>{}, int64_t(p.m) * p.n);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = p.sm_count;
    typename Cfg::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                       {p.m, p.n, p.k, 1},
                                       {a, sa, b, sb},
                                       {{}, nullptr, sd, d, sd},
                                       hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    if constexpr (std::is_same_v<typename K::TileSchedulerTag, FlagScheduler>) {
      args.scheduler.flags = flags;
      args.scheduler.error = err;
      args.scheduler.blocks = p.blocks;
      args.scheduler.order = p.order;
    }
    if (Cfg::Gemm::get_workspace_size(args) != 0) Fail("workspace", "unexpected");
    CHECK(gemm.can_implement(args));
    CHECK(gemm.initialize(args, nullptr));
  }
  void Run(cudaStream_t s) override { CHECK(gemm.run(s)); }
};

struct ConfigEntry {
  const char* name;
  int row_unit;  // tile M * cluster M: a row block must be a multiple of it
  std::function<std::unique_ptr<Op>(const Problem&, const bf16*, const bf16*, bf16*, const int*,
                                    int*, bool stock)>
      make;
};

template <int TM, int TN, int CM, bool PP>
ConfigEntry Entry(const char* name) {
  return {name, TM * CM,
          [](const Problem& p, const bf16* a, const bf16* b, bf16* d, const int* f, int* e,
             bool stock) -> std::unique_ptr<Op> {
            if (stock)
              return std::make_unique<
                  CutlassOp<Config<TM, TN, CM, PP, cutlass::gemm::PersistentScheduler>>>(p, a, b, d,
                                                                                         f, e);
            return std::make_unique<CutlassOp<Config<TM, TN, CM, PP, FlagScheduler>>>(p, a, b, d, f,
                                                                                      e);
          }};
}

// cuBLASLt, row-major D = A B described column-major as D^T[n,m] = B^T[n,k] A^T[k,m]; a plan
// (layouts, the heuristic's first pick) per row span [row0, row0 + rows) of A and D.
struct LtSpan {
  int row0, rows;
  cublasLtMatrixLayout_t la, ld;
  cublasLtMatmulAlgo_t algo;
};
struct Lt {
  const Problem& p;
  const bf16* b;
  void* ws;
  size_t ws_size;
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lb = nullptr;
  int sm_target = 0;  // > 0: the SMs cuBLASLt may use (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET)
  void Create() {
    CHECK(cublasLtCreate(&h));
    CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (sm_target > 0)
      CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target,
                                           sizeof(sm_target)));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.n, p.k, p.n));
  }
  LtSpan Plan(int row0, int rows) {
    LtSpan s{row0, rows, nullptr, nullptr, {}};
    CHECK(cublasLtMatrixLayoutCreate(&s.la, CUDA_R_16BF, p.k, rows, p.k));
    CHECK(cublasLtMatrixLayoutCreate(&s.ld, CUDA_R_16BF, p.n, rows, p.n));
    uint32_t align = 256;  // of the span's A and D pointers (cudaMalloc's are 256-aligned)
    while (align > 2 && (int64_t(row0) * p.k * 2 % align || int64_t(row0) * p.n * 2 % align))
      align /= 2;
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ws_size, sizeof(ws_size)));
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(h, desc, lb, s.la, s.ld, s.ld, pref, 1, &heur, &found));
    if (found < 1) Fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm");
    CHECK(cublasLtMatmulPreferenceDestroy(pref));
    s.algo = heur.algo;
    return s;
  }
  void Run(const LtSpan& s, const bf16* a, bf16* d, cudaStream_t st) const {
    const float one = 1.0f, zero = 0.0f;
    bf16* ds = d + int64_t(s.row0) * p.n;
    CHECK(cublasLtMatmul(h, desc, &one, b, lb, a + int64_t(s.row0) * p.k, s.la, &zero, ds, s.ld, ds,
                         s.ld, &s.algo, ws, ws_size, st));
  }
  void Destroy(std::vector<LtSpan>& spans) {
    for (auto& s : spans)
      for (auto l : {s.la, s.ld}) CHECK(cublasLtMatrixLayoutDestroy(l));
    CHECK(cublasLtMatrixLayoutDestroy(lb));
    CHECK(cublasLtMatmulDescDestroy(desc));
    CHECK(cublasLtDestroy(h));
  }
};

}  // namespace fg
