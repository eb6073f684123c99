// Platform-neutral schedule of the overlapped ops: the orders (which chunk moves and which
// is computed when), and from them each op's step list (AllGatherSteps,
// ReduceScatterSteps). The host and the CUDA communicator both execute that list with
// their own primitives, so the protocol is written here once and CI's host run exercises
// the very sequence the GPUs run.
#pragma once

#include <cstdint>
#include <vector>

#include "protocol/call_descriptor.h"
#include "protocol/comm_options.h"
#include "protocol/epilogue.h"

namespace jax_ub {

struct CallShape;

// One tensor-parallel group of `size` ranks, seen from `rank`.
struct Schedule {
  int rank = 0;
  int size = 1;
  // Smallest piece (rows) worth folding a reduce-scatter for; negative: never
  // (CommOptions::reduce_scatter_fold_rows). Not needed by the all-gather's schedule.
  int64_t fold_rows = -1;
  // Groups above two fold too, in a ring (CommOptions::reduce_scatter_ring).
  bool ring = false;
  // Whether the all-gather pushes to one peer at a time and multiplies the chunks as they
  // land (CommOptions::all_gather_in_turn): on, off, or per call (AllGatherInTurn).
  ScheduleChoice in_turn = ScheduleChoice::kOff;
  // Whether a reduce-scatter of four or more ranks that sums its partials in a pass of its own
  // sums those that land early beside its GEMMs: on, off, or per call (ReduceScatterSumsEarly;
  // CommOptions::reduce_scatter_early_sum).
  ScheduleChoice early_sum = ScheduleChoice::kOff;
  // Whether GEMMs take turns on two lanes (kSecondGemmLane; AllGatherTwoGemmLanes,
  // ReduceScatterTwoGemmLanes): on, off, or per call (CommOptions::two_gemm_lanes).
  ScheduleChoice gemm_lanes = ScheduleChoice::kByShape;
  // Whether an all-gather in turn multiplies its remote chunks in one GEMM that waits for each
  // chunk's flag itself (AllGatherFlagGemm; CommOptions::all_gather_flag_gemm): on, off, or per
  // call. A backend that cannot run such a GEMM for a call turns it off for that call.
  ScheduleChoice flag_gemm = ScheduleChoice::kByShape;
  // Whether a reduce-scatter that sums its partials in a pass computes them all in one GEMM that
  // raises each block's flag once written, each push waiting on its block's flag
  // (ReduceScatterSignalGemm; CommOptions::reduce_scatter_signal_gemm): on, off, or per call. A
  // backend that cannot run such a GEMM for a call turns it off for that call.
  ScheduleChoice signal_gemm = ScheduleChoice::kByShape;

  // The choices of `options`, for rank 0 of a group of one until For() places it.
  static Schedule Of(const CommOptions& options) {
    Schedule s;
    s.fold_rows = options.reduce_scatter_fold_rows;
    s.ring = options.reduce_scatter_ring;
    s.in_turn = options.all_gather_in_turn;
    s.early_sum = options.reduce_scatter_early_sum;
    s.gemm_lanes = options.two_gemm_lanes;
    s.flag_gemm = options.all_gather_flag_gemm;
    s.signal_gemm = options.reduce_scatter_signal_gemm;
    return s;
  }

  // When an all-gather goes in turn by shape (ScheduleChoice::kByShape): where its transfer
  // outlasts twice the local chunk's GEMM and the GEMM is long enough to repay in turn's serial
  // copies. Pushing all at once lands every chunk after (size - 1) m k b / rate, hidden only by the
  // local chunk's GEMM, 2 m k n / flops; in turn pays a GEMM per chunk (5-17% on an H200)
  // but hides the transfer. On an H200 with a modelled 270 GB/s link
  // (benchmarks/tools/paced_gemm.cu, Llama 3 8B and 70B shapes at tp 4 and 8), in turn won
  // where the transfer exceeded twice that GEMM, n < (size - 1) b flops / (4 rate); with
  // 700 TFLOP/s for 2-byte inputs (fp8 twice as fast at half the bytes), 1296 a peer.
  // Measured with a GEMM per chunk. Above the bound, with InTurnSpans' fewer GEMMs on two
  // lanes (AllGatherTwoGemmLanes) and calls interleaved, in turn led in the model by 1-4%
  // (405B's gate/up at tp=8 1.003x the floor against 1.040, 8B's at tp=4 1.045 against 1.069),
  // about what in turn's serial copies (kInTurnMinMkn) cost at tp=4, which the model leaves
  // out; unmeasured on 2+ GPUs, so the bound stands.
  static constexpr int64_t kInTurnColumnsPerPeer = 1280;
  // Each copy in turn waits for the one before: about 5 us each (assumed), (size - 1) in all,
  // which only the GEMM that in turn hides beyond all at once, (size - 2) / size of the whole
  // 2 size m k n / flops, repays: m k n > (size - 1) / (size - 2) 5 us flops / 2.
  static constexpr double kInTurnMinMkn = 1.75e9;
  bool AllGatherInTurnPays(const CallShape& c) const;
  // Whether a call of shape `c` goes in turn: `in_turn` resolved (by shape, where in turn
  // pays, or where the flag GEMM runs by shape: AllGatherFlagGemm).
  bool AllGatherInTurn(const CallShape& c) const;
  // Whether an all-gather in turn runs its remote GEMMs on two GEMM lanes taking turns
  // (kSecondGemmLane): where a chunk's GEMM outlasts its landing (n >= 2 kInTurnColumnsPerPeer),
  // so GEMMs follow one another back to back and each one's last partial wave of tiles
  // leaves SMs idle that the next GEMM's tiles can take. On an H200 with a modelled 270 GB/s
  // link (paced_gemm, calls interleaved), two lanes took Llama 3 8B's gate/up at tp=8 from
  // 1.25x to 1.17x the floor, 70B's from 1.11x to 1.04x, 70B's qkv at tp=4 from 1.035x to
  // 1.020x; where chunks land slower than their GEMMs (qkv at tp=8), a GEMM a chunk, the
  // second lane only adds its fork and join (1.025x to 1.028x).
  bool AllGatherTwoGemmLanes(const CallShape& c) const;
  // Whether a reduce-scatter that sums its partials in a pass (it does not fold) above two
  // ranks computes them on two GEMM lanes taking turns: its GEMMs never wait for data, so
  // each runs right after the one before, and the next one's tiles fill the SMs its last
  // wave leaves idle. By shape where a partial's GEMM outlasts its transfer, k >=
  // kEarlySumMaxK: where the link is the longer, overlapping GEMMs only finish the first
  // partials later, and their transfers start later. On an H200 with partials landing at a
  // modelled 270 GB/s (solo_schedule, calls interleaved, one run), op / floor, one lane; two:
  // Llama 3 70B's down at tp=8 (k=3584) 1.083; 1.045, at tp=4 (k=7168) 1.037; 1.016, 8B's
  // down at tp=4 (k=3584) 1.077; 1.038; below: 8B's down at tp=8 (k=1792) 1.009; 1.040, 8B's
  // o at tp=8 (k=512) 1.013; 1.045, 70B's o at tp=8 (k=1024) 0.995; 1.005.
  bool ReduceScatterTwoGemmLanes(const CallShape& c) const;
  // Whether a reduce-scatter that sums its partials in a pass (it does not fold) computes every
  // partial in one GEMM (a kGemm whose `parts` and `signals` name them; on GPUs SignalGemm, one
  // persistent kernel) that takes the blocks in ReduceScatterComputeOrder and raises each
  // block's kBlock flag, on this rank, once its tiles are written; the push of a block waits for
  // that flag instead of a GEMM's end. A GEMM a block (or two lanes of them) ends each block in
  // a partial wave of tiles and, at short k, pays each GEMM's start; one GEMM keeps every SM on
  // the next block's tiles. Our own partial is the last block, in the staging area (the sum
  // reads it there). From three ranks (where the call does not fold) to kFlagGemmMaxRanks: at
  // two, the GPUs agree on each GEMM shape's kernels (KernelAgreement) by the GEMMs they plan,
  // so both ranks must plan the same ones, and either may find the kernel unfit for its
  // operands. By shape: off. On an H200 with a modelled 270 GB/s link, the library's schedule
  // with it against without it (benchmarks/tools/solo_schedule.cu `signal`, op / floor), Llama
  // 3 8B's and 70B's o and down at tp 4 and 8: 70B's down 0.996 / 1.012 (tp=4) and 1.027 /
  // 1.040 (tp=8), inside the runs' 2-3% spreads; the six others 1.010-1.077 / 0.997-1.049,
  // 0.4-2.8% slower. Its kernel alone runs 0.93-0.98x cuBLASLt's heuristic pick from k = 1024,
  // but 1.23x at k = 512, where each tile's wait for its stores outlasts the other warp
  // group's mainloop; the library's tuned GEMMs run faster than the pick.
  bool ReduceScatterSignalGemm(const CallShape& c) const;
  // Whether an all-gather in turn multiplies every chunk in one GEMM that takes each chunk as
  // its flag rises (a kGemm whose `parts` name them; on GPUs FlagGemm, one persistent kernel):
  // our own first, read from x where it lies, then every SM moves on to the next landed
  // chunk's tiles, with no GEMM boundary and no partial last wave per span. On an H200 with a
  // modelled 270 GB/s link (paced_gemm, calls interleaved, spreads under 1%), op / floor, the
  // kernel against the library's schedule before it: Llama 3 8B's gate/up at tp=4 (n = 7168)
  // 1.001 (all at once 1.069), at tp=8 (n = 3584) 1.015-1.030 (two lanes 1.165-1.170); 70B's
  // (n = 14336, 7168) 1.001 (1.009) and 1.003-1.009 (1.038-1.058); 405B's at tp=8 (n = 13312)
  // 0.984 (1.040).
  // Where chunks land about as fast as or slower than their GEMMs (n <= 2
  // kInTurnColumnsPerPeer) it lost: 70B's qkv at tp=4 (n = 2560) 1.051 (two lanes 1.020),
  // 8B's qkv (n = 1536, 768) 1.049-1.053 (a GEMM a chunk 1.019-1.025). By shape, from three
  // ranks to kFlagGemmMaxRanks, where n >= kFlagGemmMinColumns and the op repays in turn's
  // serial copies (kInTurnMinMkn): there the all-gather goes in turn even where
  // AllGatherInTurnPays would push all at once. Forced on, wherever it goes in turn.
  static constexpr int kFlagGemmMaxRanks = 16;
  static constexpr int64_t kFlagGemmMinColumns = 3072;
  bool AllGatherFlagGemm(const CallShape& c) const;
  // The order in which a GEMM that waits for its blocks' flags (Step::parts) takes them: as
  // they land in turn, from rank - 1 down (PushOrder: at step s every rank receives from
  // rank - s), our own block first where it is one of them.
  std::vector<int> FlagGemmOrder(uint64_t parts) const;
  // The order in which a GEMM that signals its blocks (Step::signals) computes them:
  // ReduceScatterComputeOrder's, each peer's block in the order pushes go out, our own last.
  std::vector<int> SignalGemmOrder(uint64_t parts) const;

  // This schedule as seen from `r` in a group of `n`.
  Schedule For(int r, int n) const {
    Schedule s = *this;
    s.rank = r;
    s.size = n;
    return s;
  }

  // Peers in the order this rank pushes its data to them: nearest first, so every
  // rank's first push goes to a different peer and no link is hit twice at once.
  std::vector<int> PushOrder() const {
    std::vector<int> order;
    for (int s = 1; s < size; ++s) order.push_back((rank + s) % size);
    return order;
  }

  // A run of consecutive chunks multiplied by one GEMM once all of them have landed.
  struct Span {
    int first;
    int count;
  };

  // GEMMs of the all-gather product, in order: the local chunk first (it needs no
  // communication and hides the pushes), then the remote chunks. Not in turn, every push
  // starts at once, so the remote chunks land together, about when the collective ends;
  // they are multiplied as at most two contiguous row ranges (after and before our own
  // rows), few large GEMMs at full efficiency where one small GEMM per chunk would not
  // be. In turn (`one_at_a_time`, AllGatherInTurn): each rank pushes to one peer at a time in
  // PushOrder, so at step s every rank receives from rank - s alone, and chunks land one by
  // one; each GEMM takes every chunk that has landed by the time it can start
  // (InTurnSpans), so the GEMMs overlap the collective beyond the local chunk's.
  // `n`: the call's columns (w's local ones), which set a chunk's GEMM time against its
  // landing time.
  std::vector<Span> AllGatherSpans(bool one_at_a_time, int64_t n) const {
    if (one_at_a_time) return InTurnSpans(n);
    std::vector<Span> spans{{rank, 1}};
    if (rank + 1 < size) spans.push_back({rank + 1, size - rank - 1});
    if (rank > 0) spans.push_back({0, rank});
    return spans;
  }

  // The all-gather in turn's GEMMs. Where a chunk's GEMM outlasts its landing (wide w),
  // chunks pile up while a GEMM runs, and one GEMM per chunk would run many small GEMMs,
  // each a partial wave of tiles (on an H200, 8 GEMMs of 1024 rows took 1.14x one of 8192);
  // so each GEMM takes all the chunks that have landed by then, in the model of
  // AllGatherInTurnPays: a chunk lands every m k b / rate and its GEMM takes 2 m k n / flops,
  // n / (2 kInTurnColumnsPerPeer) landings. A GEMM's chunks are contiguous rows: chunks land
  // in descending order, so a span stops at chunk 0 (the next to land is size - 1).
  std::vector<Span> InTurnSpans(int64_t n) const;

  // Row blocks of the reduce-scatter input in the order their partial products are
  // computed: the block each peer needs first (so its transfer overlaps the next
  // product), the block this rank keeps last.
  std::vector<int> ReduceScatterComputeOrder() const {
    std::vector<int> order = PushOrder();
    order.push_back(rank);
    return order;
  }

  // How many row pieces a reduce-scatter block of `rows` rows is computed and sent in, and
  // whether the reduction folds into the GEMMs (C, beta = 1) instead of a separate sum
  // pass. At size 2 the one peer partial becomes the accumulator of our own product,
  // piece by piece: the peer sends its first piece while computing its second, and its
  // second while computing our first, so no wait is exposed and the sum pass (~2% of the
  // call on an H200) is gone. Pieces of few rows cost GEMM efficiency (on 2 H200s the fold
  // was 1% slower with 512-row pieces and tied with 2048), hence `fold_rows`. Above two
  // ranks the fold is a ring (`ring`; ReduceScatterRingBlock), which size 2 is too, but
  // not for a call that `gathers` beside it: there a peer's gathered chunk is announced by
  // the partial it sends after it, and in a ring above two ranks most peers send none.
  bool ReduceScatterFolds(int64_t rows, bool gathers) const {
    return (size == 2 || (size > 2 && ring && !gathers)) && fold_rows >= 0 && rows / 2 >= fold_rows;
  }

  // A folding reduce-scatter's step s (0 .. size - 1) multiplies this block: each block's
  // partial sum travels the ring, rank r passing it to rank r + 1, each adding its own
  // partial (the GEMM's addend is what the previous rank passed), so that the rank the
  // block belongs to adds the last one at its last step and writes the output.
  int ReduceScatterRingBlock(int step) const { return ((rank - step - 1) % size + size) % size; }
  // Where a ring's partial sum of `block` lands and which flag announces it: the slot of
  // the rank that computed the block's first partial, which at size 2 is the sender.
  int ReduceScatterRingSlot(int block) const { return (block + 1) % size; }

  // A run of rows of a block.
  struct Rows {
    int64_t first;
    int64_t count;
  };

  // The row ranges, in order, that each reduce-scatter block of `rows` rows is computed
  // and sent in: its two halves where it folds (the first may be empty), else the block.
  std::vector<Rows> ReduceScatterPieces(int64_t rows, bool gathers) const {
    if (!ReduceScatterFolds(rows, gathers)) return {{0, rows}};
    return {{0, rows / 2}, {rows / 2, rows - rows / 2}};
  }

  // Whether the sum pass of a call `c` of a reduce-scatter that does not fold goes in two:
  // the partials that land before the last peer's (every peer's but rank + 1's, which sends
  // ours last in its PushOrder) are summed in float32 (EarlySumOffset) on our own copy lane
  // while the GEMMs run, and after our own GEMM the output is that sum plus our partial and
  // the last peer's, rounded once. Only three operands are then read after the GEMMs, not
  // size: the one pass read all size partials and cost 3-9% of the op at tp=8 on an H200.
  // From four ranks: at three, the early sum would be one partial's copy.
  // By shape: where a partial's transfer, m n b / rate, outlasts its GEMM, 2 m k n / flops,
  // that is k < b flops / (2 rate), 2592 with 700 TFLOP/s for 2-byte inputs (fp8 twice as
  // fast at half the bytes) and a 270 GB/s link: there the GEMMs wait for the link and the
  // early sum fills their idle time. Where the GEMMs are the longer, it runs beside them and
  // slows them. On an H200 with partials landing at a modelled 270 GB/s
  // (benchmarks/tools/solo_schedule.cu), op / floor of one sum pass, early; one pass, two
  // runs: at tp=8 Llama 3 8B's o (k=512) 1.016-1.019; 1.102-1.106, its down (k=1792)
  // 1.002-1.005; 1.079-1.085; at tp=4 8B's o (k=1024) 1.039-1.044; 1.067-1.068, 70B's o
  // (k=2048) 1.014-1.018; 1.021-1.029; 405B's o at tp=8 (k=2048) 0.981-0.984; 1.021-1.024.
  // Above: 405B's o at tp=4 (k=4096) 1.049-1.050; 0.992-1.018, 8B's down at tp=4 (k=3584)
  // 1.070-1.091; 1.020-1.032, 405B's down at tp=8 (k=6656) 0.989-0.998; 0.971-0.998.
  static constexpr int64_t kEarlySumMaxK = 2560;
  // False for a call that folds (ReduceScatterFolds): it has no sum pass.
  bool ReduceScatterSumsEarly(const CallShape& c) const;
  // The peer whose partial lands last: rank + 1 sends ours at its last step.
  int ReduceScatterLastSender() const { return (rank + 1) % size; }

  // Partials are summed in rank order, independent of arrival, so results are bitwise
  // reproducible run to run (with the signal GEMM our own partial comes last: its bit in the
  // sum is size + rank).
  std::vector<int> ReductionOrder() const {
    std::vector<int> order;
    for (int j = 0; j < size; ++j) order.push_back(j);
    return order;
  }
};

// Where a step's bytes are: a region of the call and a byte offset into it.
enum class Region : uint8_t {
  kNone,        // no operand (a GEMM without addend)
  kX,           // the op's local input
  kOut,         // the op's output
  kGathered,    // all_gather(x), where the caller asked for it
  kAux,         // GELU's input, which the epilogue keeps (or, DGELU, reads); laid out as kOut
  kGatherSrc,   // a reduce-scatter's second input, all-gathered into kGathered beside it
  kBuffer,      // this rank's userbuffer
  kPeerBuffer,  // rank `peer`'s userbuffer (symmetric: the same offsets)
};
struct Ref {
  Region region = Region::kNone;
  int64_t offset = 0;
  int peer = -1;  // kPeerBuffer only
};

// Epoch flags, one word per (flag, rank) in every rank's slot. kData[j]: rank j's chunk (or
// its last piece) for this call has landed here; kFirstPiece[j]: the first piece of a
// chunk sent in two (Schedule::ReduceScatterPieces); kCredit[j]: rank j has consumed what
// this rank sent it, through that call; kBlock[j]: this rank's own GEMM has written block j of
// its output for this call (Step::signals), never written by a peer.
enum class Flag : uint8_t { kData, kFirstPiece, kCredit, kBlock };

// How many calls behind this one a wait on `flag` waits for: a credit is for the peer's
// previous call, data for this one.
inline int Lag(Flag flag) { return flag == Flag::kCredit ? 1 : 0; }
// The flag whose value names a peer's progress in a timeout on `flag`: the data flag for a
// first piece, which only pieced calls write.
inline Flag ProgressFlag(Flag flag) { return flag == Flag::kFirstPiece ? Flag::kData : flag; }

// The work of one call runs on lanes: the compute lane (GEMMs, sums, checks) and one
// copy lane per rank (lane r: pushes to peer r; this rank's own lane copies the gathered
// output). On a GPU each lane is a stream and lanes run concurrently; the host runs the
// steps one after another in list order, which every lane's order and every join allows.
constexpr int kComputeLane = -1;
// A second compute lane, for GEMMs that take turns with the compute lane's
// (Schedule::AllGatherTwoGemmLanes): on a GPU a stream of its own with its own cuBLASLt
// workspace, joined into the compute lane before the call's checks and credits.
constexpr int kSecondGemmLane = -2;

struct Step {
  enum class Kind : uint8_t {
    kWait,     // the lane waits until this rank's flag[FlagSlot] holds epoch - Lag(flag)
    kPublish,  // the lane writes this call's descriptor into `peer`'s slot (for our rank)
    kCopy,     // bytes from src to dst
    kSignal,   // the lane raises `peer`'s flag[FlagSlot] to this call's epoch
    kGemm,     // dst[rows, n] = src[rows, k] @ w (+ addend[rows, n]), then with `epilogue`
               // the call's (CallShape::epilogue; its pre-GELU value to `aux`)
    kSum,      // dst = addend (float32, where it has one) + the partials `parts` names, in
               // bit order, as the output's type or (`to_float`) float32
    kJoin,     // the lane waits for all work enqueued so far on lane `on_lane`
    kVerify,   // every peer's descriptor matches ours; else the outputs are poisoned
  };
  Kind kind = Kind::kWait;
  int lane = kComputeLane;
  int peer = -1;  // kWait, kPublish, kSignal: the rank
  // kWait, kSignal: the flag's slot where it is not the sender's rank (a ring's partial
  // sums, several from one sender in a call); negative: the sender's.
  int slot = -1;
  int on_lane = kComputeLane;  // kJoin: the lane joined
  Flag flag = Flag::kData;
  const char* what = "";  // kWait: what the peer is awaited to do, for errors
  Ref src, dst, addend, aux;
  // kGemm with parts: where our own block is read, not from src (the op's x, where it already
  // lies: nothing is copied into our slot of the buffer first).
  Ref own;
  bool epilogue = false;  // kGemm
  // kCopy: the bytes copied. kSum: the stride of the partials in src. kVerify: the bytes
  // of dst, and of aux where it names one, (and src_bytes those of src) that a failed check
  // poisons.
  int64_t bytes = 0;
  // kSum: bit j for the partial at src + j * bytes. kGemm: where not 0, src and dst are the
  // group's size row blocks of rows / size rows each, and the GEMM multiplies the blocks whose
  // bit is set, in Schedule::FlagGemmOrder, our own from `own`, each other once its
  // sender's (rank j's) data flag holds this call's epoch: the waits are the GEMM's own (on
  // GPUs inside its kernel, FlagGemm), and the blocks not set are left as they are. With
  // `signals`, it waits for nothing: it multiplies them (our own from src too) in
  // Schedule::SignalGemmOrder and raises this rank's kBlock[j] to the call's epoch once block j
  // is written (on GPUs from inside its kernel, SignalGemm), but our own block's.
  uint64_t parts = 0;
  bool signals = false;   // kGemm with parts: see `parts`
  bool to_float = false;  // kSum: dst is float32 (a partial sum, added to later)
  int64_t src_bytes = 0;
  int64_t rows = 0;  // kGemm, kSum
};

// The flag word a kWait reads (in our slot) or a kSignal raises (in the peer's): `slot`
// where the step names one, else the sender's rank: the peer a wait waits for, or `rank`,
// ours, for a signal.
inline int FlagSlot(const Step& s, int rank) {
  if (s.slot >= 0) return s.slot;
  return s.kind == Step::Kind::kWait ? s.peer : rank;
}

// One rank's view of one call: out = all_gather(x[m, k]) @ w[k, n] for kAllGatherMatmul,
// out[m, n] = reduce_scatter(x[size*m, k] @ w) for kMatmulReduceScatter (and, where
// `gathered`, gathered[size*m, n] = all_gather(gather_src[m, n]) beside it). x and w are of
// type `in` and `w_type` (the same, or both fp8), the output (and a reduce-scatter's
// partials) of type `out`. An AG's GEMMs end with `epilogue` (an RS has none: its bias is
// added after the reduction, by the caller).
struct CallShape {
  int64_t m = 0, k = 0, n = 0;
  DType in = DType::kF32, w_type = DType::kF32, out = DType::kF32;
  // AG: the caller wants all_gather(x) too. RS: the call all-gathers Operands::gather_src,
  // of the output's shape and type, on the copy lanes its GEMMs leave idle (a backward's
  // all_gather(x) for the weight gradient, beside its input gradient's GEMM+RS).
  bool gathered = false;
  Epilogue epilogue;
};

// Where a call's operands are, which the steps' Refs point into.
struct Operands {
  const void* x = nullptr;
  const void* w = nullptr;
  bool w_transposed = false;  // w stored as its transpose [n, k]
  // x_scale at [0], w_scale at [kScaleStride]: multiplying the product (fp8). Device memory
  // on GPUs, each scale 16-byte aligned there, as cuBLASLt reads them.
  const float* scales = nullptr;
  void* out = nullptr;
  void* gathered = nullptr;          // null unless CallShape::gathered
  const void* gather_src = nullptr;  // RS with CallShape::gathered: [m, n] of the output's type
  const void* bias = nullptr;        // [n] of the output's type, where the epilogue adds one
  void* aux = nullptr;  // like out: GELU's input, kept (or read, DGELU) by the epilogue
};

// The address `r` names: in the call's operands, this rank's userbuffer (`buffer`), or
// peer p's (`peer_buffer(p)`).
template <typename PeerBuffer>
char* Resolve(const Ref& r, const Operands& ops, char* buffer, PeerBuffer peer_buffer) {
  switch (r.region) {
    case Region::kX:
      return const_cast<char*>(static_cast<const char*>(ops.x)) + r.offset;
    case Region::kOut:
      return static_cast<char*>(ops.out) + r.offset;
    case Region::kGathered:
      return static_cast<char*>(ops.gathered) + r.offset;
    case Region::kAux:
      return static_cast<char*>(ops.aux) + r.offset;
    case Region::kGatherSrc:
      return const_cast<char*>(static_cast<const char*>(ops.gather_src)) + r.offset;
    case Region::kBuffer:
      return buffer + r.offset;
    case Region::kPeerBuffer:
      return peer_buffer(r.peer) + r.offset;
    case Region::kNone:
      break;
  }
  return nullptr;
}

// The step list of one call of `op`, for `sched`'s rank.
std::vector<Step> CallSteps(OpKind op, const Schedule& sched, const CallShape& shape);

}  // namespace jax_ub
