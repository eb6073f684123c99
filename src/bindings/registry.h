// Process-wide table of live communicators, keyed by the int64 id that crosses the FFI
// as an attribute. Handlers take a shared reference, so a communicator destroyed while a
// call is in flight lives until that call returns. The reset path is jax_ub.finalize(),
// which removes every communicator it created (destroy_communicator).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace jax_ub {

template <typename T>
class Registry {
 public:
  static int64_t Add(std::shared_ptr<T> item) {
    std::lock_guard<std::mutex> lock(mu());
    int64_t id = ++next_id();
    items().emplace(id, std::move(item));
    return id;
  }
  static std::shared_ptr<T> Get(int64_t id) {
    std::lock_guard<std::mutex> lock(mu());
    auto it = items().find(id);
    return it == items().end() ? nullptr : it->second;
  }
  static bool Remove(int64_t id) {
    std::shared_ptr<T> item;
    {
      std::lock_guard<std::mutex> lock(mu());
      auto it = items().find(id);
      if (it == items().end()) return false;
      item = std::move(it->second);
      items().erase(it);
    }
    // The last reference goes here, outside the lock: the destructor waits for the calls
    // in flight, and the completion of one may start the program's next call, whose
    // handler looks its communicator up (and, finding none, fails instead of waiting). A
    // handler that found it just before holds it while it enqueues its call: wait until
    // it lets go, so that the destructor runs on this thread. Where the last reference
    // fell in a handler run on one of the communicator's own threads (the host's
    // completers run XLA's continuations), that thread would join itself. Bounded: a
    // handler holds it only to enqueue.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (item.use_count() > 1 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (item.use_count() > 1)
      std::fprintf(stderr,
                   "jax_ub: communicator %lld was still held by a call 60 s after "
                   "finalize() removed it; it is freed when that call lets go\n",
                   static_cast<long long>(id));
    item.reset();
    return true;
  }
  static size_t Size() {
    std::lock_guard<std::mutex> lock(mu());
    return items().size();
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int64_t& next_id() {
    static int64_t id = 0;
    return id;
  }
  static std::unordered_map<int64_t, std::shared_ptr<T>>& items() {
    static auto* m = new std::unordered_map<int64_t, std::shared_ptr<T>>();
    return *m;
  }
};

}  // namespace jax_ub
