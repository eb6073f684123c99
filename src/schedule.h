// Platform-neutral schedule of the overlapped ops: which chunk moves and which chunk is
// computed at each step. The host and CUDA communicators both follow it, so CI exercises
// the same order that runs on GPUs.
#pragma once

#include <vector>

namespace jax_ub {

// One tensor-parallel group of `size` ranks, seen from `rank`.
struct Schedule {
  int rank;
  int size;

  // Peers in the order this rank pushes its data to them: nearest first, so every
  // rank's first push goes to a different peer and no link is hit twice at once.
  std::vector<int> PushOrder() const {
    std::vector<int> order;
    for (int s = 1; s < size; ++s) order.push_back((rank + s) % size);
    return order;
  }

  // Chunks of the all-gathered operand in the order their products are computed:
  // the local chunk first (it needs no communication), then peers in the order their
  // pushes are expected to land (rank-1 pushes to us first, see PushOrder).
  std::vector<int> AllGatherComputeOrder() const {
    std::vector<int> order{rank};
    for (int s = 1; s < size; ++s) order.push_back((rank - s + size) % size);
    return order;
  }

  // Row blocks of the reduce-scatter input in the order their partial products are
  // computed: the block each peer needs first (so its transfer overlaps the next
  // product), the block this rank keeps last.
  std::vector<int> ReduceScatterComputeOrder() const {
    std::vector<int> order = PushOrder();
    order.push_back(rank);
    return order;
  }

  // Partials are summed in rank order, independent of arrival, so results are
  // bitwise reproducible run to run.
  std::vector<int> ReductionOrder() const {
    std::vector<int> order;
    for (int j = 0; j < size; ++j) order.push_back(j);
    return order;
  }
};

}  // namespace jax_ub
