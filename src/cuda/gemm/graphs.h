// A GEMM plan's runs replayed from CUDA graphs (GemmOptions::graphs). The host's cost of a
// cublasLtMatmul call (11-20 us on an H200's host, most of a small op's handler) is paid once
// per operand set, at its capture; a graph launch of the same kernels costs a few. A graph is
// bound to the addresses its kernels were given, so one is kept per operand set: captured
// the second time the set is seen (a training step's buffers recur from step to step; a set
// seen once may never come back) and launched every time after. A plan keeps a few, the
// least recently used replaced.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace jax_ub {

class GemmGraphs {
 public:
  // Everything a run of a plan's kernels reads its addresses from: its operands, the
  // epilogue's and fp8 scales' pointers, and which workspace it runs in.
  struct Operands {
    const void* a = nullptr;
    const void* b = nullptr;
    void* c = nullptr;
    const void* addend = nullptr;
    const float* scales = nullptr;
    const void* bias = nullptr;
    void* aux = nullptr;
    bool second_workspace = false;
    bool operator==(const Operands& o) const {
      return a == o.a && b == o.b && c == o.c && addend == o.addend && scales == o.scales &&
             bias == o.bias && aux == o.aux && second_workspace == o.second_workspace;
    }
  };

  GemmGraphs() = default;
  GemmGraphs(const GemmGraphs&) = delete;
  GemmGraphs& operator=(const GemmGraphs&) = delete;
  ~GemmGraphs();

  // The graph captured for `ops`, or null: then `*capture` says whether to capture one now
  // (the set was seen before) and Add it; else the caller runs the GEMM as it is.
  cudaGraphExec_t Find(const Operands& ops, bool* capture);
  // Keeps `exec`, the graph of `ops`' run (owned from now on).
  void Add(const Operands& ops, cudaGraphExec_t exec);
  int64_t launches() const { return launches_; }

 private:
  // Graphs kept a plan; operand sets remembered as seen once.
  static constexpr size_t kGraphs = 4, kSeen = 8;
  struct Entry {
    Operands ops;
    cudaGraphExec_t exec = nullptr;  // null: seen once, not captured
    uint64_t used = 0;               // the Find that last matched it
  };
  // The entry to replace among those with (exec != nullptr) == `captured`: the least recently
  // used once there are `most` of them, else a new one.
  Entry& EntryToFill(bool captured, size_t most);
  std::vector<Entry> entries_;
  uint64_t finds_ = 0;
  int64_t launches_ = 0;  // Finds that returned a graph
};

}  // namespace jax_ub
