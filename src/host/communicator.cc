#include "host/communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "host/gemm.h"
#include "host/shared_words.h"
#include "protocol/buffer_layout.h"
#include "protocol/quiesce.h"
#include "protocol/schedule.h"

namespace jax_ub {
namespace {

constexpr uint64_t kMagic = 0x6a61785f75622e33ULL;  // "jax_ub.3": SlotHeader's layout

}  // namespace

struct HostCommunicator::CallContext {
  OpKind op;
  int slot;
  int group;
  int rank;
  int size;
  uint64_t epoch;
  CallDescriptor desc;
  int peer_slot(int r) const { return group * size + r; }
};

Status HostCommunicator::Create(Topology topology, size_t capacity_bytes,
                                const CommOptions& options, const std::string& shm_prefix,
                                std::unique_ptr<HostCommunicator>* out) {
  std::unique_ptr<HostCommunicator> c(new HostCommunicator());
  c->capacity_ = (capacity_bytes + 63) / 64 * 64;
  c->timeout_s_ = options.timeout_s;
  c->schedule_ = Schedule::Of(options);
  c->topology_ = std::move(topology);
  c->shared_ = !shm_prefix.empty();
  const int slots = c->topology_.num_slots();
  c->regions_.assign(slots, nullptr);
  c->names_.assign(slots, "");
  c->epoch_.reset(new std::atomic<uint64_t>[slots]);
  for (int s = 0; s < slots; ++s) c->epoch_[s] = 0;
  c->runners_.resize(slots);
  c->completers_.resize(slots);
  c->in_flight_.reset(new std::atomic<int>[slots]);
  for (int s = 0; s < slots; ++s) c->in_flight_[s] = 0;
  c->region_bytes_ = sizeof(SlotHeader) + c->capacity_;
  for (int s = 0; s < slots; ++s) {
    if (!c->topology_.is_local(s)) {
      if (!c->shared_)
        return FailedPrecondition(
            "slot " + std::to_string(s) +
            " lives in another process: the host communicator needs the multi-process "
            "bootstrap (jax.distributed) for that");
      continue;
    }
    if (c->shared_) {
      const std::string name = shm_prefix + "_" + std::to_string(s);
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) return Internal("shm_open(" + name + ") failed: " + std::strerror(errno));
      c->names_[s] = name;  // from here on the destructor unlinks it
      if (ftruncate(fd, static_cast<off_t>(c->region_bytes_)) != 0) {
        close(fd);
        return Internal("ftruncate(" + name + ") failed: " + std::strerror(errno));
      }
      void* p = mmap(nullptr, c->region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (p == MAP_FAILED) return Internal("mmap(" + name + ") failed: " + std::strerror(errno));
      c->regions_[s] = static_cast<char*>(p);
    } else {
      void* p = std::aligned_alloc(64, (c->region_bytes_ + 63) / 64 * 64);
      if (p == nullptr)
        return Internal(Fmt("could not allocate %zu bytes of host userbuffer", c->region_bytes_));
      c->regions_[s] = static_cast<char*>(p);
    }
    std::memset(c->regions_[s], 0, sizeof(SlotHeader));
    c->header(s)->magic = kMagic;
  }
  *out = std::move(c);
  return Status::Ok();
}

Status HostCommunicator::Connect(const std::vector<std::string>& names) {
  const int slots = topology_.num_slots();
  if (static_cast<int>(names.size()) != slots)
    return InvalidArgument(Fmt("Connect needs %d names, got %zu", slots, names.size()));
  for (int s = 0; s < slots; ++s) {
    if (topology_.is_local(s) || regions_[s] != nullptr) continue;
    const std::string& name = names[s];
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0)
      return FailedPrecondition("cannot open the userbuffer of slot " + std::to_string(s) + " (" +
                                name + "): " + std::strerror(errno) +
                                "; its process is gone or on another host");
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != region_bytes_) {
      close(fd);
      return FailedPrecondition(
          Fmt("the userbuffer of slot %d holds %lld bytes, this process expects %zu: the processes "
              "were started with different shapes or buffer sizes",
              s, static_cast<long long>(st.st_size), region_bytes_));
    }
    void* p = mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return Internal("mmap(" + name + ") failed: " + std::strerror(errno));
    regions_[s] = static_cast<char*>(p);
    if (header(s)->magic != kMagic)
      return FailedPrecondition("slot " + std::to_string(s) + " (" + name +
                                ") is not a jax_ub userbuffer");
  }
  return Status::Ok();
}

bool HostCommunicator::Quiesce() {
  return WaitUntilIdle(timeout_s_, broken_, [&] {
    EvenCalls even;
    for (int s = 0; s < topology_.num_slots(); ++s) {
      if (!topology_.is_local(s)) continue;
      if (in_flight_[s].load() != 0) return false;
      even.Add(topology_.group_of(s), epoch_[s].load());
    }
    return even.even();
  });
}

void HostCommunicator::Unlink() {
  for (std::string& name : names_) {
    if (!name.empty()) shm_unlink(name.c_str());
    name.clear();
  }
}

HostCommunicator::~HostCommunicator() {
  // Queued calls run (or fail at their deadline) before the regions go, a held one too.
  if (hold_timer_.joinable()) hold_timer_.join();
  runners_.clear();
  completers_.clear();
  Unlink();
  for (int s = 0; s < static_cast<int>(regions_.size()); ++s) {
    if (regions_[s] == nullptr) continue;
    if (shared_) {
      munmap(regions_[s], region_bytes_);
    } else {
      std::free(regions_[s]);
    }
  }
}

Status HostCommunicator::Healthy() const {
  if (!broken_.broken()) return Status::Ok();
  return FailedPrecondition(std::string("jax_ub communicator is broken by an earlier error (") +
                            broken_.reason() +
                            "); call jax_ub.finalize() and run again to start afresh");
}

Status HostCommunicator::Begin(int device, OpKind op, const CallShape& shape, CallContext* ctx) {
  JAX_UB_RETURN_IF_ERROR(Healthy());
  int slot = 0;
  JAX_UB_RETURN_IF_ERROR(topology_.SlotOfDevice(device, &slot));
  const int size = topology_.group_size();
  const int64_t chunk_bytes = ChunkBytes(op, shape);
  const int64_t need = RequiredBytes(op, shape, schedule_.For(0, size));
  if (static_cast<size_t>(need) > capacity_)
    return InvalidArgument(Fmt(
        "%s: userbuffer too small: the op needs %lld bytes per device (chunks of %lld), "
        "the communicator has %zu; raise jax_ub.configure(buffer_bytes=...)",
        OpName(op), static_cast<long long>(need), static_cast<long long>(chunk_bytes), capacity_));
  ctx->op = op;
  ctx->slot = slot;
  ctx->group = topology_.group_of(slot);
  ctx->rank = topology_.rank_of(slot);
  ctx->size = size;
  ctx->epoch = ++epoch_[slot];
  ctx->desc = DescribeCall(op, shape, ctx->epoch);
  return Status::Ok();
}

void HostCommunicator::Fail(int slot, const Status& st) {
  broken_.Mark(st.message());
  // Tell the rest of the group, so their waits end now instead of at their deadline.
  const int size = topology_.group_size();
  const int group = topology_.group_of(slot);
  for (int r = 0; r < size; ++r) {
    SlotHeader* h = header(group * size + r);
    if (Load(&h->aborted) == 0) {
      std::snprintf(h->abort_reason, sizeof(h->abort_reason), "rank %d failed: %s",
                    topology_.rank_of(slot), st.message().c_str());
      Store(&h->aborted, 1);
    }
  }
}

Status HostCommunicator::WaitFlag(const CallContext& ctx, const uint64_t* flag, uint64_t target,
                                  int peer, const char* what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  const SlotHeader* own = header(ctx.slot);
  for (int spins = 0;; ++spins) {
    uint64_t v = Load(flag);
    if (v >= target) return Status::Ok();
    if (Load(&own->aborted) != 0)
      return FailedPrecondition(Fmt("%s: rank %d (group %d) stopped waiting for rank %d: %s",
                                    OpName(ctx.op), ctx.rank, ctx.group, peer, own->abort_reason));
    if (Clock::now() > deadline)
      return DeadlineExceeded(
          Fmt("%s: rank %d (group %d) timed out after %.1f s waiting for rank %d to %s for call "
              "#%llu (flag holds #%llu); %s",
              OpName(ctx.op), ctx.rank, ctx.group, timeout_s_, peer, what,
              static_cast<unsigned long long>(target), static_cast<unsigned long long>(v),
              QueuedInstead(ctx, peer).c_str()));
    Backoff(spins);
  }
}

std::string HostCommunicator::QueuedInstead(const CallContext& ctx, int peer) const {
  const SlotHeader* h = header(ctx.peer_slot(peer));
  const char* unknown = "the peer never arrived, is stuck, or runs a different program";
  if (Load(&h->queued_n) != ctx.epoch) return unknown;
  const CallDescriptor queued = h->queued_desc;
  std::atomic_thread_fence(std::memory_order_acquire);
  if (Load(&h->queued_n) != ctx.epoch) return unknown;  // rewritten while read
  return Fmt(
      "rank %d holds %s in place of this rank's %s: the ranks run different branches or "
      "programs",
      peer, queued.ToString().c_str(), ctx.desc.ToString().c_str());
}

Status HostCommunicator::CheckDescriptor(const CallContext& ctx, int peer) {
  const CallDescriptor& theirs = header(ctx.slot)->desc_from[peer];
  if (theirs.SameCall(ctx.desc)) return Status::Ok();
  return InvalidArgument(Fmt("ranks disagree on the call: rank %d runs %s but rank %d sent %s",
                             ctx.rank, ctx.desc.ToString().c_str(), peer,
                             theirs.ToString().c_str()));
}

Status HostCommunicator::Call(int device, OpKind op, const CallShape& shape, const Operands& ops) {
  CallContext ctx;
  JAX_UB_RETURN_IF_ERROR(Begin(device, op, shape, &ctx));
  return Execute(ctx, CallSteps(op, schedule_.For(ctx.rank, ctx.size), shape), shape, ops);
}

uint64_t* HostCommunicator::FlagWord(int slot, Flag flag, int rank) const {
  SlotHeader* h = header(slot);
  switch (flag) {
    case Flag::kData:
      return &h->data_epoch[rank];
    case Flag::kFirstPiece:
      return &h->first_piece_epoch[rank];
    case Flag::kBlock:
      return &h->block_epoch[rank];
    case Flag::kCredit:
      break;
  }
  return &h->credit_epoch[rank];
}

// One thread runs every lane's steps in list order, which the schedule makes a valid
// order: memcpy for copies, atomics for flags, the host GEMM for products. Descriptors are
// checked as each peer's data lands, before it is read, so kVerify has nothing left to do.
Status HostCommunicator::Execute(const CallContext& ctx, const std::vector<Step>& steps,
                                 const CallShape& shape, const Operands& ops) {
  auto at = [&](const Ref& r) {
    return Resolve(r, ops, data(ctx.slot), [&](int p) { return data(ctx.peer_slot(p)); });
  };
  // Host memory: the scales are read here; fp8 products are scaled by both.
  const float scale = IsFp8(shape.in) ? ops.scales[0] * ops.scales[kScaleStride] : 1.0f;
  for (const Step& step : steps) {
    Status st = Status::Ok();
    switch (step.kind) {
      case Step::Kind::kWait:
        st = WaitFlag(ctx, FlagWord(ctx.slot, step.flag, FlagSlot(step, ctx.rank)),
                      ctx.epoch - Lag(step.flag), step.peer, step.what);
        // A credit is the peer's previous call's; our own GEMM's block flag carries no descriptor.
        if (st.ok() && step.flag != Flag::kCredit && step.flag != Flag::kBlock)
          st = CheckDescriptor(ctx, step.peer);
        break;
      case Step::Kind::kPublish:
        header(ctx.peer_slot(step.peer))->desc_from[ctx.rank] = ctx.desc;
        break;
      case Step::Kind::kCopy:
        std::memcpy(at(step.dst), at(step.src), step.bytes);
        break;
      case Step::Kind::kSignal:
        Store(FlagWord(ctx.peer_slot(step.peer), step.flag, FlagSlot(step, ctx.rank)), ctx.epoch);
        break;
      case Step::Kind::kGemm: {
        char* dst = at(step.dst);
        // A GEMM that waits for each block itself, or that signals each: block by block here.
        if (step.parts != 0) {
          const int64_t rows = step.rows / ctx.size;
          const int64_t in_rows = rows * shape.k * DTypeSize(shape.in);
          const int64_t out_rows = rows * shape.n * DTypeSize(shape.out);
          const Schedule sched = schedule_.For(ctx.rank, ctx.size);
          const std::vector<int> order =
              step.signals ? sched.SignalGemmOrder(step.parts) : sched.FlagGemmOrder(step.parts);
          for (int j : order) {
            const bool own = !step.signals && j == ctx.rank;  // the op's own input, where it lies
            const char* a = own ? at(step.own) : at(step.src) + j * in_rows;
            if (own && a == nullptr) st = Internal("a flag GEMM without its own block's place");
            if (!step.signals && j != ctx.rank) {  // ours: nothing to wait for
              st = WaitFlag(ctx, FlagWord(ctx.slot, Flag::kData, j), ctx.epoch, j,
                            "deliver its chunk");
              if (st.ok()) st = CheckDescriptor(ctx, j);
            }
            if (!st.ok()) break;
            char* aux = at(step.aux);
            st = HostGemm(shape.in, shape.w_type, shape.out, a, ops.w, ops.w_transposed, scale,
                          dst + j * out_rows, rows, shape.k, shape.n,
                          step.epilogue ? shape.epilogue : Epilogue{}, ops.bias,
                          aux == nullptr ? nullptr : aux + j * out_rows);
            if (!st.ok()) break;
            if (step.signals && j != ctx.rank)
              Store(FlagWord(ctx.slot, Flag::kBlock, j), ctx.epoch);
          }
          break;
        }
        // The addend (a fold's partial sum) is added to the float32 product, rounded once.
        st = HostGemm(shape.in, shape.w_type, shape.out, at(step.src), ops.w, ops.w_transposed,
                      scale, dst, step.rows, shape.k, shape.n,
                      step.epilogue ? shape.epilogue : Epilogue{}, ops.bias, at(step.aux),
                      at(step.addend));
        break;
      }
      case Step::Kind::kSum: {  // from the float32 addend, the partials in bit order
        const void* parts[64];
        int count = 0;
        for (int j = 0; j < 64; ++j)
          if (step.parts >> j & 1) parts[count++] = at(step.src) + j * step.bytes;
        st = HostSum(shape.out, parts, count, at(step.dst), step.rows * shape.n,
                     reinterpret_cast<const float*>(at(step.addend)), step.to_float);
        break;
      }
      case Step::Kind::kJoin:    // lanes run in list order here
      case Step::Kind::kVerify:  // checked at each wait
        break;
    }
    if (!st.ok()) {
      Fail(ctx.slot, st);
      return st;
    }
  }
  return Status::Ok();
}

}  // namespace jax_ub
