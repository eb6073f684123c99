// How a slot's calls reach its thread and in which order (OrderedRunner): the runners,
// the group leader's order log, and the test hooks around them.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "host/communicator.h"
#include "host/shared_words.h"
#include "protocol/buffer_layout.h"
#include "protocol/schedule.h"

namespace jax_ub {

void HostCommunicator::CallAsync(int device, uint64_t key, OpKind op, const CallShape& shape,
                                 const Operands& ops, std::function<void(const Status&)> done) {
  int slot = 0;
  Status st = topology_.SlotOfDevice(device, &slot);
  if (!st.ok()) return done(st);
  OrderedRunner* runner = nullptr;
  SerialQueue* completer = nullptr;
  {
    std::lock_guard<std::mutex> lock(queues_mu_);
    if (!runners_[slot]) {
      OrderedRunner::Order order;
      if (topology_.rank_of(slot) == 0) {
        order.publish = [this, slot](uint64_t n, const CallKey& k) { PublishKey(slot, n, k); };
      } else {
        order.await_key = [this, slot](uint64_t n, CallKey* k) { return AwaitKey(slot, n, k); };
        order.note_queued = [this, slot](uint64_t n, const CallDescriptor* d) {
          NoteQueued(slot, n, d);
        };
      }
      order.healthy = [this] { return Healthy(); };
      runners_[slot] = std::make_unique<OrderedRunner>(std::move(order), timeout_s_);
      completers_[slot] = std::make_unique<SerialQueue>();
    }
    runner = runners_[slot].get();
    completer = completers_[slot].get();
  }
  const CallKey id{key, DescribeCall(op, shape, 0)};
  ++in_flight_[slot];
  auto task = [this, device, op, shape, ops, slot, completer,
               done = std::move(done)](const Status& order_st) mutable {
    Status result = order_st;
    if (result.ok()) {
      result = Call(device, op, shape, ops);
    } else if (!broken_.broken()) {
      Fail(slot, result);
    }
    --in_flight_[slot];
    completer->Post([result, done = std::move(done)] { done(result); });
  };
  {
    std::lock_guard<std::mutex> lock(queues_mu_);
    if (slot == hold_slot_) {
      hold_slot_ = -1;
      held_key_ = key;
      hold_timer_ = std::thread([runner, id, task = std::move(task), s = hold_s_]() mutable {
        std::this_thread::sleep_for(std::chrono::duration<double>(s));
        runner->Post(id, std::move(task));
      });
      return;
    }
  }
  runner->Post(id, std::move(task));
}

Status HostCommunicator::HoldNextCall(int device, double seconds) {
  int slot = 0;
  JAX_UB_RETURN_IF_ERROR(topology_.SlotOfDevice(device, &slot));
  std::lock_guard<std::mutex> lock(queues_mu_);
  if (hold_timer_.joinable()) hold_timer_.join();  // the last hold's call is handed over
  hold_slot_ = slot;
  hold_s_ = seconds;
  return Status::Ok();
}

void HostCommunicator::PublishKey(int slot, uint64_t n, const CallKey& key) {
  SlotHeader* h = header(slot);
  // A seqlock: the entry reads as no call's while it is rewritten, so that a reader that
  // took call n - kOrderLog's number cannot pass with half of call n's descriptor.
  Store(&h->order_n[n % kOrderLog], 0);
  std::atomic_thread_fence(std::memory_order_release);
  h->order_desc[n % kOrderLog] = key.desc;
  Store(&h->order_key[n % kOrderLog], key.key);
  Store(&h->order_n[n % kOrderLog], n);
}

Status HostCommunicator::AwaitKey(int slot, uint64_t n, CallKey* key) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  const int size = topology_.group_size();
  const int group = topology_.group_of(slot);
  const int rank = topology_.rank_of(slot);
  const SlotHeader* leader = header(group * size);
  const SlotHeader* own = header(slot);
  for (int spins = 0;; ++spins) {
    JAX_UB_RETURN_IF_ERROR(Healthy());
    // An abort says why first: a broken leader may race ahead of us through its log.
    if (Load(&own->aborted) != 0)
      return FailedPrecondition(
          Fmt("rank %d (group %d) stopped waiting for rank 0: %s", rank, group, own->abort_reason));
    const uint64_t logged = Load(&leader->order_n[n % kOrderLog]);
    if (logged == n) {
      key->key = Load(&leader->order_key[n % kOrderLog]);
      key->desc = leader->order_desc[n % kOrderLog];
      std::atomic_thread_fence(std::memory_order_acquire);
      // Still call n's entry: rank 0 did not overwrite it while we read (else the check
      // below says we fell behind).
      if (Load(&leader->order_n[n % kOrderLog]) == n) return Status::Ok();
      continue;
    }
    if (logged > n)
      return Internal(
          Fmt("rank %d (group %d) fell more than %d calls behind rank 0 (at its "
              "call #%llu, rank 0 at #%llu)",
              rank, group, kOrderLog, static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(logged)));
    if (Clock::now() > deadline)
      return DeadlineExceeded(
          Fmt("rank %d (group %d) timed out after %.1f s waiting for rank 0 to start call #%llu; "
              "the peer never arrived, is stuck, or runs a different program",
              rank, group, timeout_s_, static_cast<unsigned long long>(n)));
    Backoff(spins);
  }
}

void HostCommunicator::NoteQueued(int slot, uint64_t n, const CallDescriptor* queued) {
  SlotHeader* h = header(slot);
  Store(&h->queued_n, 0);
  if (queued == nullptr) return;  // withdrawn
  std::atomic_thread_fence(std::memory_order_release);
  h->queued_desc = *queued;
  Store(&h->queued_n, n);
}

Status HostCommunicator::LeaderOrder(int device, std::vector<uint64_t>* keys) const {
  int slot = 0;
  JAX_UB_RETURN_IF_ERROR(topology_.SlotOfDevice(device, &slot));
  const SlotHeader* leader = header(topology_.group_of(slot) * topology_.group_size());
  std::vector<std::pair<uint64_t, uint64_t>> log;
  for (int i = 0; i < kOrderLog; ++i) {
    const uint64_t n = Load(&leader->order_n[i]);
    if (n != 0) log.push_back({n, Load(&leader->order_key[i])});
  }
  std::sort(log.begin(), log.end());
  keys->clear();
  for (const auto& entry : log) keys->push_back(entry.second);
  return Status::Ok();
}

}  // namespace jax_ub
