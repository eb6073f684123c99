// How a call of the overlapped ops lays out its bytes: one rank's chunk, what it tells its peers,
// and where in the userbuffer the reduce-scatter keeps its received, staged and gathered chunks
// and its early float32 sum, hence how large a buffer a call needs. Split from schedule.h, whose
// step lists (CallSteps) place their steps by these offsets.
#pragma once

#include <cstdint>

#include "protocol/call_descriptor.h"
#include "protocol/schedule.h"

namespace jax_ub {

// One rank's chunk in bytes: x for AG, the output (one partial) for RS.
inline int64_t ChunkBytes(OpKind op, const CallShape& c) {
  return op == OpKind::kAllGatherMatmul ? c.m * c.k * DTypeSize(c.in)
                                        : c.m * c.n * DTypeSize(c.out);
}

// Whether a call of `op` moves a second input's all-gather beside its own data.
inline bool AlsoGathers(OpKind op, const CallShape& c) {
  return op == OpKind::kMatmulReduceScatter && c.gathered;
}

// What this rank tells its peers about the call (see CallDescriptor).
inline CallDescriptor DescribeCall(OpKind op, const CallShape& c, uint64_t epoch) {
  const uint32_t kind = static_cast<uint32_t>(op) | (AlsoGathers(op, c) ? kAlsoGathers : 0);
  return CallDescriptor{kind, PackTypes(c.in, c.w_type, c.out), c.m, c.k, c.n, epoch};
}

// The reduce-scatter's chunks per rank: received, staged and (where it `also_gathers`)
// gathered, `group_size` of each.
inline int64_t ReduceScatterChunkArea(int64_t chunk_bytes, int group_size, bool also_gathers) {
  return (also_gathers ? 3 : 2) * chunk_bytes * group_size;
}
// Where in the userbuffer a reduce-scatter's early sum (Schedule::ReduceScatterSumsEarly)
// keeps its float32 partial sum: after the received, staged and gathered chunks, 256-byte
// aligned (a chunk of an odd size would leave it mid-word). It takes at most two chunks: a
// partial's elements as float32, for outputs of 2 bytes or more. Only calls that sum early
// have it.
inline int64_t EarlySumOffset(int64_t chunk_bytes, int group_size, bool also_gathers) {
  return (ReduceScatterChunkArea(chunk_bytes, group_size, also_gathers) + 255) / 256 * 256;
}

// Userbuffer bytes per rank that a call needs, `chunk_bytes` being ChunkBytes. AG: a chunk
// per rank. RS: a received partial per rank, plus as many staged for sending (a peer may
// still be reading our last push), plus, where it `also_gathers`, a gathered chunk per rank,
// and where it `sums_early` (Schedule::ReduceScatterSumsEarly) the float32 partial sum.
inline int64_t RequiredBytes(OpKind op, int64_t chunk_bytes, int group_size,
                             bool also_gathers = false, bool sums_early = false) {
  if (op != OpKind::kMatmulReduceScatter) return chunk_bytes * group_size;
  if (!sums_early) return ReduceScatterChunkArea(chunk_bytes, group_size, also_gathers);
  return EarlySumOffset(chunk_bytes, group_size, also_gathers) + 2 * chunk_bytes;
}
// Whether a call of `op` and shape `c` sums early in `sched`'s group (only a reduce-scatter).
inline bool SumsEarly(OpKind op, const CallShape& c, const Schedule& sched) {
  return op == OpKind::kMatmulReduceScatter && sched.ReduceScatterSumsEarly(c);
}
// The same for a call of shape `c` in `sched`'s group.
inline int64_t RequiredBytes(OpKind op, const CallShape& c, const Schedule& sched) {
  return RequiredBytes(op, ChunkBytes(op, c), sched.size, AlsoGathers(op, c),
                       SumsEarly(op, c, sched));
}

}  // namespace jax_ub
