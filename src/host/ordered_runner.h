// A slot's call thread: runs the calls XLA hands it one at a time, in the order the
// slot's group leader (rank 0) runs them.
//
// Why not simply in arrival order: XLA's CPU runtime runs a large program's thunks as a
// dataflow graph, so calls with no data path between them (the AGs of q and k, an AG and
// an unrelated RS) are started as their inputs become ready, in an order that differs
// between devices and runs. Peers pair calls by their count, so every rank of a group must
// run them in one order. The leader runs its calls as they arrive and publishes each
// call's key (src/bindings/ffi_cpu.h: its site in the lowering and its copy, the same in
// every process); the other ranks run, as their n-th call, the queued call with the key of
// the leader's n-th. That cannot deadlock: the leader's n-th call needed only calls among
// its first n - 1, so the same call on another rank becomes ready once those have run
// there, and the runtime goes on starting ready calls while earlier ones are queued here.
// Ranks that run different branches (a rank-dependent lax.cond) have calls of different
// keys: the leader's n-th never comes, and both sides time out naming both calls (Take).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "protocol/call_descriptor.h"
#include "protocol/status.h"

namespace jax_ub {

// What identifies a queued call: its key (src/bindings/ffi_cpu.h) and what it does (the
// descriptor, call number 0).
struct CallKey {
  uint64_t key = 0;
  CallDescriptor desc;
};

class OrderedRunner {
 public:
  // How the slot learns the order. The leader has `publish` (called with n and the key
  // before its n-th call runs); every other rank has `await_key`, which waits up to the
  // deadline for the leader's n-th key. `healthy` says why waiting is pointless (the
  // communicator is broken), checked while a rank waits for the leader's call to arrive.
  // `note_queued` (optional) tells the group what a waiting rank holds in place of the
  // leader's n-th call, for the leader's timeout to name.
  struct Order {
    std::function<void(uint64_t n, const CallKey& key)> publish;
    std::function<Status(uint64_t n, CallKey* key)> await_key;
    std::function<Status()> healthy;
    // (nullptr: the call came after all; the note is withdrawn).
    std::function<void(uint64_t n, const CallDescriptor* queued)> note_queued;
  };
  // Runs the call, or reports `st` in its place when no order could be agreed.
  using Task = std::function<void(const Status& st)>;

  OrderedRunner(Order order, double timeout_s)
      : order_(std::move(order)), timeout_s_(timeout_s), thread_([this] { Run(); }) {}
  // Runs (or fails) what is queued, then joins.
  ~OrderedRunner() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  OrderedRunner(const OrderedRunner&) = delete;
  OrderedRunner& operator=(const OrderedRunner&) = delete;

  void Post(const CallKey& key, Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_.push_back({key, std::move(task)});
    }
    cv_.notify_one();
  }

 private:
  struct Queued {
    CallKey key;
    Task task;
  };

  void Run() {
    for (uint64_t n = 1;; ++n) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queued_.empty(); });
        if (queued_.empty()) return;  // stopped, nothing left
      }
      Status st = Status::Ok();
      Queued next = Take(n, &st);
      next.task(st);
    }
  }

  // The call to run as the n-th: the leader's oldest; elsewhere the one with the key of
  // the leader's n-th, however long it takes to come, up to the timeout: a rank may lag by
  // that much, so no other call may run first (a call that does something else would fail
  // the descriptor check of a valid program; one that does the same could pair the wrong
  // data). Past the timeout the ranks run different branches or programs: the error names
  // the leader's call and the oldest queued one. On an error, the oldest, to report it.
  Queued Take(uint64_t n, Status* st) {
    if (order_.publish) {
      std::lock_guard<std::mutex> lock(mu_);
      Queued q = PopFront();
      order_.publish(n, q.key);
      return q;
    }
    CallKey lead;
    *st = order_.await_key(n, &lead);
    lead.desc.epoch = n;
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    bool noted = false;
    while (st->ok()) {
      for (auto it = queued_.begin(); it != queued_.end(); ++it) {
        if (it->key.key != lead.key) continue;
        Queued q = std::move(*it);
        queued_.erase(it);
        if (noted) order_.note_queued(n, nullptr);
        return q;
      }
      CallDescriptor front = queued_.front().key.desc;
      front.epoch = n;
      const bool other = !front.SameCall(lead.desc);
      if (other && !noted && order_.note_queued) {
        order_.note_queued(n, &front);
        noted = true;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        *st = DeadlineExceeded("rank 0 of the group ran " + lead.desc.ToString() +
                               ", and this device's program did not make that call within " +
                               std::to_string(timeout_s_) + " s; it made " + front.ToString() +
                               (other ? " in its place" : " from another place in the program") +
                               ": the ranks run different branches or programs");
        break;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(10));
      *st = order_.healthy();
    }
    return PopFront();
  }

  Queued PopFront() {
    Queued q = std::move(queued_.front());
    queued_.pop_front();
    return q;
  }

  const Order order_;
  const double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queued_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace jax_ub
