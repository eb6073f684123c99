// The step lists of the two ops (see protocol/schedule.h): the protocol, written once.
#include "protocol/schedule.h"

#include "protocol/buffer_layout.h"

namespace jax_ub {
namespace {

Step Make(Step::Kind kind) {
  Step s;
  s.kind = kind;
  return s;
}

Ref At(Region region, int64_t offset, int peer = -1) { return Ref{region, offset, peer}; }

Step Wait(int lane, int peer, Flag flag, const char* what) {
  Step s = Make(Step::Kind::kWait);
  s.lane = lane;
  s.peer = peer;
  s.flag = flag;
  s.what = what;
  return s;
}
// A peer's data (or its first piece).
Step WaitData(int lane, int peer, const char* what, Flag flag = Flag::kData, int slot = -1) {
  Step s = Wait(lane, peer, flag, what);
  s.slot = slot;
  return s;
}
// The peer has consumed our previous push into its userbuffer.
Step WaitCredit(int lane, int peer) {
  return Wait(lane, peer, Flag::kCredit, "free its userbuffer");
}
Step Publish(int lane, int peer) {
  Step s = Make(Step::Kind::kPublish);
  s.lane = lane;
  s.peer = peer;
  return s;
}
Step Copy(int lane, Ref src, Ref dst, int64_t bytes) {
  Step s = Make(Step::Kind::kCopy);
  s.lane = lane;
  s.src = src;
  s.dst = dst;
  s.bytes = bytes;
  return s;
}
Step Signal(int lane, int peer, Flag flag, int slot = -1) {
  Step s = Make(Step::Kind::kSignal);
  s.lane = lane;
  s.peer = peer;
  s.flag = flag;
  s.slot = slot;
  return s;
}
Step Gemm(Ref src, Ref dst, int64_t rows, Ref addend = {}) {
  Step s = Make(Step::Kind::kGemm);
  s.src = src;
  s.dst = dst;
  s.rows = rows;
  s.addend = addend;
  return s;
}
Step Join(int lane, int on_lane) {
  Step s = Make(Step::Kind::kJoin);
  s.lane = lane;
  s.on_lane = on_lane;
  return s;
}
// The check that ends a call; a failed one poisons every output it wrote: out, the gathered
// copy and, where the GEMMs keep it (`aux_out`), the pre-GELU product, laid out as out. A
// DGELU's aux is its input and stays as it is.
Step Verify(int64_t out_bytes, int64_t gathered_bytes, bool aux_out = false) {
  Step s = Make(Step::Kind::kVerify);
  s.dst = At(Region::kOut, 0);
  s.bytes = out_bytes;
  if (gathered_bytes > 0) s.src = At(Region::kGathered, 0);
  s.src_bytes = gathered_bytes;
  if (aux_out) s.aux = At(Region::kAux, 0);
  return s;
}

std::vector<Step> AllGatherSteps(const Schedule& sched, const CallShape& c) {
  const int rank = sched.rank;
  const int64_t chunk = ChunkBytes(OpKind::kAllGatherMatmul, c);  // one rank's x
  const int64_t out_rows = c.m * c.n * DTypeSize(c.out);          // one rank's rows of out
  const std::vector<int> peers = sched.PushOrder();
  const bool in_turn = sched.AllGatherInTurn(c);
  std::vector<Step> steps;
  // Push our shard to every peer, each on its own lane, once the peer has consumed our
  // previous push; the descriptor goes first, so a receiver can check what it got. All at
  // once, or (in turn) each copy after the one before it has landed.
  for (size_t i = 0; i < peers.size(); ++i) {
    const int p = peers[i];
    steps.push_back(WaitCredit(p, p));
    steps.push_back(Publish(p, p));
    if (in_turn && i > 0) steps.push_back(Join(p, peers[i - 1]));
    steps.push_back(Copy(p, At(Region::kX, 0), At(Region::kPeerBuffer, rank * chunk, p), chunk));
    steps.push_back(Signal(p, p, Flag::kData));
  }
  const bool flag_gemm = sched.AllGatherFlagGemm(c);
  // The gathered copy, when asked for, runs on our own lane beside the GEMMs.
  if (c.gathered)
    steps.push_back(Copy(rank, At(Region::kX, 0), At(Region::kGathered, rank * chunk), chunk));
  // Multiply the local chunk, then the remote ones once they have landed: all in one GEMM that
  // waits for each chunk itself (the gathered copies wait on our own lane), or in GEMMs of
  // spans after their waits; with two GEMM lanes, the remote GEMMs alternate between them,
  // the second lane's first.
  if (flag_gemm) {
    // One kernel takes every chunk, ours first, read from x where it lies: a GEMM of its own
    // before the kernel cost 3-6% on an H200 (its last wave and the kernel's start), copying it
    // into our slot of the buffer first 1-3% (on another stream, the copy needed SMs that the
    // waiting kernel held).
    Step all = Gemm(At(Region::kBuffer, 0), At(Region::kOut, 0), sched.size * c.m);
    all.own = At(Region::kX, 0);
    all.epilogue = c.epilogue.Any();
    if (c.epilogue.UsesAux()) all.aux = At(Region::kAux, 0);
    all.parts = (sched.size == 64 ? 0 : uint64_t{1} << sched.size) - 1;  // every block
    if (c.gathered)
      for (int j : sched.FlagGemmOrder(all.parts)) {
        if (j == rank) continue;
        steps.push_back(WaitData(rank, j, "deliver its chunk"));
        steps.push_back(
            Copy(rank, At(Region::kBuffer, j * chunk), At(Region::kGathered, j * chunk), chunk));
      }
    steps.push_back(all);
    if (c.gathered) steps.push_back(Join(kComputeLane, rank));
    steps.push_back(
        Verify(sched.size * out_rows, c.gathered ? sched.size * chunk : 0, c.epilogue.aux));
    for (int p : peers) steps.push_back(Signal(kComputeLane, p, Flag::kCredit));
    return steps;
  }
  const bool two_lanes = sched.AllGatherTwoGemmLanes(c);
  int remote_gemms = 0;
  for (const Schedule::Span& span : sched.AllGatherSpans(in_turn, c.n)) {
    Ref src = At(Region::kX, 0);
    int lane = kComputeLane;
    if (span.first != rank) {
      if (two_lanes && remote_gemms++ % 2 == 0) lane = kSecondGemmLane;
      for (int j = span.first; j < span.first + span.count; ++j) {
        steps.push_back(WaitData(lane, j, "deliver its chunk"));
        if (c.gathered) steps.push_back(WaitData(rank, j, "deliver its chunk"));
      }
      src = At(Region::kBuffer, span.first * chunk);
      if (c.gathered)
        steps.push_back(
            Copy(rank, src, At(Region::kGathered, span.first * chunk), span.count * chunk));
    }
    Step gemm = Gemm(src, At(Region::kOut, span.first * out_rows), span.count * c.m);
    gemm.lane = lane;
    gemm.epilogue = c.epilogue.Any();
    if (c.epilogue.UsesAux()) gemm.aux = At(Region::kAux, span.first * out_rows);
    steps.push_back(gemm);
  }
  // The check reads every GEMM's rows, and the credits free the buffer the GEMMs read.
  if (remote_gemms > 0 && two_lanes) steps.push_back(Join(kComputeLane, kSecondGemmLane));
  if (c.gathered) steps.push_back(Join(kComputeLane, rank));
  steps.push_back(
      Verify(sched.size * out_rows, c.gathered ? sched.size * chunk : 0, c.epilogue.aux));
  // Our buffer is free again: tell every sender.
  for (int p : peers) steps.push_back(Signal(kComputeLane, p, Flag::kCredit));
  return steps;
}

std::vector<Step> ReduceScatterSteps(const Schedule& sched, const CallShape& c) {
  const int rank = sched.rank, size = sched.size;
  const int64_t es = DTypeSize(c.out), in_es = DTypeSize(c.in);
  const int64_t chunk = ChunkBytes(OpKind::kMatmulReduceScatter, c);  // one partial
  // Our buffer: [size] partials addressed to us, by sender (a ring's partial sums by
  // Schedule::ReduceScatterRingSlot), then [size] partials we
  // computed for each peer, staged for sending, then (where the call also gathers) [size]
  // gathered chunks, by sender.
  auto received = [&](int j) { return j * chunk; };
  auto staged = [&](int d) { return (size + d) * chunk; };
  auto gathered_in = [&](int j) { return (2 * size + j) * chunk; };
  const bool gathers = c.gathered;
  // Each block goes in row pieces (Schedule::ReduceScatterPieces); where it folds, each
  // GEMM adds the partial sum the previous rank passed, piece by piece as it lands, and the
  // last one, our own block's, writes `out`: no sum pass.
  const std::vector<Schedule::Rows> pieces = sched.ReduceScatterPieces(c.m, gathers);
  const int num_pieces = static_cast<int>(pieces.size());
  const bool fold = sched.ReduceScatterFolds(c.m, gathers);
  const bool signal_gemm = sched.ReduceScatterSignalGemm(c);
  const uint64_t everyone = ~uint64_t{0} >> (64 - size);
  // Where the sum finds our own partial: its rank's slot of the received ones, or (written by
  // the signal GEMM with the staged ones) its slot of the staging area, size slots further.
  const int own_part = signal_gemm ? size + rank : rank;
  auto offset = [&](int p) { return pieces[p].first * c.n * es; };  // in a partial
  auto input = [&](int d, int p) {
    return At(Region::kX, (d * c.m + pieces[p].first) * c.k * in_es);
  };
  auto piece_flag = [&](int p) { return p + 1 == num_pieces ? Flag::kData : Flag::kFirstPiece; };
  std::vector<Step> steps;
  // Each peer's lane first waits for the peer's credit and publishes our descriptor, while
  // the first GEMM runs: off the path of the first partial, which the peer's own first
  // GEMM waits for. The all-gather riding along follows on the same lane, otherwise idle
  // until that partial is ready. It needs no flag of its own: the partial's first piece
  // follows it on the lane, so a peer that sees that piece's flag has the chunk too.
  for (int d : sched.PushOrder()) {
    steps.push_back(WaitCredit(d, d));
    steps.push_back(Publish(d, d));
    if (gathers)
      steps.push_back(
          Copy(d, At(Region::kGatherSrc, 0), At(Region::kPeerBuffer, gathered_in(rank), d), chunk));
  }
  if (gathers)
    steps.push_back(
        Copy(rank, At(Region::kGatherSrc, 0), At(Region::kGathered, rank * chunk), chunk));
  if (fold) {
    // The ring (Schedule::ReduceScatterRingBlock): at step s, block b's partial sum from the
    // previous rank is our GEMM's addend, and ours goes on to the next rank, on its lane;
    // the last step is our own block, written to `out`.
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    // We only ever wait for prev, yet our check reads every peer's descriptor: our pushes to
    // next follow all our publishes, so each rank's last wait follows every other rank's
    // first push, and with it every publish.
    for (int d : sched.PushOrder())
      if (d != next) steps.push_back(Join(next, d));
    for (int step = 0; step < size; ++step) {
      const int b = sched.ReduceScatterRingBlock(step), slot = sched.ReduceScatterRingSlot(b);
      for (int p = 0; p < num_pieces; ++p) {
        Ref addend;
        if (step > 0) {
          steps.push_back(
              WaitData(kComputeLane, prev, "deliver its partial sum", piece_flag(p), slot));
          addend = At(Region::kBuffer, received(slot) + offset(p));
        }
        if (b == rank) {
          steps.push_back(Gemm(input(b, p), At(Region::kOut, offset(p)), pieces[p].count, addend));
          continue;
        }
        const Ref stage = At(Region::kBuffer, staged(b) + offset(p));
        steps.push_back(Gemm(input(b, p), stage, pieces[p].count, addend));
        steps.push_back(Join(next, kComputeLane));
        steps.push_back(Copy(next, stage, At(Region::kPeerBuffer, received(slot) + offset(p), next),
                             pieces[p].count * c.n * es));
        steps.push_back(Signal(next, next, piece_flag(p), slot));
      }
    }
  } else if (signal_gemm) {
    // Every partial in one GEMM, in push order, ours last (into the staging area, where the
    // sum reads it: bit size + rank of its parts); each push waits for the GEMM's flag of its
    // block, on its lane.
    Step all = Gemm(input(0, 0), At(Region::kBuffer, staged(0)), size * c.m);
    all.parts = everyone;
    all.signals = true;
    steps.push_back(all);
    for (int d : sched.PushOrder()) {
      steps.push_back(WaitData(d, rank, "finish its partial GEMM", Flag::kBlock, d));
      steps.push_back(Copy(d, At(Region::kBuffer, staged(d)),
                           At(Region::kPeerBuffer, received(rank), d), c.m * c.n * es));
      steps.push_back(Signal(d, d, Flag::kData));
    }
  } else {
    // Each peer's partial first, each sent while the next one is computed; ours last. With
    // two GEMM lanes, every second GEMM runs on the second, and each push follows its GEMM's.
    const bool two_lanes = sched.ReduceScatterTwoGemmLanes(c);
    int gemms = 0;
    for (int d : sched.ReduceScatterComputeOrder()) {
      const int lane = two_lanes && gemms++ % 2 == 1 ? kSecondGemmLane : kComputeLane;
      if (d == rank) {  // alone in its group, ours is the output
        const Ref dst = size == 1 ? At(Region::kOut, 0) : At(Region::kBuffer, received(rank));
        steps.push_back(Gemm(input(d, 0), dst, c.m));
        steps.back().lane = lane;
        continue;
      }
      const Ref stage = At(Region::kBuffer, staged(d));
      steps.push_back(Gemm(input(d, 0), stage, c.m));
      steps.back().lane = lane;
      steps.push_back(Join(d, lane));
      steps.push_back(Copy(d, stage, At(Region::kPeerBuffer, received(rank), d), c.m * c.n * es));
      steps.push_back(Signal(d, d, Flag::kData));
    }
    // The sum reads our own partial, which either lane may have written.
    if (two_lanes) steps.push_back(Join(kComputeLane, kSecondGemmLane));
  }
  if (size > 1 && !fold) {
    // Every partial addressed to us: its own GEMM's (received(rank)) and each peer's.
    Step sum = Make(Step::Kind::kSum);
    sum.src = At(Region::kBuffer, received(0));
    sum.dst = At(Region::kOut, 0);
    sum.bytes = chunk;
    sum.rows = c.m;
    const uint64_t own = uint64_t{1} << own_part;
    uint64_t late = (everyone & ~(uint64_t{1} << rank)) | own;  // summed after our GEMMs
    if (sched.ReduceScatterSumsEarly(c)) {
      // The early ones into a float32 partial sum on our own lane, beside the GEMMs; then
      // the rest added to it.
      const int last = sched.ReduceScatterLastSender();
      late = own | (uint64_t{1} << last);
      const Ref partial_sum = At(Region::kBuffer, EarlySumOffset(chunk, size, gathers));
      Step early = sum;
      early.lane = rank;
      early.parts = everyone & ~late & ~(uint64_t{1} << rank);
      early.dst = partial_sum;
      early.to_float = true;
      for (int j : sched.ReductionOrder())
        if (early.parts >> j & 1) steps.push_back(WaitData(rank, j, "deliver its partial sum"));
      steps.push_back(early);
      steps.push_back(Join(kComputeLane, rank));
      sum.addend = partial_sum;
    }
    for (int j : sched.ReductionOrder())
      if (j != rank && j != own_part && late >> j & 1)
        steps.push_back(WaitData(kComputeLane, j, "deliver its partial sum"));
    sum.parts = late;
    steps.push_back(sum);
  }
  if (gathers) {
    // Our own copy lane moves each landed chunk out of the buffer beside the GEMMs; the
    // list puts it after them, which the host (running the list in order) needs.
    for (int j : sched.ReductionOrder()) {
      if (j == rank) continue;
      steps.push_back(WaitData(rank, j, "deliver its chunk to gather", piece_flag(0)));
      steps.push_back(
          Copy(rank, At(Region::kBuffer, gathered_in(j)), At(Region::kGathered, j * chunk), chunk));
    }
    steps.push_back(Join(kComputeLane, rank));
  }
  steps.push_back(Verify(chunk, gathers ? size * chunk : 0));
  // Credits promise peers the whole buffer, staging area included: wait until our own
  // partials have left it, or a peer's next push could overwrite one still in flight.
  const std::vector<int> peers = sched.PushOrder();
  for (int p : peers) steps.push_back(Join(kComputeLane, p));
  for (int p : peers) steps.push_back(Signal(kComputeLane, p, Flag::kCredit));
  return steps;
}

}  // namespace

std::vector<Schedule::Span> Schedule::InTurnSpans(int64_t n) const {
  const double gemm = double(n) / (2.0 * kInTurnColumnsPerPeer);  // a chunk's, in landings
  std::vector<Span> spans{{rank, 1}};
  double free_at = gemm;  // when the GEMMs so far end; chunk at step s lands at s
  for (int s = 1; s < size;) {
    const int first = (rank - s + size) % size;  // the chunk landing at step s
    const double start = free_at > s ? free_at : s;
    const int landed = start >= size - 1 ? size - 1 : static_cast<int>(start);
    int take = landed - s + 1;
    if (take > first + 1) take = first + 1;
    spans.push_back({first - take + 1, take});
    free_at = (free_at > s + take - 1 ? free_at : s + take - 1) + take * gemm;
    s += take;
  }
  return spans;
}

std::vector<int> Schedule::SignalGemmOrder(uint64_t parts) const {
  std::vector<int> order;
  for (int j : ReduceScatterComputeOrder())
    if (parts >> j & 1) order.push_back(j);
  return order;
}

std::vector<int> Schedule::FlagGemmOrder(uint64_t parts) const {
  std::vector<int> order;
  for (int s = 0; s < size; ++s) {
    const int j = ((rank - s) % size + size) % size;
    if (parts >> j & 1) order.push_back(j);
  }
  return order;
}

namespace {

// Whether the op is long enough to repay in turn's serial copies (kInTurnMinMkn).
bool RepaysSerialCopies(const CallShape& c, int size) {
  return double(c.m) * double(c.k) * double(c.n) * (size - 2) >
         Schedule::kInTurnMinMkn * (size - 1);
}

// Whether the flag GEMM takes a call by shape, and so sends it in turn (AllGatherFlagGemm).
bool FlagGemmByShape(const Schedule& s, const CallShape& c) {
  return s.flag_gemm == ScheduleChoice::kByShape && s.size > 2 &&
         s.size <= Schedule::kFlagGemmMaxRanks && c.n >= Schedule::kFlagGemmMinColumns &&
         RepaysSerialCopies(c, s.size);
}

}  // namespace

bool Schedule::AllGatherInTurnPays(const CallShape& c) const {
  if (size <= 2 || c.n >= (size - 1) * kInTurnColumnsPerPeer) return false;
  return RepaysSerialCopies(c, size);
}

bool Schedule::AllGatherInTurn(const CallShape& c) const {
  if (in_turn != ScheduleChoice::kByShape) return in_turn == ScheduleChoice::kOn;
  return AllGatherInTurnPays(c) || FlagGemmByShape(*this, c);
}

bool Schedule::AllGatherTwoGemmLanes(const CallShape& c) const {
  if (size <= 2 || gemm_lanes == ScheduleChoice::kOff || !AllGatherInTurn(c) ||
      AllGatherFlagGemm(c))
    return false;
  return gemm_lanes == ScheduleChoice::kOn || c.n >= 2 * kInTurnColumnsPerPeer;
}

bool Schedule::AllGatherFlagGemm(const CallShape& c) const {
  if (size <= 2 || size > kFlagGemmMaxRanks || flag_gemm == ScheduleChoice::kOff ||
      !AllGatherInTurn(c))
    return false;
  return flag_gemm == ScheduleChoice::kOn || c.n >= kFlagGemmMinColumns;
}

bool Schedule::ReduceScatterTwoGemmLanes(const CallShape& c) const {
  if (size <= 2 || gemm_lanes == ScheduleChoice::kOff || ReduceScatterFolds(c.m, c.gathered) ||
      ReduceScatterSignalGemm(c))
    return false;
  return gemm_lanes == ScheduleChoice::kOn || c.k >= kEarlySumMaxK;
}

bool Schedule::ReduceScatterSignalGemm(const CallShape& c) const {
  if (size <= 2 || size > kFlagGemmMaxRanks || ReduceScatterFolds(c.m, c.gathered)) return false;
  return signal_gemm == ScheduleChoice::kOn;  // by shape: off (schedule.h says why)
}

bool Schedule::ReduceScatterSumsEarly(const CallShape& c) const {
  if (size < 4 || ReduceScatterFolds(c.m, c.gathered)) return false;
  return early_sum == ScheduleChoice::kOn ||
         (early_sum == ScheduleChoice::kByShape && c.k < kEarlySumMaxK);
}

std::vector<Step> CallSteps(OpKind op, const Schedule& sched, const CallShape& shape) {
  return op == OpKind::kAllGatherMatmul ? AllGatherSteps(sched, shape)
                                        : ReduceScatterSteps(sched, shape);
}

}  // namespace jax_ub
