// paced_gemm: one rank's all-gather GEMM schedules on ONE GPU with its peers' row blocks
// arriving as a modelled link delivers them, so that schedules which overlap differently can be
// compared without a second GPU. solo_schedule and flag_gemm time the compute side with every
// row already in place; here the rows are in place too, but each block's flag is raised only
// at its modelled arrival time, by a one-thread kernel that spins on the GPU's global timer
// (the "link"). It occupies one SM for the arrival window, so every GEMM that runs beside it
// gets one SM fewer (cuBLASLt's SM count target, CUTLASS's grid); the harness's cost is timed
// alone (`paced:empty`) and taken out of the ratios.
//
// The model: a block of C = (M/tp) * K * 2 bytes takes C / rate (+ latency) to land. Pushing to
// every peer at once (steps), all remote blocks share the link and land together at
// (tp - 1) * C / rate; the all-gather in turn (Tuning.all_gather_in_turn) receives from one
// peer at a time, block (rank - s) mod tp landing at s * (C / rate + latency). Not
// modelled: the cost of the copies themselves (HBM traffic and power: about 3% of GEMM time on
// an H200, RESULTS' misses), or skew between the GPUs.
//
// Timed, each call after the link's kernel has started (the schedule's stream waits for its
// word), interleaved call by call (TimeRounds), 5 rounds of >= `seconds` each, median:
//   whole            cuBLASLt's whole GEMM (heuristic pick, all SMs)
//   whole:sms-1      the same with one SM fewer (cuBLASLt's pick for that)
//   paced:empty      the harness alone (the link started, nothing landing, no GEMM): its cost a
//                    call, taken out of the paced rows' ratios
//   paced:whole      whole:sms-1 behind the harness, nothing to wait for: the reference
//   paced:steps      all at once: the own block's GEMM; then, once they have landed
//                    (together), the blocks after it and those before it, one GEMM each
//   paced:in_turn    the all-gather in turn's GEMMs (Schedule::InTurnSpans) on one stream: the
//                    own block, then GEMMs over the blocks as they land, each taking all that
//                    the library's model has landed by its start
//   paced:in_turn:again  the same, timed again: the run's noise between two timings of one thing
//   paced:in_turn:blocks  in turn with one GEMM per block as it lands
//   paced:in_turn:2streams, paced:in_turn:blocks:2streams  the same two, the GEMMs taking turns
//                    on two streams (each with its own workspace), so that a GEMM's tiles can
//                    start on the SMs that the one before leaves idle in its last wave; the
//                    library runs in_turn:2streams where n >= 2560 (AllGatherTwoGemmLanes)
//   paced:flag:CFG   flag_gemm's CUTLASS GEMM, blocks in turn: one persistent GEMM that waits
//                    for each row block's flag before loading it
//   paced:flag_own_copied:CFG  the library's (Schedule::AllGatherFlagGemm, FlagGemm: CFG
//                    ping_128x128_c2): the own block copied into its rows, then the flag GEMM
//                    over every block
//   paced:flag_after_own:CFG  the own block's cuBLASLt GEMM, then the flag GEMM over the remote
//                    blocks
//   paced:flag_own_tensor:ping_128x128_c2  the flag GEMM reading the own block where it lies,
//                    another allocation, through a TMA descriptor of its own (OwnBlockMainloop)
//   paced:flag_array:ping_128x128_c2  a prototype (flag_gemm_array.cuh): every block a batch of
//                    a ptr-array GEMM, the own block read in place from another allocation
// Ratios, the harness's cost taken out: to paced:whole (the same GEMM work under the same
// conditions), and to the model's floor: no schedule ends before that GEMM would, nor before
// the last block lands (in turn) plus its share of the GEMM (1/tp).
// Each is first checked against the whole GEMM's output (relative error, non-finite values, the
// flag GEMM's timeout word).
//
// Usage: paced_gemm M,K,N tp rank rate_gbps seconds [configs|all] [latency_us]
//   M,K,N: the rank's whole GEMM (M: all gathered rows, tp blocks of M/tp); rank: whose schedule;
//   rate_gbps: GB/s into the GPU (jax_ub's all-gather moved 264-279 GB/s per GPU on 4 H200s).
// Build: as flag_gemm (CUTLASS's headers; `ninja -C build/dev paced_gemm`).
#ifndef NDEBUG
#define NDEBUG
#endif
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "flag_gemm_array.cuh"
#include "flag_gemm_bench.cuh"
#include "protocol/schedule.h"

namespace fg {

// The driver's stream memory operations (the library raises a flag with cuStreamWriteValue64),
// resolved through the runtime: no libcuda to link.
using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32 = WaitValue32;
WaitValue32 LoadDriverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || fn == nullptr) Fail("driver: no such entry point", name);
  return reinterpret_cast<WaitValue32>(fn);
}

// When each remote row block lands, in ns after the link starts, in landing order.
struct Arrivals {
  int count = 0;
  int block[16];
  uint64_t ns[16];
};

// The link: resets the flags (own block landed, the rest not), raises `go` to `epoch` (the
// schedule's stream waits for it), then raises each block's flag at its arrival time.
__global__ void Link(Arrivals a, int* flags, int blocks, int own, int* go, int epoch) {
  for (int b = 0; b < blocks; ++b) flags[b] = b == own ? 1 : 0;
  __threadfence();
  StoreRelease(go, epoch);
  const uint64_t t0 = Now();
  for (int s = 0; s < a.count; ++s) {
    while (Now() - t0 < a.ns[s]) {
    }
    StoreRelease(flags + a.block[s], 1);
  }
}

struct Harness {
  cudaStream_t compute, link;
  cudaEvent_t done;  // what the compute stream holds before a call: its link starts after it
  int *flags, *go;
  WaitValue32 wait_value;
  int epoch = 0;
  // `st` (default: the compute stream) waits until `word` >= value.
  void Wait(const int* word, int value, cudaStream_t st = nullptr) {
    CHECK(wait_value(st ? st : compute, CUdeviceptr(word), cuuint32_t(value),
                     CU_STREAM_WAIT_VALUE_GEQ));
  }
  // Starts the link for one call once the compute stream's earlier work (any call's) is done,
  // and makes `compute` wait until it runs: no block lands before the call can take it.
  // `own_landed` false: the own block's flag stays down too (the call raises it, or takes the
  // block without a wait).
  void Begin(const Arrivals& a, int blocks, int own, bool own_landed = true) {
    CHECK(cudaEventRecord(done, compute));
    CHECK(cudaStreamWaitEvent(link, done));
    Link<<<1, 1, 0, link>>>(a, flags, blocks, own_landed ? own : -1, go, ++epoch);
    CHECK(cudaGetLastError());
    Wait(go, epoch);
  }
  void WaitBlock(int b, cudaStream_t st = nullptr) { Wait(flags + b, 1, st); }
};

std::vector<int> ParseShape(const char* arg) {
  int m = 0, k = 0, n = 0;
  if (std::sscanf(arg, "%d,%d,%d", &m, &k, &n) != 3 || m <= 0 || k <= 0 || n <= 0)
    Fail("M,K,N", arg);
  if (k % 8 || n % 8) Fail("K,N", "must be multiples of 8");
  return {m, k, n};
}

}  // namespace fg

int main(int argc, char** argv) {
  using namespace fg;
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M,K,N tp rank rate_gbps seconds [configs|all] [latency_us]\n",
                 argv[0]);
    return 2;
  }
  const std::vector<int> mkn = ParseShape(argv[1]);
  const int tp = std::atoi(argv[2]), rank = std::atoi(argv[3]);
  const double gbps = std::atof(argv[4]), seconds = std::atof(argv[5]);
  const std::string want = argc > 6 ? argv[6] : "all";
  const double latency_us = argc > 7 ? std::atof(argv[7]) : 0.0;
  if (tp < 2 || tp > 16) Fail("tp", "must be 2..16");
  if (rank < 0 || rank >= tp) Fail("rank", "must be 0..tp-1");
  if (mkn[0] % tp) Fail("M", "must be a multiple of tp");
  if (!(gbps > 0) || !(seconds > 0) || latency_us < 0) Fail("rate, seconds, latency", "positive");

  CHECK(cudaSetDevice(0));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));

  // The whole GEMM on all SMs; everything behind the link on one fewer.
  Problem whole{mkn[0], mkn[1], mkn[2], 1, 0, sms};
  Problem paced = whole;
  paced.blocks = tp;
  paced.sm_count = sms - 1;
  const int rows = whole.m / tp;
  const double chunk = double(rows) * whole.k * 2;  // bytes of one row block
  const double step_ns = chunk / gbps;              // GB/s = bytes per ns
  Arrivals together, in_turn, none;
  for (int s = 1; s < tp; ++s) {
    const int b = (rank - s + tp) % tp;
    in_turn.block[in_turn.count] = b;
    in_turn.ns[in_turn.count++] = uint64_t(s * (step_ns + latency_us * 1e3));
    together.block[together.count] = b;
    together.ns[together.count++] = uint64_t((tp - 1) * step_ns + latency_us * 1e3);
  }
  paced.order = uint64_t(rank);
  for (int s = 0; s < in_turn.count; ++s)
    paced.order |= uint64_t(in_turn.block[s]) << (4 * (s + 1));
  std::printf(
      "device %s, %d SMs; M,K,N = %d,%d,%d, tp %d, rank %d; link %.0f GB/s, latency %.1f us: a "
      "block (%.1f MB) every %.1f us in turn, all %d remote blocks at %.1f us together\n",
      prop.name, sms, whole.m, whole.k, whole.n, tp, rank, gbps, latency_us, chunk / 1e6,
      in_turn.ns[0] / 1e3, tp - 1, together.ns[0] / 1e3);

  bf16 *a, *b, *d, *ref;
  int* err;
  void* ws;
  const size_t ws_size = size_t(32) << 20;
  const int64_t a_elems = int64_t(whole.m) * whole.k, d_elems = int64_t(whole.m) * whole.n;
  CHECK(cudaMalloc(&a, a_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&b, int64_t(whole.k) * whole.n * sizeof(bf16)));
  CHECK(cudaMalloc(&d, d_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&ref, d_elems * sizeof(bf16)));
  CHECK(cudaMalloc(&err, sizeof(int)));
  CHECK(cudaMalloc(&ws, ws_size));
  CHECK(cudaMemset(err, 0, sizeof(int)));
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(a), a_elems, 0x1234u, 1.0f, nullptr);
  jax_ub_tool::FillRandom(reinterpret_cast<__nv_bfloat16*>(b), int64_t(whole.k) * whole.n, 0x9876u,
                          1.0f, nullptr);
  bf16* own_rows;  // the own block's rows again, for paced:flag_own_copied to copy in
  CHECK(cudaMalloc(&own_rows, size_t(chunk)));
  CHECK(cudaMemcpy(own_rows, a + int64_t(rank) * rows * whole.k, size_t(chunk),
                   cudaMemcpyDeviceToDevice));
  const WriteValue32 write_value = LoadDriverEntry("cuStreamWriteValue32");
  Harness h{};
  h.wait_value = LoadDriverEntry("cuStreamWaitValue32");
  CHECK(cudaStreamCreateWithFlags(&h.compute, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&h.link, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&h.done, cudaEventDisableTiming));
  CHECK(cudaMalloc(&h.flags, 16 * sizeof(int)));
  CHECK(cudaMalloc(&h.go, sizeof(int)));
  // A second GEMM stream (its own cuBLASLt workspace): GEMMs alternate between the two, so the
  // next one's tiles can take the SMs that a short GEMM's last wave leaves idle.
  cudaStream_t second;
  cudaEvent_t forked, joined;
  void* ws2;
  CHECK(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
  CHECK(cudaMalloc(&ws2, ws_size));
  CHECK(cudaMemset(h.go, 0, sizeof(int)));

  Lt full{whole, b, ws, ws_size}, fewer{whole, b, ws, ws_size}, fewer2{whole, b, ws2, ws_size};
  fewer.sm_target = fewer2.sm_target = sms - 1;
  full.Create();
  fewer.Create();
  fewer2.Create();
  std::vector<LtSpan> full_spans = {full.Plan(0, whole.m)};
  // fewer's spans: [0] whole, [1] own block, [2] after, [3] before (the library's spans), then
  // one per block for the all-gather in turn.
  std::vector<LtSpan> spans = {fewer.Plan(0, whole.m), fewer.Plan(rank * rows, rows)};
  std::vector<LtSpan> steps_spans = {spans[1]};
  if (rank + 1 < tp)
    steps_spans.push_back(fewer.Plan((rank + 1) * rows, whole.m - (rank + 1) * rows));
  if (rank > 0) steps_spans.push_back(fewer.Plan(0, rank * rows));
  std::vector<LtSpan> block_spans(tp);
  for (int blk = 0; blk < tp; ++blk) block_spans[blk] = fewer.Plan(blk * rows, rows);
  full.Run(full_spans[0], a, ref, h.compute);

  std::vector<Timed> impls;
  impls.push_back({"whole", h.compute, [&] { full.Run(full_spans[0], a, d, h.compute); }});
  impls.push_back({"whole:sms-1", h.compute, [&] { fewer.Run(spans[0], a, d, h.compute); }});
  impls.push_back({"paced:empty", h.compute, [&] { h.Begin(none, tp, rank); }});
  impls.push_back({"paced:whole", h.compute, [&] {
                     h.Begin(none, tp, rank);
                     fewer.Run(spans[0], a, d, h.compute);
                   }});
  impls.push_back({"paced:steps", h.compute, [&] {
                     h.Begin(together, tp, rank);
                     fewer.Run(steps_spans[0], a, d, h.compute);
                     for (size_t i = 1; i < steps_spans.size(); ++i) {
                       const LtSpan& s = steps_spans[i];
                       for (int blk = s.row0 / rows; blk < (s.row0 + s.rows) / rows; ++blk)
                         h.WaitBlock(blk);
                       fewer.Run(s, a, d, h.compute);
                     }
                   }});
  // The library's GEMMs in turn: each over a run of blocks, waiting for all of them.
  jax_ub::Schedule sched;
  sched.rank = rank;
  sched.size = tp;
  std::vector<jax_ub::Schedule::Span> turn = sched.AllGatherSpans(true, whole.n);
  std::vector<LtSpan> turn_spans;
  std::printf("in turn, the library's GEMMs (first block, blocks):");
  for (const jax_ub::Schedule::Span& t : turn) {
    turn_spans.push_back(fewer.Plan(t.first * rows, t.count * rows));
    std::printf(" %d,%d", t.first, t.count);
  }
  std::printf("\n");
  impls.push_back({"paced:in_turn", h.compute, [&] {
                     h.Begin(in_turn, tp, rank);
                     for (size_t i = 0; i < turn.size(); ++i) {
                       for (int blk = turn[i].first; blk < turn[i].first + turn[i].count; ++blk)
                         if (blk != rank) h.WaitBlock(blk);
                       fewer.Run(turn_spans[i], a, d, h.compute);
                     }
                   }});
  // The same schedule timed twice: how far two loops of one thing read apart in this run.
  impls.push_back(impls.back());
  impls.back().name = "paced:in_turn:again";
  impls.push_back({"paced:in_turn:blocks", h.compute, [&] {
                     h.Begin(in_turn, tp, rank);
                     fewer.Run(block_spans[rank], a, d, h.compute);
                     for (int s = 0; s < in_turn.count; ++s) {
                       h.WaitBlock(in_turn.block[s]);
                       fewer.Run(block_spans[in_turn.block[s]], a, d, h.compute);
                     }
                   }});
  // GEMMs over `spans` (each waiting for its blocks but the own), alternating between the
  // compute stream and the second one; the call ends when both have.
  std::vector<LtSpan> turn_spans2, block_spans2;
  for (const LtSpan& t : turn_spans) turn_spans2.push_back(fewer2.Plan(t.row0, t.rows));
  for (const LtSpan& t : block_spans) block_spans2.push_back(fewer2.Plan(t.row0, t.rows));
  auto two_streams = [&](const Arrivals& arr, const std::vector<LtSpan>& one,
                         const std::vector<LtSpan>& two, const std::vector<int>& order) {
    h.Begin(arr, tp, rank);
    CHECK(cudaEventRecord(forked, h.compute));
    CHECK(cudaStreamWaitEvent(second, forked));
    for (size_t i = 0; i < order.size(); ++i) {
      const LtSpan& sp = (i % 2 ? two : one)[order[i]];
      cudaStream_t st = i % 2 ? second : h.compute;
      for (int blk = sp.row0 / rows; blk < (sp.row0 + sp.rows) / rows; ++blk)
        if (blk != rank) h.WaitBlock(blk, st);
      (i % 2 ? fewer2 : fewer).Run(sp, a, d, st);
    }
    CHECK(cudaEventRecord(joined, second));
    CHECK(cudaStreamWaitEvent(h.compute, joined));
  };
  std::vector<int> turn_order, block_order{rank};
  for (size_t i = 0; i < turn_spans.size(); ++i) turn_order.push_back(int(i));
  for (int s = 0; s < in_turn.count; ++s) block_order.push_back(in_turn.block[s]);
  impls.push_back({"paced:in_turn:2streams", h.compute,
                   [&] { two_streams(in_turn, turn_spans, turn_spans2, turn_order); }});
  impls.push_back({"paced:in_turn:blocks:2streams", h.compute,
                   [&] { two_streams(in_turn, block_spans, block_spans2, block_order); }});
  std::vector<std::unique_ptr<Op>> flag_ops;
  for (const ConfigEntry& c :
       {Entry<128, 256, 2, false>("coop_128x256_c2"), Entry<128, 128, 1, false>("coop_128x128_c1"),
        Entry<128, 128, 2, true>("ping_128x128_c2")}) {
    if (want != "all" &&
        ("," + want + ",").find("," + std::string(c.name) + ",") == std::string::npos)
      continue;
    if (rows % c.row_unit) {
      std::printf("%s: skipped (M/tp not a multiple of %d)\n", c.name, c.row_unit);
      continue;
    }
    flag_ops.push_back(c.make(paced, a, b, d, h.flags, err, false));
    Op* op = flag_ops.back().get();
    impls.push_back({std::string("paced:flag:") + c.name, h.compute, [&h, op, &in_turn, tp, rank] {
                       h.Begin(in_turn, tp, rank);
                       op->Run(h.compute);
                     }});
    // The library's (Schedule::AllGatherFlagGemm): the own block copied into its rows (from a
    // copy of them) on the compute stream, its flag raised after the copy, then the flag GEMM
    // over every block. (On another stream the copy ran beside the waiting kernel at 65 GB/s:
    // a device-local copy took the SMs the kernel left.)
    impls.push_back({std::string("paced:flag_own_copied:") + c.name, h.compute, [&, op] {
                       h.Begin(in_turn, tp, rank, false);
                       CHECK(cudaMemcpyAsync(a + int64_t(rank) * rows * whole.k, own_rows,
                                             size_t(chunk), cudaMemcpyDeviceToDevice, h.compute));
                       CHECK(write_value(h.compute, CUdeviceptr(h.flags + rank), 1, 0));
                       op->Run(h.compute);
                     }});
    // The own block's GEMM first, then the flag GEMM over the remote blocks alone.
    Problem remote = paced;
    remote.order = paced.order >> 4;
    remote.slots = tp - 1;
    flag_ops.push_back(c.make(remote, a, b, d, h.flags, err, false));
    Op* rest = flag_ops.back().get();
    impls.push_back({std::string("paced:flag_after_own:") + c.name, h.compute, [&, rest] {
                       h.Begin(in_turn, tp, rank);
                       fewer.Run(block_spans[rank], a, d, h.compute);
                       rest->Run(h.compute);
                     }});
  }

  // The flag GEMMs that read the own block where it lies, in another allocation (as x is in
  // the library), run on a copy of a whose own block is NaN: a read of it there fails the check.
  // The library's kernel with a TMA descriptor of the own block's (OwnBlockMainloop); the
  // ptr-array prototype (flag_gemm_array.cuh), batch 0 the own block, batch s the one landing at s.
  bf16* a_holed = nullptr;
  std::unique_ptr<PacedArray> array;
  if (rows % 256 == 0 && (want == "all" || want.find("ping_128x128_c2") != std::string::npos)) {
    CHECK(cudaMalloc(&a_holed, a_elems * sizeof(bf16)));
    CHECK(cudaMemcpy(a_holed, a, a_elems * sizeof(bf16), cudaMemcpyDeviceToDevice));
    CHECK(cudaMemset(a_holed + int64_t(rank) * rows * whole.k, 0xff, size_t(chunk)));  // NaN
    using OwnCfg = jax_ub::flag_gemm::Config<128, 128, 2, true, FlagScheduler,
                                             cutlass::layout::RowMajor, true>;
    flag_ops.push_back(
        std::make_unique<CutlassOp<OwnCfg>>(paced, a_holed, b, d, h.flags, err, own_rows, rank));
    Op* own_op = flag_ops.back().get();
    impls.push_back(
        {"paced:flag_own_tensor:ping_128x128_c2", h.compute, [&h, own_op, &in_turn, tp, rank] {
           h.Begin(in_turn, tp, rank, /*own_landed=*/false);  // a wrong wait for it: TIMEOUT
           own_op->Run(h.compute);
         }});
    array = std::make_unique<PacedArray>(rows, whole.k, whole.n, tp, paced.sm_count, a_holed,
                                         own_rows, b, d, rank, in_turn.block, h.flags, err);
    Op* op = array->op.get();
    impls.push_back({"paced:flag_array:ping_128x128_c2", h.compute, [&h, op, &in_turn, tp, rank] {
                       h.Begin(in_turn, tp, rank);
                       op->Run(h.compute);
                     }});
  }

  // Correctness: each implementation's output against the whole GEMM's.
  ErrorCheck check;
  check.Create();
  bool pass = true;
  for (Timed& t : impls) {
    t.call();
    if (t.name == "paced:empty") continue;
    unsigned long long nonfinite = 0;
    const double rel = check.Rel(d, ref, d_elems, &nonfinite);
    int timeout = 0;
    CHECK(cudaMemcpy(&timeout, err, sizeof(int), cudaMemcpyDeviceToHost));
    const bool ok = rel < 1e-2 && nonfinite == 0 && timeout == 0;
    pass &= ok;
    std::printf("%-26s rel_err %.2e  nonfinite %llu  %s%s\n", t.name.c_str(), rel, nonfinite,
                timeout ? "TIMEOUT " : "", ok ? "PASS" : "FAIL");
  }
  std::printf("correctness: %s\n", pass ? "PASS" : "FAIL");

  TimeRounds(impls, 5, seconds);
  int timeout = 0;
  CHECK(cudaMemcpy(&timeout, err, sizeof(int), cudaMemcpyDeviceToHost));
  if (timeout) std::printf("TIMEOUT during timing (block %d)\n", timeout - 1);
  // Ratios to paced:whole and to the floor, the harness's own cost (paced:empty) taken out.
  const float harness = impls[2].Median(), t_ref = impls[3].Median() - harness;
  const double lands = in_turn.ns[in_turn.count - 1] * 1e-6 / t_ref;
  const double floor = std::max(1.0, lands + 1.0 / tp);
  std::printf(
      "harness: %.1f us a call; the last block lands at %.3f of paced:whole in turn, "
      "%.3f together; floor %.3f\n",
      harness * 1e3, lands, together.ns[0] * 1e-6 / t_ref, floor);
  std::printf("%-26s %9s %8s %10s %10s\n", "impl", "ms", "spread", "op/ref", "op/floor");
  for (const Timed& t : impls) {
    if (t.name == "paced:empty") continue;
    const float med = t.Median(), op = t.name.rfind("paced:", 0) == 0 ? med - harness : med;
    std::printf("%-26s %9.4f %7.1f%% %10.3f %10.3f\n", t.name.c_str(), med, 100.0 * t.Spread(),
                op / t_ref, op / t_ref / floor);
  }
  flag_ops.clear();
  std::vector<LtSpan> fewer_all = spans;
  fewer_all.insert(fewer_all.end(), steps_spans.begin() + 1, steps_spans.end());
  fewer_all.insert(fewer_all.end(), block_spans.begin(), block_spans.end());
  fewer_all.insert(fewer_all.end(), turn_spans.begin(), turn_spans.end());
  full.Destroy(full_spans);
  fewer.Destroy(fewer_all);
  turn_spans2.insert(turn_spans2.end(), block_spans2.begin(), block_spans2.end());
  fewer2.Destroy(turn_spans2);
  CHECK(cudaStreamDestroy(second));
  CHECK(cudaEventDestroy(forked));
  CHECK(cudaEventDestroy(joined));
  CHECK(cudaFree(ws2));
  check.Destroy();
  CHECK(cudaEventDestroy(h.done));
  CHECK(cudaStreamDestroy(h.compute));
  CHECK(cudaStreamDestroy(h.link));
  for (void* ptr : {(void*)a, (void*)b, (void*)d, (void*)ref, (void*)err, ws, (void*)h.flags,
                    (void*)h.go, (void*)own_rows})
    CHECK(cudaFree(ptr));
  array.reset();
  if (a_holed) CHECK(cudaFree(a_holed));
  return pass ? 0 : 1;
}
