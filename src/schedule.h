// Platform-neutral schedule of the overlapped ops: which chunk moves and which chunk is
// computed at each step. The host and CUDA communicators both follow it, so CI exercises
// the same order that runs on GPUs.
#pragma once

#include <cstdint>
#include <vector>

namespace jax_ub {

// One tensor-parallel group of `size` ranks, seen from `rank`.
struct Schedule {
  int rank;
  int size;
  // Smallest piece (rows) worth folding a reduce-scatter for; negative: never
  // (CommOptions::reduce_scatter_fold_rows). Not needed by the all-gather's schedule.
  int64_t fold_rows = -1;

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

  // How many row pieces a reduce-scatter block of `rows` rows is computed and sent in, and
  // whether this rank's own block folds in the partial it receives instead of a separate
  // sum pass. At size 2 the one peer partial becomes the accumulator (C, beta = 1) of our
  // own product, piece by piece: the peer sends its first piece while computing its
  // second, and its second while computing our first, so no wait is exposed and the sum
  // pass (~2% of the call on an H200) is gone. Pieces of few rows cost GEMM efficiency
  // (on 2 H200s the fold was 1% slower with 512-row pieces and tied with 2048), hence
  // `fold_rows`. With more ranks a fold would need the peers' partials summed first.
  bool ReduceScatterFolds(int64_t rows) const {
    return size == 2 && fold_rows >= 0 && rows / 2 >= fold_rows;
  }

  // A run of rows of a block.
  struct Rows {
    int64_t first;
    int64_t count;
  };

  // The row ranges, in order, that each reduce-scatter block of `rows` rows is computed
  // and sent in: its two halves where it folds (the first may be empty), else the block.
  std::vector<Rows> ReduceScatterPieces(int64_t rows) const {
    if (!ReduceScatterFolds(rows)) return {{0, rows}};
    return {{0, rows / 2}, {rows / 2, rows - rows / 2}};
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
