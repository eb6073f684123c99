#include "cuda/gemm/graphs.h"

namespace jax_ub {

GemmGraphs::~GemmGraphs() {
  for (Entry& e : entries_)
    if (e.exec != nullptr) cudaGraphExecDestroy(e.exec);
}

cudaGraphExec_t GemmGraphs::Find(const Operands& ops, bool* capture) {
  ++finds_;
  *capture = false;
  for (Entry& e : entries_) {
    if (!(e.ops == ops)) continue;
    e.used = finds_;
    if (e.exec != nullptr) {
      ++launches_;
      return e.exec;
    }
    *capture = true;  // seen before: worth a graph
    return nullptr;
  }
  Entry& seen = EntryToFill(false, kSeen);
  seen.ops = ops;
  seen.used = finds_;
  return nullptr;
}

void GemmGraphs::Add(const Operands& ops, cudaGraphExec_t exec) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it)
    if (it->exec == nullptr && it->ops == ops) {
      entries_.erase(it);  // no longer only seen
      break;
    }
  Entry& kept = EntryToFill(true, kGraphs);
  if (kept.exec != nullptr) cudaGraphExecDestroy(kept.exec);
  kept.ops = ops;
  kept.exec = exec;
  kept.used = finds_;
}

GemmGraphs::Entry& GemmGraphs::EntryToFill(bool captured, size_t most) {
  Entry* oldest = nullptr;
  size_t count = 0;
  for (Entry& e : entries_) {
    if ((e.exec != nullptr) != captured) continue;
    ++count;
    if (oldest == nullptr || e.used < oldest->used) oldest = &e;
  }
  if (count >= most) return *oldest;
  entries_.emplace_back();
  return entries_.back();
}

}  // namespace jax_ub
