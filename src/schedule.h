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

  // A run of consecutive chunks multiplied by one GEMM once all of them have landed.
  struct Span {
    int first;
    int count;
  };

  // GEMMs of the all-gather product, in order: the local chunk first (it needs no
  // communication and hides the pushes, which all start at once), then the remote chunks
  // as at most two contiguous row ranges (after and before our own rows). Few large GEMMs
  // run at full efficiency where one small GEMM per chunk would not.
  std::vector<Span> AllGatherSpans() const {
    std::vector<Span> spans{{rank, 1}};
    if (rank + 1 < size) spans.push_back({rank + 1, size - rank - 1});
    if (rank > 0) spans.push_back({0, rank});
    return spans;
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
