// What one call of an op does, as seen by one rank. Every rank sends its descriptor with
// its chunks, and a receiver compares it with its own: a peer running a different op,
// shape, dtype or call number is an error naming both sides, never wrong numbers.
// Shared by the host and CUDA communicators; on GPUs it travels as five 64-bit words.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "protocol/dtype.h"

namespace jax_ub {

enum class OpKind : uint32_t { kAllGatherMatmul = 1, kMatmulReduceScatter = 2 };

inline const char* OpName(OpKind op) {
  switch (op) {
    case OpKind::kAllGatherMatmul:
      return "all_gather_matmul";
    case OpKind::kMatmulReduceScatter:
      return "matmul_reduce_scatter";
  }
  return "unknown op";
}

// The OpKind an op's name (as OpName spells it) stands for; false for any other name.
inline bool OpKindFromName(const std::string& name, OpKind* op) {
  for (OpKind k : {OpKind::kAllGatherMatmul, OpKind::kMatmulReduceScatter}) {
    if (name == OpName(k)) {
      *op = k;
      return true;
    }
  }
  return false;
}

// Set in CallDescriptor::op beside a reduce-scatter's OpKind where the call also
// all-gathers a second input (CallShape::gathered): peers must agree on that too.
constexpr uint32_t kAlsoGathers = 1u << 8;

struct CallDescriptor {
  uint32_t op = 0;     // an OpKind, with kAlsoGathers
  uint32_t dtype = 0;  // PackTypes(x's, w's and the output's type)
  int64_t rows = 0;    // rows of the local operand (x for AG, the output for RS)
  int64_t k = 0;
  int64_t n = 0;
  uint64_t epoch = 0;

  static constexpr int kWords = 5;

  bool SameCall(const CallDescriptor& o) const {
    return op == o.op && dtype == o.dtype && rows == o.rows && k == o.k && n == o.n &&
           epoch == o.epoch;
  }
  std::string ToString() const {
    if (op == 0 && epoch == 0) return "nothing (no call arrived)";
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%s%s(%s, rows=%lld, k=%lld, n=%lld, call #%llu)",
                  OpName(static_cast<OpKind>(op & ~kAlsoGathers)),
                  (op & kAlsoGathers) != 0 ? "+all_gather" : "", TypesName(dtype).c_str(),
                  static_cast<long long>(rows), static_cast<long long>(k),
                  static_cast<long long>(n), static_cast<unsigned long long>(epoch));
    return buf;
  }
};
static_assert(sizeof(CallDescriptor) == CallDescriptor::kWords * sizeof(uint64_t),
              "CallDescriptor must pack into whole 64-bit words");

}  // namespace jax_ub
