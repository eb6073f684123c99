// One rank's compute schedule of an overlapped op at tp = 2..8 on ONE GPU, as if its peers
// were there: the very step list the CUDA communicator enqueues (CallSteps, rank 0 of a
// group of `tp`), with its GEMMs (jax_ub's CublasLtGemm, tuned as in the op), the
// reduce-scatter's sums and the joins between lanes, while the flag waits, descriptors,
// signals, copies and the check are left out: the peers' rows (AG) and partials (RS) are
// in this GPU's userbuffer from the start. Timed against the GEMM of the whole per-rank
// work (the no-communication bound's: AG [tp*m, k] @ [k, n], RS [tp*m, k] @ [k, n]), calls of
// the two interleaved one by one for `seconds` each, 3 rounds, median: what chunking (and the
// sums) cost the compute side, with no second GPU. Not part of the library.
//
// `ring` (RS, the last argument) times the library's ring reduce-scatter (Tuning's
// reduce_scatter_ring, off by default; fold_rows as for tp=2) beside its default: rank r's
// step s multiplies block (r - s - 1) mod tp with the partial sum of that block from rank
// r - 1 as its addend (C, beta = 1) and passes it on to rank r + 1; its last step, its own
// block, writes the output. No sum pass, but each GEMM after the first reads a partial sum.
//
// `one_pass` and `early` (RS) time the library's reduce-scatter with Tuning's
// reduce_scatter_early_sum off and on: at tp >= 4 every partial summed after the GEMMs in one
// pass, or the early ones beside them on a copy lane (`steps`: chosen by shape, the default).
//
// `merged` (RS) tries fewer, larger GEMMs before the library has them: the default step list
// with each run of GEMMs over consecutive row blocks (peers' partials whose inputs and staging
// slots lie back to back) merged into one GEMM of at least `merge_rows` rows where it can.
// Each partial then leaves after the GEMM of its run, not of its own block.
//
// With a link rate (`gbps`, RS steps, one_pass, early or merged), the partials addressed to this
// rank land as a modelled link would deliver them (solo_link.h): the list's waits for them run, and
// the op is timed against its floor, the later of the whole GEMM and the last landing had its GEMMs
// run at the whole GEMM's pace, plus the sum pass.
//
// `signal` (RS) times the library's reduce-scatter with Tuning's reduce_scatter_signal_gemm on:
// every partial from one CUTLASS GEMM (SignalGemm) that raises each peer's block's flag as the
// block is written; with a link rate the flag is the link's Done word, so each partial leaves
// when its block is written, not when a GEMM ends. Needs CUTLASS's headers at build time.
//
// Every schedule is also timed with each GEMM step launched from a graph of its cuBLASLt call
// (captured once: one CUDA call a GEMM, where cublasLtMatmul costs the host some 11-20 us), and,
// unpaced and without the signal GEMM, as the whole call replayed from one graph: the GPU's side
// of the schedule with almost no host's. All are timed as enqueued and gated (timed_calls.h).
//
// `in_turn` (AG) times the library's all-gather in turn (Tuning's all_gather_in_turn, chosen by
// shape; `steps` is all at once): after the local chunk, GEMMs over the chunks in the order they
// land, each taking those the library's model has landed by its start (Schedule::InTurnSpans).
//
// Usage: solo_schedule ag|rs tp m,k,n [seconds] [fold_rows]
//        [steps|one_pass|early|ring|merged|signal|in_turn] [merge_rows] [gbps]
//   m: one rank's rows (AG: x's rows; RS: the output's); k, n: the rank's GEMM's.
//   fold_rows: reduce_scatter_fold_rows (default 2048, the library's; tp=2, or ring).
//   steps: the library's default step list; one_pass, early: early sums off, on (RS only); ring:
//   with reduce_scatter_ring (RS only); merged: see above (RS only; merge_rows, default 2048);
//   signal: with reduce_scatter_signal_gemm (RS only, tp >= 3);
//   in_turn: AG only. Each may end in :1lane or :2lanes: its GEMMs on one lane or taking turns
//   on two (Schedule::gemm_lanes; default: the library's choice by shape).
//   gbps: RS steps, one_pass, early, merged or signal only, the modelled link's GB/s into a GPU (0:
//   none, every partial in place from the start).
// e.g. Llama 3 8B gate/up at tp=4, 8192 tokens: solo_schedule ag 4 2048,4096,7168
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/gemm/block_gemm_calls.h"
#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/sum.h"
#include "cuda_tool.h"
#include "protocol/buffer_layout.h"
#include "protocol/schedule.h"
#include "solo_link.h"
#include "solo_merge.h"
#include "solo_run.h"
#include "sum_unrolled.cuh"
#include "timed_calls.h"

namespace {

using jax_ub_tool::Check;
using solo::Args;
using solo::At;
using solo::Lane;
using solo::Run;

// The signal GEMM's step as the library enqueues it (jax_ub::SignalCall); paced, block j's flag
// is the link's Done word of step j.
void SignalGemm(Run& r, const jax_ub::Step& g, cudaStream_t stream, uint64_t epoch) {
  uint64_t* flags =
      r.link != nullptr ? reinterpret_cast<uint64_t*>(r.link->Done(0)) : r.block_flags;
  const jax_ub::SignalGemmCall c = jax_ub::SignalCall(
      r.sched, g, r.shape, r.ops.w, false, At(r, g.src), At(r, g.dst), flags, r.counts, epoch);
  Check(jax_ub::LaunchSignalGemm(c, 0, r.sm_count, stream), "LaunchSignalGemm");
}

// Paced: after a GEMM of partials for peers, tell the link which of our steps have ended (the
// partial for peer d, staged at slot tp + d of the buffer, is rank 0's step d).
void MarkDone(Run& r, const jax_ub::Step& g, cudaStream_t stream, uint64_t epoch) {
  const int64_t partial = jax_ub::ChunkBytes(r.op, r.shape);
  if (g.dst.region != jax_ub::Region::kBuffer || g.dst.offset / partial < r.tp) return;
  const int64_t first = g.dst.offset / partial - r.tp;
  for (int64_t d = first; d < first + g.rows / r.shape.m; ++d)
    Check(r.driver->write(reinterpret_cast<CUstream>(stream), r.link->Done(static_cast<int>(d)),
                          epoch, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64 of a Done word");
}

// GEMM step i on `stream`, as the library runs it.
void StepGemm(Run& r, size_t i, cudaStream_t stream) {
  const jax_ub::Step& g = r.steps[i];
  Check(r.gemm->Matmul(r.plans[i], At(r, g.src), r.ops.w, At(r, g.dst), stream, Args(r, g)),
        "Matmul");
}

// One call of the schedule: its compute-side steps, on their lanes; with `gemm_graphs`, each
// GEMM step launched from its graph where it has one.
void Schedule(Run& r, bool gemm_graphs = false) {
  const uint64_t epoch = ++r.epoch;
  // Each copy lane starts after the call's start, as the library's lanes do.
  Check(cudaEventRecord(r.join, r.compute), "record");
  for (cudaStream_t lane : r.lanes) Check(cudaStreamWaitEvent(lane, r.join), "wait");
  Check(cudaStreamWaitEvent(r.second, r.join), "wait");
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const jax_ub::Step& step = r.steps[i];
    cudaStream_t stream = Lane(r, step.lane);
    switch (step.kind) {
      case jax_ub::Step::Kind::kGemm:
        if (step.signals) {
          SignalGemm(r, step, stream, epoch);
          break;
        }
        if (gemm_graphs && r.gemm_graphs[i] != nullptr)
          Check(cudaGraphLaunch(r.gemm_graphs[i], stream), "cudaGraphLaunch (a GEMM)");
        else
          StepGemm(r, i, stream);
        if (r.link != nullptr) MarkDone(r, step, stream, epoch);
        break;
      case jax_ub::Step::Kind::kWait:
        if (r.link != nullptr && step.flag == jax_ub::Flag::kData)
          Check(r.driver->wait(reinterpret_cast<CUstream>(stream), r.link->Flag(step.peer), epoch,
                               CU_STREAM_WAIT_VALUE_GEQ),
                "cuStreamWaitValue64 on the link's flag");
        break;
      case jax_ub::Step::Kind::kSum:
        Check(jax_ub::LaunchSumStep(r.shape.out, step, r.shape.n, At(r, step.src),
                                    At(r, step.addend), At(r, step.dst), stream),
              "LaunchSumStep");
        break;
      case jax_ub::Step::Kind::kJoin:
        // Recorded and waited for at once: the wait takes the event as it stands now.
        Check(cudaEventRecord(r.join, Lane(r, step.on_lane)), "record");
        Check(cudaStreamWaitEvent(stream, r.join), "wait");
        break;
      default:  // descriptors, signals, copies and the check: the peers' side (unpaced: waits)
        break;
    }
  }
  for (cudaStream_t lane : r.lanes) {  // the copy lanes end in the caller's stream
    Check(cudaEventRecord(r.join, lane), "record");
    Check(cudaStreamWaitEvent(r.compute, r.join), "wait");
  }
}

// The reduce-scatter's sum pass alone, as the step list runs it: tp partials of m x n in the
// buffer summed into the output.
void SumAlone(Run& r) {
  Check(jax_ub::LaunchSum(r.shape.out, r.buffer, r.shape.m * r.shape.n, r.tp, r.ops.out, r.compute),
        "LaunchSum");
}

void SumUnrolledAlone(Run& r) {
  const int64_t nvec = r.shape.m * r.shape.n / 8;  // the tool's shapes: n a multiple of 8
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((nvec + threads - 1) / threads, 132 * 8));
  const uint4* parts = reinterpret_cast<const uint4*>(r.buffer);
  uint4* out = static_cast<uint4*>(r.ops.out);
  LaunchUnrolled<2>(r.tp, blocks, threads, r.compute, parts, nvec, out);
  Check(cudaGetLastError(), "SumUnrolled launch");
}

void Whole(Run& r) {
  Check(r.gemm->Matmul(r.whole, r.whole_x, r.ops.w, r.whole_out, r.compute), "Matmul (whole)");
}

// ms per iteration of `body` over `iters` iterations enqueued back to back.
template <typename Body>
double Time(Run& r, Body body, int iters) {
  Check(cudaEventRecord(r.begin, r.compute), "record");
  for (int i = 0; i < iters; ++i) body(r);
  Check(cudaEventRecord(r.end, r.compute), "record");
  Check(cudaEventSynchronize(r.end), "sync");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, r.begin, r.end), "elapsed");
  return ms / iters;
}

}  // namespace

int main(int argc, char** argv) {
  long long m = 0, k = 0, n = 0;
  if (argc < 4 || (std::strcmp(argv[1], "ag") != 0 && std::strcmp(argv[1], "rs") != 0) ||
      std::sscanf(argv[3], "%lld,%lld,%lld", &m, &k, &n) != 3) {
    std::fprintf(stderr,
                 "usage: %s ag|rs tp m,k,n [seconds] [fold_rows] "
                 "[steps|one_pass|early|ring|merged|signal|in_turn] [merge_rows] [gbps]\n",
                 argv[0]);
    return 2;
  }
  // A variant's ":1lane" or ":2lanes" forces its GEMM lanes (Schedule::gemm_lanes).
  std::string variant = argc > 6 ? argv[6] : "steps";
  const size_t colon = variant.find(':');
  const std::string lanes = colon == std::string::npos ? "" : variant.substr(colon + 1);
  variant = variant.substr(0, colon);
  if (lanes != "" && lanes != "1lane" && lanes != "2lanes") {
    std::fprintf(stderr, "a schedule's lanes must be :1lane or :2lanes; got %s\n", argv[6]);
    return 2;
  }
  const bool rs = argv[1][0] == 'r';
  if (variant != "steps" &&
      !(rs && (variant == "ring" || variant == "merged" || variant == "one_pass" ||
               variant == "early" || variant == "signal")) &&
      !(!rs && variant == "in_turn")) {
    std::fprintf(
        stderr,
        "the schedule must be steps, for rs one_pass, early, ring, merged or signal, for ag "
        "in_turn; got %s %s\n",
        argv[1], variant.c_str());
    return 2;
  }
  const long long merge_rows = argc > 7 ? std::atoll(argv[7]) : 2048;
  const double gbps = argc > 8 ? std::atof(argv[8]) : 0.0;
  const int tp = std::atoi(argv[2]);
  const double seconds = argc > 4 ? std::atof(argv[4]) : 1.0;
  const long long fold_rows = argc > 5 ? std::atoll(argv[5]) : 2048;
  if (tp < 2 || tp > 8 || m < 1 || k < 1 || n < 1) {
    std::fprintf(stderr, "tp must be 2..8 and m, k, n positive; got tp=%d m=%lld k=%lld n=%lld\n",
                 tp, m, k, n);
    return 2;
  }
  Run r;
  r.op =
      argv[1][0] == 'a' ? jax_ub::OpKind::kAllGatherMatmul : jax_ub::OpKind::kMatmulReduceScatter;
  r.tp = tp;
  r.shape.m = m;
  r.shape.k = k;
  r.shape.n = n;
  r.shape.in = r.shape.w_type = r.shape.out = jax_ub::DType::kBF16;
  r.sched = jax_ub::Schedule{
      0,
      tp,
      fold_rows,
      variant == "ring",
      variant == "in_turn" ? jax_ub::ScheduleChoice::kOn : jax_ub::ScheduleChoice::kOff,
      variant == "one_pass" ? jax_ub::ScheduleChoice::kOff
      : variant == "early"  ? jax_ub::ScheduleChoice::kOn
                            : jax_ub::ScheduleChoice::kByShape};
  // Library GEMMs for the all-gather: paced_gemm.cu times the flag GEMM, at a link's pace.
  r.sched.flag_gemm = jax_ub::ScheduleChoice::kOff;
  if (variant == "signal") {
    if (!jax_ub::FlagGemmBuilt() || tp < 3) {
      std::fprintf(stderr, "signal needs tp >= 3 (got %d) and CUTLASS's headers at build time\n",
                   tp);
      return 2;
    }
    r.sched.signal_gemm = jax_ub::ScheduleChoice::kOn;
  }
  if (lanes != "")
    r.sched.gemm_lanes =
        lanes == "2lanes" ? jax_ub::ScheduleChoice::kOn : jax_ub::ScheduleChoice::kOff;
  r.steps = jax_ub::CallSteps(r.op, r.sched, r.shape);
  if (variant == "merged") r.steps = solo::MergeGemms(std::move(r.steps), r.shape, merge_rows);
  bool sums = false;
  for (const jax_ub::Step& st : r.steps) sums = sums || st.kind == jax_ub::Step::Kind::kSum;
  if (gbps < 0 || (gbps > 0 && !(rs && sums))) {
    std::fprintf(
        stderr,
        "a link rate (gbps %g) needs rs with a sum pass: steps, one_pass, early, merged or "
        "signal, and at tp=2 fold_rows -1\n",
        gbps);
    return 2;
  }
  Check(cudaSetDevice(0), "cudaSetDevice");
  Setup(r);
  // A partial's time on the link: bytes / (GB/s) is ns.
  const double transfer_us = gbps > 0 ? m * n * 2 / gbps * 1e-3 : 0.0;
  if (gbps > 0) {
    Check(jax_ub::LoadDriverOps(&r.driver), "LoadDriverOps");
    r.link = new solo::HostLink(tp, transfer_us);
  }
  int gemms = 0;
  for (const jax_ub::Step& s : r.steps) gemms += s.kind == jax_ub::Step::Kind::kGemm;
  std::printf(
      "%s (%s) tp=%d, a rank's m=%lld k=%lld n=%lld: %d GEMMs a call, the bound's GEMM "
      "%lldx%lldx%lld\n",
      argv[1], variant.c_str(), tp, m, k, n, gemms, tp * m, k, n);
  // Graphs: each GEMM step's cuBLASLt call captured alone, and the whole call where nothing in
  // it carries the call's epoch (unpaced, without the signal GEMM), its second GEMM lane joined
  // back into the compute lane at its end (every lane a capture forks must end joined).
  r.gemm_graphs.assign(r.steps.size(), nullptr);
  for (size_t i = 0; i < r.steps.size(); ++i)
    if (r.plans[i] != nullptr)
      r.gemm_graphs[i] = solo::CaptureGraph(r.compute, [&] { StepGemm(r, i, r.compute); });
  if (r.link == nullptr && variant != "signal")
    r.call_graph = solo::CaptureGraph(r.compute, [&] {
      Schedule(r);
      Check(cudaEventRecord(r.join, r.second), "record");
      Check(cudaStreamWaitEvent(r.compute, r.join), "wait");
    });
  // Calls interleaved one by one (timed_calls.h): all at the same clocks. First as enqueued (a
  // call's steps reach the GPU as fast as the host enqueues them), then gated: each 8 calls run
  // once the host has enqueued them all, at the GPU's own pace, as a program's calls queued
  // ahead of the GPU run. Where the two differ the first is the host's time. The graphs: the
  // schedule with each GEMM launched from its graph (one CUDA call, not cuBLASLt's), and the
  // whole call replayed from one (the GPU's side of the schedule with almost no host's).
  std::vector<jax_ub_tool::Timed> timed = {{"whole", r.compute, [&] { Whole(r); }},
                                           {"schedule", r.compute, [&] { Schedule(r); }}};
  if (std::any_of(r.gemm_graphs.begin(), r.gemm_graphs.end(), [](auto g) { return g != nullptr; }))
    timed.push_back({"GEMMs as graphs", r.compute, [&] { Schedule(r, true); }});
  if (r.call_graph != nullptr)
    timed.push_back({"the call as one graph", r.compute,
                     [&] { Check(cudaGraphLaunch(r.call_graph, r.compute), "cudaGraphLaunch"); }});
  jax_ub_tool::TimeRounds(timed, 3, seconds);
  const std::vector<jax_ub_tool::Timed> enqueued = timed;
  for (jax_ub_tool::Timed& t : timed) t.ms.clear();
  const int gate_passes = std::max<int>(1, 8 / static_cast<int>(timed.size()));
  const int gate_timeouts = jax_ub_tool::TimeRounds(timed, 3, seconds, gate_passes);
  const jax_ub_tool::Timed &whole = timed[0], &sched = timed[1];
  const double whole_ms = whole.Median(), sched_ms = sched.Median();
  for (int round = 0; round < 3; ++round) {
    std::printf("round %d, gated; as enqueued:", round);
    for (size_t i = 0; i < timed.size(); ++i)
      std::printf(" %s %.4f; %.4f ms%s", timed[i].name.c_str(), timed[i].ms[round],
                  enqueued[i].ms[round], i + 1 < timed.size() ? "," : "\n");
  }
  std::printf(
      "as enqueued: schedule %.4f ms / whole GEMM %.4f ms = x%.4f; the host enqueues a call in "
      "%.1f us (schedule), %.1f us (whole GEMM)\n",
      enqueued[1].Median(), enqueued[0].Median(), enqueued[1].Median() / enqueued[0].Median(),
      enqueued[1].host_us, enqueued[0].host_us);
  if (timed.size() > 2) {
    std::printf("graphs, / whole GEMM:");
    for (size_t i = 2; i < timed.size(); ++i)
      std::printf(" %s x%.4f gated, x%.4f as enqueued (the host %.1f us a call)%s",
                  timed[i].name.c_str(), timed[i].Median() / whole_ms,
                  enqueued[i].Median() / enqueued[0].Median(), enqueued[i].host_us,
                  i + 1 < timed.size() ? ";" : "\n");
  }
  if (gate_timeouts > 0)
    std::printf("GATE TIMED OUT %d times: the host was held enqueueing; those times are its own\n",
                gate_timeouts);
  const auto [sched_lo, sched_hi] = std::minmax_element(sched.ms.begin(), sched.ms.end());
  const auto [whole_lo, whole_hi] = std::minmax_element(whole.ms.begin(), whole.ms.end());
  std::printf(
      "%s (%s) tp=%d m=%lld k=%lld n=%lld: schedule %.4f ms / whole GEMM %.4f ms = x%.4f "
      "(gated; rounds: schedule %.4f..%.4f, whole %.4f..%.4f)\n",
      argv[1], variant.c_str(), tp, m, k, n, sched_ms, whole_ms, sched_ms / whole_ms, *sched_lo,
      *sched_hi, *whole_lo, *whole_hi);
  if (sums && n % 8 == 0) {  // how near the sum pass runs to the GPU's memory bandwidth
    const double bytes = (tp + 1.0) * m * n * 2;  // tp partials read, one written
    const int loop = std::max(3, int(seconds * 1e3 / Time(r, SumAlone, 3)));
    std::vector<double> lib, unrolled;
    for (int round = 0; round < 3; ++round) {
      lib.push_back(Time(r, SumAlone, loop));
      unrolled.push_back(Time(r, SumUnrolledAlone, loop));
    }
    std::sort(lib.begin(), lib.end());
    std::sort(unrolled.begin(), unrolled.end());
    std::printf(
        "sum pass alone: %.4f ms, %.0f GB/s; unrolled over the partials: %.4f ms, %.0f GB/s (%d "
        "partials of %lldx%lld read, one written; medians of 3)\n",
        lib[1], bytes / lib[1] * 1e-6, unrolled[1], bytes / unrolled[1] * 1e-6, tp, m, n);
    // Any schedule that sums the partials in a pass of its own takes at least this long.
    std::printf("floor with one sum pass: whole GEMM + sum = x%.4f of the whole GEMM\n",
                (whole_ms + lib[1]) / whole_ms);
    if (r.link != nullptr) {
      // The sum pass after the later of the last landing and our own GEMMs.
      const double lands = solo::LastLanding(tp, whole_ms, transfer_us);
      const double floor = std::max(whole_ms, lands) + lib[1];
      std::printf(
          "paced at %.0f GB/s: a partial %.1f us on the link, the last lands at %.4f ms "
          "(x%.3f of the whole GEMM); floor %.4f ms; the schedule x%.4f of its floor\n",
          gbps, transfer_us, lands, lands / whole_ms, floor, sched_ms / floor);
    }
  }
  for (cudaGraphExec_t g : r.gemm_graphs)
    if (g != nullptr) Check(cudaGraphExecDestroy(g), "cudaGraphExecDestroy");
  if (r.call_graph != nullptr) Check(cudaGraphExecDestroy(r.call_graph), "cudaGraphExecDestroy");
  delete r.link;
  delete r.gemm;
  for (cudaStream_t s : r.lanes) Check(cudaStreamDestroy(s), "cudaStreamDestroy");
  Check(cudaStreamDestroy(r.second), "cudaStreamDestroy");
  Check(cudaStreamDestroy(r.compute), "cudaStreamDestroy");
  for (cudaEvent_t e : {r.join, r.begin, r.end}) Check(cudaEventDestroy(e), "cudaEventDestroy");
  for (const void* p :
       {r.ops.x, r.ops.w, static_cast<const void*>(r.ops.out), static_cast<const void*>(r.buffer),
        static_cast<const void*>(r.peer_scratch), static_cast<const void*>(r.whole_x),
        static_cast<const void*>(r.whole_out), static_cast<const void*>(r.block_flags),
        static_cast<const void*>(r.counts)})
    Check(cudaFree(const_cast<void*>(p)), "cudaFree");
  return 0;
}
