// solo_run.h: solo_schedule.cu's run: one rank's operands, userbuffer, lanes and GEMM plans on
// one GPU, with its peers' rows in place, and graphs of its calls. Not part of the library.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/sum.h"
#include "cuda_tool.h"
#include "protocol/buffer_layout.h"
#include "protocol/schedule.h"
#include "solo_link.h"

namespace solo {

using jax_ub_tool::Check;
using jax_ub_tool::FillRandom;

struct Run {
  jax_ub::OpKind op;
  jax_ub::CallShape shape;
  int tp;
  jax_ub::Schedule sched;  // rank 0's, in a group of tp
  std::vector<jax_ub::Step> steps;
  jax_ub::Operands ops;
  char* buffer = nullptr;        // this rank's userbuffer, the peers' rows in place
  char* peer_scratch = nullptr;  // where a step addressing a peer's buffer writes
  jax_ub::CublasLtGemm* gemm = nullptr;
  std::vector<jax_ub::CublasLtGemm::Plan*> plans;  // per step (GEMMs only)
  jax_ub::CublasLtGemm::Plan* whole = nullptr;     // the bound's GEMM
  __nv_bfloat16 *whole_x = nullptr, *whole_out = nullptr;
  cudaStream_t compute = nullptr;
  std::vector<cudaStream_t> lanes;  // a copy lane per rank: only joins run there
  cudaStream_t second = nullptr;    // the second GEMM lane (jax_ub::kSecondGemmLane)
  cudaEvent_t join = nullptr;       // a lane's work so far, for another lane to wait on
  cudaEvent_t begin = nullptr, end = nullptr;
  HostLink* link = nullptr;         // paced: the partials land as it raises their flags
  uint64_t* block_flags = nullptr;  // the signal GEMM's, unpaced (paced: the link's Done words)
  unsigned long long* counts = nullptr;  // the signal GEMM's tile counters
  int sm_count = 0;
  const jax_ub::DriverOps* driver = nullptr;
  uint64_t epoch = 0;  // calls so far: the link's flags and our Done words carry it
  // Graphs (the `graphs` timings): each GEMM step's cuBLASLt call captured alone (by step;
  // null for other steps), launched in its place by Schedule(r, true); and the whole call.
  std::vector<cudaGraphExec_t> gemm_graphs;
  cudaGraphExec_t call_graph = nullptr;
};

inline char* At(Run& r, const jax_ub::Ref& ref) {
  return jax_ub::Resolve(ref, r.ops, r.buffer, [&](int) { return r.peer_scratch; });
}

inline cudaStream_t Lane(Run& r, int lane) {
  if (lane == jax_ub::kComputeLane) return r.compute;
  return lane == jax_ub::kSecondGemmLane ? r.second : r.lanes[lane];
}

inline jax_ub::GemmArgs Args(Run& r, const jax_ub::Step& g) {
  jax_ub::GemmArgs args;
  args.addend = At(r, g.addend);
  args.second_workspace = g.lane == jax_ub::kSecondGemmLane;
  return args;
}

inline void Setup(Run& r) {
  const jax_ub::CallShape& s = r.shape;
  const int64_t x_rows = r.op == jax_ub::OpKind::kAllGatherMatmul ? s.m : r.tp * s.m;
  const int64_t out_rows = r.op == jax_ub::OpKind::kAllGatherMatmul ? r.tp * s.m : s.m;
  __nv_bfloat16 *x, *w, *out;
  Check(cudaMalloc(&x, x_rows * s.k * 2), "x");
  Check(cudaMalloc(&w, s.k * s.n * 2), "w");
  Check(cudaMalloc(&out, out_rows * s.n * 2), "out");
  const int64_t bytes = jax_ub::RequiredBytes(r.op, s, r.sched);
  Check(cudaMalloc(&r.buffer, bytes), "userbuffer");
  Check(cudaMalloc(&r.peer_scratch, bytes), "peer scratch");
  Check(cudaMalloc(&r.whole_x, r.tp * s.m * s.k * 2), "whole x");
  Check(cudaMalloc(&r.whole_out, r.tp * s.m * s.n * 2), "whole out");
  Check(cudaStreamCreateWithFlags(&r.compute, cudaStreamNonBlocking), "stream");
  r.lanes.resize(r.tp);
  for (cudaStream_t& lane : r.lanes)
    Check(cudaStreamCreateWithFlags(&lane, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithFlags(&r.second, cudaStreamNonBlocking), "stream");
  Check(cudaEventCreateWithFlags(&r.join, cudaEventDisableTiming), "event");
  Check(cudaEventCreate(&r.begin), "event");
  Check(cudaEventCreate(&r.end), "event");
  FillRandom(x, x_rows * s.k, 1, 1.0f, r.compute);
  FillRandom(w, s.k * s.n, 2, 0.01f, r.compute);
  FillRandom(r.whole_x, r.tp * s.m * s.k, 3, 1.0f, r.compute);
  // The peers' rows (AG) or partials (RS), as they would have landed.
  FillRandom(reinterpret_cast<__nv_bfloat16*>(r.buffer), bytes / 2, 4, 1.0f, r.compute);
  Check(cudaStreamSynchronize(r.compute), "fill");
  r.ops.x = x;
  r.ops.w = w;
  r.ops.out = out;
  jax_ub::GemmOptions options;  // tuned as the op's first call tunes; no in-op trials
  options.trials = 0;
  Check(jax_ub::CublasLtGemm::Create(options, &r.gemm), "CublasLtGemm::Create");
  r.plans.assign(r.steps.size(), nullptr);
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const jax_ub::Step& g = r.steps[i];
    if (g.kind != jax_ub::Step::Kind::kGemm || g.signals) continue;
    if (g.lane == jax_ub::kSecondGemmLane)
      Check(r.gemm->AddSecondWorkspace(), "AddSecondWorkspace");
    Check(r.gemm->Prepare(s.in, s.w_type, s.out, At(r, g.src), w, false, At(r, g.dst), g.rows, s.k,
                          s.n, jax_ub::Epilogue{}, Args(r, g), r.compute, &r.plans[i]),
          "Prepare (step)");
  }
  Check(r.gemm->Prepare(jax_ub::DType::kBF16, r.whole_x, w, false, r.whole_out, r.tp * s.m, s.k,
                        s.n, nullptr, r.compute, &r.whole),
        "Prepare (whole)");
  Check(jax_ub::PreloadSumKernels(), "PreloadSumKernels");
  Check(cudaMalloc(&r.block_flags, jax_ub::kFlagGemmMaxBlocks * sizeof(uint64_t)), "flags");
  Check(cudaMalloc(&r.counts, jax_ub::kFlagGemmMaxBlocks * sizeof(unsigned long long)), "counts");
  Check(cudaMemset(r.block_flags, 0, jax_ub::kFlagGemmMaxBlocks * sizeof(uint64_t)), "flags");
  Check(cudaMemset(r.counts, 0, jax_ub::kFlagGemmMaxBlocks * sizeof(unsigned long long)), "counts");
  Check(cudaDeviceGetAttribute(&r.sm_count, cudaDevAttrMultiProcessorCount, 0), "SM count");
  Check(jax_ub::PreloadFlagGemms(), "PreloadFlagGemms");
}

// `body`'s work on `stream` (and on the streams it forks from it and joins back), captured
// once and instantiated: a graph launch then replays it with one CUDA call.
template <typename Body>
cudaGraphExec_t CaptureGraph(cudaStream_t stream, Body body) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  body();
  Check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  Check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  Check(cudaGraphDestroy(graph), "cudaGraphDestroy");
  return exec;
}

}  // namespace solo
