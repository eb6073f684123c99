// Userbuffer communicator on the host: the CPU implementation of the protocol.
//
// Every (group, rank) slot owns one symmetric region in host memory: a header with
// epoch flags and descriptors, then `capacity` bytes of data. Peers write their chunks
// straight into each other's regions and raise flags; the receiver computes on each
// chunk as it lands. This is the same protocol the CUDA communicator runs, with memcpy
// in place of copy engines and atomics in place of stream memory operations.
//
// Threading: XLA's CPU runtime runs the devices of one process concurrently, so every
// device's call is a real concurrent peer. Waits poll with backoff (CI has 2 cores and up
// to 8 devices) and give up at a deadline with an error. The FFI handlers call CallAsync:
// a call runs on its slot's own thread while XLA's goes on with the device's independent
// work, so a device that starts an XLA collective before a jax_ub call its peer started
// first does not hold that peer's call (nor its own collective) hostage.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host/ordered_runner.h"
#include "host/serial_queue.h"
#include "protocol/broken_state.h"
#include "protocol/call_descriptor.h"
#include "protocol/comm_options.h"
#include "protocol/dtype.h"
#include "protocol/schedule.h"
#include "protocol/status.h"
#include "protocol/topology.h"

namespace jax_ub {

// How many of its latest calls a group leader's order log keeps (OrderedRunner): a leader
// starts call n + 1 only after every peer has started call n, so two would do.
constexpr int kOrderLog = 8;

// Layout of the front of every symmetric region. Written by peers; all flag words are
// accessed atomically.
struct alignas(64) SlotHeader {
  uint64_t magic;
  uint64_t aborted;  // nonzero once any rank of the group failed
  char abort_reason[512];
  uint64_t data_epoch[kMaxRanks];         // [j]: chunk from rank j (or ring slot j) is in place
  uint64_t first_piece_epoch[kMaxRanks];  // [j]: its first piece, if sent in two (Schedule)
  uint64_t credit_epoch[kMaxRanks];       // [j]: rank j consumed my chunks through this epoch
  uint64_t block_epoch[kMaxRanks];        // [j]: my own GEMM wrote block j (Step::signals)
  CallDescriptor desc_from[kMaxRanks];
  // A group leader's order log: its call #n had key order_key[n % kOrderLog] once
  // order_n[n % kOrderLog] holds n.
  uint64_t order_n[kOrderLog];
  uint64_t order_key[kOrderLog];
  CallDescriptor order_desc[kOrderLog];
  // What this rank holds queued in place of its leader's call #queued_n (OrderedRunner),
  // for the leader's timeout to name; a seqlock as the order log.
  uint64_t queued_n;
  CallDescriptor queued_desc;
};

class HostCommunicator {
 public:
  // Allocates the regions of the slots local to this process. `options.timeout_s` bounds
  // every wait on a peer; its schedule choices (Schedule::Of) shape every call's steps.
  // With a non-empty `shm_prefix` the local regions are POSIX shared memory objects
  // named `<prefix>_<slot>`, which processes holding the other slots map with Connect();
  // otherwise every slot must be local and plain memory is used.
  static Status Create(Topology topology, size_t capacity_bytes, const CommOptions& options,
                       const std::string& shm_prefix, std::unique_ptr<HostCommunicator>* out);
  ~HostCommunicator();

  // Shared-memory names of the local slots, by slot ("" for remote slots).
  const std::vector<std::string>& region_names() const { return names_; }
  // Map the regions of remote slots; names[slot] is ignored for local slots.
  Status Connect(const std::vector<std::string>& names);
  // Remove the local shared-memory names once every peer has mapped them: the mappings
  // stay, and nothing is left behind in /dev/shm if a process dies later.
  void Unlink();

  // One call of `op` (see CallShape) for the group of the slot owned by `device`, run on
  // the slot's call thread in the order its group leader runs its calls, matched by
  // `key` (OrderedRunner; a leader runs them in the order of CallAsync's calls); its
  // status goes to `done`
  // on another thread (XLA's CPU runtime may go on with the device's program
  // inside `done`, even into an XLA collective that waits for a peer: the slot's next
  // call must not wait behind it). `ops` must stay valid until `done`.
  void CallAsync(int device, uint64_t key, OpKind op, const CallShape& shape, const Operands& ops,
                 std::function<void(const Status&)> done);

  // For tests: the next call `device` makes reaches its slot's thread only after `seconds`,
  // behind any call the device makes meanwhile, as if XLA had started them in the other
  // order (tests/test_call_order.py).
  Status HoldNextCall(int device, double seconds);
  // For tests: the key of the last call HoldNextCall held.
  uint64_t held_key() {
    std::lock_guard<std::mutex> lock(queues_mu_);
    return held_key_;
  }
  // For tests: the keys of the latest calls (up to kOrderLog) the leader of `device`'s
  // group ran, oldest first.
  Status LeaderOrder(int device, std::vector<uint64_t>* keys) const;

  // Wait up to the timeout until no call is running and every local slot has made the
  // same number of calls: then no rank is left waiting for a peer whose call was
  // dispatched but has not started yet. Returns whether that state was reached.
  bool Quiesce();

  // Why the communicator is broken, or "" while it is healthy.
  std::string BrokenReason() const { return broken_.reason(); }

  size_t capacity() const { return capacity_; }
  const Topology& topology() const { return topology_; }

 private:
  HostCommunicator() = default;

  // The call itself, on the slot's call thread.
  Status Call(int device, OpKind op, const CallShape& shape, const Operands& ops);

  struct CallContext;
  // Ok, or why no call can run: the communicator is broken.
  Status Healthy() const;
  Status Begin(int device, OpKind op, const CallShape& shape, CallContext* ctx);
  Status WaitFlag(const CallContext& ctx, const uint64_t* flag, uint64_t target, int peer,
                  const char* what);
  Status CheckDescriptor(const CallContext& ctx, int peer);
  // Marks the communicator broken and tells the rest of `slot`'s group.
  void Fail(int slot, const Status& st);
  // The order log of `slot`'s group leader: publish the key of its call #n (leader), or
  // wait until the leader has (every other rank).
  void PublishKey(int slot, uint64_t n, const CallKey& key);
  Status AwaitKey(int slot, uint64_t n, CallKey* key);
  // A waiting rank's note of the call it holds in place of the leader's #n (SlotHeader;
  // nullptr withdraws it), and
  // what a timeout waiting for `peer` says of it: the note for `ctx`'s call, or that none came.
  void NoteQueued(int slot, uint64_t n, const CallDescriptor* queued);
  std::string QueuedInstead(const CallContext& ctx, int peer) const;
  // Runs one call's steps (protocol/schedule.h); on an error, fails the group and returns it.
  Status Execute(const CallContext& ctx, const std::vector<Step>& steps, const CallShape& shape,
                 const Operands& ops);
  // The word of `flag` for `rank` in `slot`'s header.
  uint64_t* FlagWord(int slot, Flag flag, int rank) const;
  SlotHeader* header(int slot) const { return reinterpret_cast<SlotHeader*>(regions_[slot]); }
  char* data(int slot) const { return regions_[slot] + sizeof(SlotHeader); }

  Topology topology_;
  size_t capacity_ = 0;
  double timeout_s_ = 0;
  size_t region_bytes_ = 0;
  std::vector<char*> regions_;      // every slot's region (local ones owned here)
  std::vector<std::string> names_;  // shared-memory names of local slots, until Unlink()
  bool shared_ = false;             // regions are shared-memory mappings (mmap), else aligned_alloc
  Schedule schedule_;               // the options' choices, see Create
  // Per slot: calls begun. Written by the slot's call thread (one call at a time), read
  // by Quiesce.
  std::unique_ptr<std::atomic<uint64_t>[]> epoch_;
  BrokenState broken_;
  // Per slot, made on its first CallAsync: the thread running its calls, the one handing
  // their statuses to XLA, and how many calls are queued or running (Quiesce waits for 0).
  std::mutex queues_mu_;
  std::vector<std::unique_ptr<OrderedRunner>> runners_;
  std::vector<std::unique_ptr<SerialQueue>> completers_;
  std::unique_ptr<std::atomic<int>[]> in_flight_;
  // HoldNextCall, under queues_mu_: the slot whose next call is held (-1: none), for how
  // long, and the thread that hands it over.
  int hold_slot_ = -1;
  double hold_s_ = 0;
  uint64_t held_key_ = 0;
  std::thread hold_timer_;
};

}  // namespace jax_ub
