// The settings a communicator is created with, fixed for its lifetime: the C++ form of
// jax_ub's Python `Options` (jax_ub/_src/options.py), field for field and name for name.
// Python validates the user's values where they enter (configure, environment); the
// modules convert the dict Python passes with bindings/nb_helpers.h's OptionsFromDict, which
// refuses values that would break the protocol for direct callers too.
#pragma once

#include <cstdint>
#include <string>

namespace jax_ub {

// How a row-major GEMM is described to cuBLASLt, which offers different kernels for each.
// kAuto: with autotuning, time both descriptions' candidates; without, kColumn.
enum class GemmOrder { kAuto = 0, kColumn = 1, kRow = 2 };

// A choice of schedule that is on, off, or made per call by its shape: whether the
// all-gather pushes to one peer at a time (Schedule::in_turn, AllGatherInTurn), whether the
// reduce-scatter sums early partials beside its GEMMs (Schedule::early_sum,
// ReduceScatterSumsEarly).
enum class ScheduleChoice { kByShape = 0, kOff = 1, kOn = 2 };

struct CommOptions {
  double timeout_s;                  // every wait on a peer ends in an error after this
  bool allow_tf32;                   // float32 GEMMs may use TF32 tensor cores (CUDA)
  bool autotune_gemm;                // time cuBLASLt's candidates once per shape (CUDA)
  bool gemm_hold_first_pick;         // tuning keeps cuBLASLt's first pick unless clearly beaten
  bool autotune_reduce_scatter;      // with autotune_gemm, the reduce-scatter's non-fp8 GEMMs too
  GemmOrder gemm_order;              // (CUDA)
  int gemm_trials;                   // tuning's fastest kernels the op's own calls compare (CUDA)
  int64_t reduce_scatter_fold_rows;  // Schedule::fold_rows; the same on every rank of a group
  bool reduce_scatter_ring;          // Schedule::ring; the same on every rank of a group
  ScheduleChoice reduce_scatter_early_sum;    // Schedule::early_sum; each rank may choose its own
  ScheduleChoice all_gather_in_turn;          // Schedule::in_turn; each rank may choose its own
  ScheduleChoice two_gemm_lanes;              // Schedule::gemm_lanes; each rank may choose its own
  ScheduleChoice all_gather_flag_gemm;        // Schedule::flag_gemm; each rank may choose its own
  ScheduleChoice reduce_scatter_signal_gemm;  // Schedule::signal_gemm; each rank may choose its own
  bool compute_on_caller_stream;  // the compute lane is XLA's stream, not one of ours (CUDA)
  bool fp8_fast_accumulation;     // e4m3 x e4m3 GEMMs in cuBLASLt's FAST_ACCUM mode (CUDA)
  std::string gemm_cache;         // the kernel choice file, "" none (CUDA, with autotune_gemm)
};

}  // namespace jax_ub
