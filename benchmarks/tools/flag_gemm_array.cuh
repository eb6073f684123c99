// flag_gemm_array.cuh: a prototype of the flag GEMM that reads the own block in place (not in the
// library). FlagGemm (src/cuda/gemm/flag_gemm_kernel.cuh) reads one A tensor, so the library
// copies its own chunk into the userbuffer first (2-3% of the op at Llama 3 8B's gate/up,
// tp=8). Here each row block is a batch of CUTLASS's ptr-array GEMM, with A and D pointers of its
// own (the own block anywhere, the others in the buffer), in the order they land: the default
// persistent scheduler walks the batches in order, and the mainloop's producer waits for batch
// l's flag before its TMA loads (FlagArrayMainloop). Its grouped sibling would take a custom
// scheduler, which CUTLASS 4.2's ptr-array kernels refuse. Timed by paced_gemm (flag_array).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "flag_gemm_kernel.cuh"

namespace fg {

// CUTLASS's ptr-array mainloop whose producer waits, before loading a tile of batch l, until
// flags[block_of[l]] >= target (at most timeout_ns, then 1 + the flag's index into *error).
template <class Base>
struct FlagArrayMainloop : Base {
  struct FlagWait {
    const int* flags = nullptr;     // nullptr: no wait
    const int* block_of = nullptr;  // device: batch -> flag index
    int* error = nullptr;
    int target = 1;
    uint64_t timeout_ns = 2000000000ull;
  };
  struct Arguments : Base::Arguments {
    FlagWait wait;
  };
  struct Params : Base::Params {
    FlagWait wait;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape shape, Arguments const& a, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, a, workspace);
    p.wait = a.wait;
    return p;
  }

  // The kernel's producer warp calls this per tile; its TMA loads come after the wait.
  template <class Pipeline, class State, class Inputs, class Maps, class BlockCoord, class... Rest>
  CUTLASS_DEVICE void load(Params const& p, Pipeline pipeline, State state, Inputs const& inputs,
                           Maps const& maps, BlockCoord const& blk, Rest&&... rest) {
    const FlagWait& w = p.wait;
    if (w.flags != nullptr) {
      const int index = w.block_of[int(cute::get<3>(blk))];
      jax_ub::flag_gemm::AwaitFlag(w.flags + index, w.target, w.error, w.timeout_ns, 1 + index);
    }
    Base::load(p, pipeline, state, inputs, maps, blk, static_cast<Rest&&>(rest)...);
  }
};

// 128 x 128 x 64 tiles, clusters of 2 x 1, the ping-pong schedule (the library's FlagGemm's).
struct ArrayConfig {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Epilogue =
      jax_ub::flag_gemm::Sm90Epilogue<Tile, Cluster,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
  using BaseMainloop =
      jax_ub::flag_gemm::Sm90Mainloop<Tile, Cluster, cutlass::layout::RowMajor, Epilogue,
                                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>;
  using Mainloop = FlagArrayMainloop<BaseMainloop>;
  using Shape = cutlass::gemm::ArrayProblemShape<cute::Shape<int, int, int, int>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// One initialized GEMM of `batches` row blocks of `rows` rows: batch l reads a_ptrs[l] and
// writes d_ptrs[l] (device arrays), waiting for flags[block_of[l]].
struct ArrayOp : Op {
  ArrayConfig::Gemm gemm;
  void* workspace = nullptr;
  ArrayOp(int rows, int k, int n, int batches, int sm_count, const bf16** a_ptrs,
          const bf16** b_ptrs, bf16** d_ptrs, const int* flags, const int* block_of, int* err) {
    using K = ArrayConfig::Kernel;
    typename K::StrideA sa = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(0));
    typename K::StrideB sb = cute::make_stride(cute::Int<1>{}, int64_t(n), int64_t(0));
    typename K::StrideD sd = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(0));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename ArrayConfig::Mainloop::Arguments mainloop;
    mainloop.ptr_A = a_ptrs;
    mainloop.dA = sa;
    mainloop.ptr_B = b_ptrs;
    mainloop.dB = sb;
    mainloop.wait.flags = flags;
    mainloop.wait.block_of = block_of;
    mainloop.wait.error = err;
    typename ArrayConfig::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kArray,
                                               {{rows, n, k, batches}},
                                               mainloop,
                                               {{}, nullptr, sd, d_ptrs, sd},
                                               hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    const size_t ws = ArrayConfig::Gemm::get_workspace_size(args);
    if (ws) CHECK(cudaMalloc(&workspace, ws));
    CHECK(gemm.can_implement(args));
    CHECK(gemm.initialize(args, workspace));
  }
  ~ArrayOp() override {
    if (workspace) cudaFree(workspace);
  }
  void Run(cudaStream_t s) override { CHECK(gemm.run(s)); }
};

// paced_gemm's ArrayOp: `blocks` row blocks of `rows` rows, batch 0 the own block read from
// `own`, batch l > 0 block landing[l - 1] of a; d's blocks in place. Owns its pointer arrays.
struct PacedArray {
  std::unique_ptr<ArrayOp> op;
  void* words = nullptr;  // A, B and D pointers per batch, then each batch's flag index
  PacedArray(int rows, int k, int n, int blocks, int sm_count, const bf16* a, const bf16* own,
             const bf16* b, bf16* d, int rank, const int* landing, const int* flags, int* err) {
    std::vector<const bf16*> pa(blocks), pb(blocks, b);
    std::vector<bf16*> pd(blocks);
    std::vector<int> block_of(blocks);
    for (int l = 0; l < blocks; ++l) {
      const int blk = l == 0 ? rank : landing[l - 1];
      pa[l] = l == 0 ? own : a + int64_t(blk) * rows * k;
      pd[l] = d + int64_t(blk) * rows * n;
      block_of[l] = blk;
    }
    const size_t ptr_bytes = blocks * sizeof(void*);
    CHECK(cudaMalloc(&words, 3 * ptr_bytes + blocks * sizeof(int)));
    char* w = static_cast<char*>(words);
    CHECK(cudaMemcpy(w, pa.data(), ptr_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w + ptr_bytes, pb.data(), ptr_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w + 2 * ptr_bytes, pd.data(), ptr_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w + 3 * ptr_bytes, block_of.data(), blocks * sizeof(int),
                     cudaMemcpyHostToDevice));
    op = std::make_unique<ArrayOp>(rows, k, n, blocks, sm_count, reinterpret_cast<const bf16**>(w),
                                   reinterpret_cast<const bf16**>(w + ptr_bytes),
                                   reinterpret_cast<bf16**>(w + 2 * ptr_bytes), flags,
                                   reinterpret_cast<const int*>(w + 3 * ptr_bytes), err);
  }
  ~PacedArray() {
    op.reset();
    if (words) CHECK(cudaFree(words));
  }
};

}  // namespace fg
