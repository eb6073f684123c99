// The two ops' schedules: what each rank pushes, waits for and multiplies, in order
// (Schedule gives the order; the host communicator runs the same one).
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda_check.h"
#include "cuda_communicator.h"
#include "cuda_communicator_internal.h"
#include "cuda_driver.h"
#include "cuda_sum.h"
#include "cuda_verify.h"
#include "schedule.h"
#include "trace.h"

namespace jax_ub {

Status CudaCommunicator::AllGatherMatmul(int device, cudaStream_t xs, DType t, const void* x,
                                         const void* w, bool w_transposed, void* out,
                                         void* gathered, int64_t m, int64_t k, int64_t n) {
  const auto since = Clock::now();
  Slot* s = nullptr;
  Status st = EnqueueAllGatherMatmul(device, xs, t, x, w, w_transposed, out, gathered, m, k, n, &s);
  return EndCall(s, "all_gather_matmul", since, std::move(st));
}

Status CudaCommunicator::MatmulReduceScatter(int device, cudaStream_t xs, DType t, const void* x,
                                             const void* w, bool w_transposed, void* out, int64_t m,
                                             int64_t k, int64_t n) {
  const auto since = Clock::now();
  Slot* s = nullptr;
  Status st = EnqueueMatmulReduceScatter(device, xs, t, x, w, w_transposed, out, m, k, n, &s);
  return EndCall(s, "matmul_reduce_scatter", since, std::move(st));
}

Status CudaCommunicator::EnqueueAllGatherMatmul(int device, cudaStream_t xs, DType t, const void* x,
                                                const void* w, bool w_transposed, void* out,
                                                void* gathered, int64_t m, int64_t k, int64_t n,
                                                Slot** began) {
  const char* op = "all_gather_matmul";
  const int size = topology_.group_size();
  const int64_t es = DTypeSize(t);
  const int64_t chunk = m * k * es;
  Slot* s = nullptr;
  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(
      Begin(device, op, RequiredBytes(OpKind::kAllGatherMatmul, chunk, size), &s, &e));
  *began = s;
  const Schedule sched{s->rank, size};
  const std::vector<int> peers = sched.PushOrder();
  const CallDescriptor desc{
      static_cast<uint32_t>(OpKind::kAllGatherMatmul), static_cast<uint32_t>(t), m, k, n, e};
  std::vector<Wait> waits;
  // A shape's first call picks (and loads) its GEMM kernels before anything waits on a
  // peer (see CublasLtGemm::Prepare). Remote chunks may still be landing in `buffer`,
  // which only matters for their values; `out` is rewritten below.
  const std::vector<Schedule::Span> spans = sched.AllGatherSpans();
  std::vector<CublasLtGemm::Plan*> plans(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const void* src = spans[i].first == s->rank ? x : s->buffer + spans[i].first * chunk;
    JAX_UB_RETURN_IF_ERROR(s->gemm->Prepare(t, src, w, w_transposed,
                                            static_cast<char*>(out) + spans[i].first * m * n * es,
                                            spans[i].count * m, k, n, nullptr, s->tune, &plans[i]));
  }
  s->gemm->BeginCall();
  JAX_UB_CUDA(cudaEventRecord(s->start, xs));
  JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->start));

  // Push our shard to every peer at once, one copy-engine stream per peer.
  for (int p : peers) {
    cudaStream_t cs = s->comm[p];
    JAX_UB_CUDA(cudaStreamWaitEvent(cs, s->start));
    JAX_UB_RETURN_IF_ERROR(
        WaitFlag(*s, cs, kCreditFlag + p, e - 1, p, "free its userbuffer", &waits));
    JAX_UB_RETURN_IF_ERROR(Publish(*s, cs, p, desc));
    JAX_UB_CUDA(cudaMemcpyAsync(s->peer_buffer[p] + s->rank * chunk, x, chunk,
                                cudaMemcpyDeviceToDevice, cs));
    JAX_UB_RETURN_IF_ERROR(Signal(cs, s->peer_flags[p] + kDataFlag + s->rank, e));
    JAX_UB_CUDA(cudaEventRecord(s->comm_done[p], cs));
  }
  // The gathered copy, when asked for, runs on its own stream beside the GEMMs.
  cudaStream_t gs = s->comm[s->rank];
  if (gathered != nullptr) {
    JAX_UB_CUDA(cudaStreamWaitEvent(gs, s->start));
    JAX_UB_CUDA(cudaMemcpyAsync(static_cast<char*>(gathered) + s->rank * chunk, x, chunk,
                                cudaMemcpyDeviceToDevice, gs));
  }
  // Multiply the local chunk, then the remote ones once they have landed.
  for (size_t i = 0; i < spans.size(); ++i) {
    const Schedule::Span& span = spans[i];
    const char* src = static_cast<const char*>(x);
    if (span.first != s->rank) {
      for (int j = span.first; j < span.first + span.count; ++j) {
        JAX_UB_RETURN_IF_ERROR(
            WaitFlag(*s, s->compute, kDataFlag + j, e, j, "deliver its chunk", &waits));
        if (gathered != nullptr)
          JAX_UB_RETURN_IF_ERROR(
              WaitFlag(*s, gs, kDataFlag + j, e, j, "deliver its chunk", &waits));
      }
      src = s->buffer + span.first * chunk;
      if (gathered != nullptr)
        JAX_UB_CUDA(cudaMemcpyAsync(static_cast<char*>(gathered) + span.first * chunk, src,
                                    span.count * chunk, cudaMemcpyDeviceToDevice, gs));
    }
    JAX_UB_RETURN_IF_ERROR(s->gemm->Matmul(
        plans[i], src, w, static_cast<char*>(out) + span.first * m * n * es, s->compute));
  }
  if (gathered != nullptr) {
    JAX_UB_CUDA(cudaEventRecord(s->ready[s->rank], gs));
    JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->ready[s->rank]));
  }
  JAX_UB_RETURN_IF_ERROR(
      Verify(*s, desc, out, size * m * n * es, gathered, gathered == nullptr ? 0 : size * chunk));
  // Our buffer is free again: tell every sender.
  for (int p : peers)
    JAX_UB_RETURN_IF_ERROR(Signal(s->compute, s->peer_flags[p] + kCreditFlag + s->rank, e));
  return Finish(*s, xs, op, e, std::move(waits));
}

Status CudaCommunicator::EnqueueMatmulReduceScatter(int device, cudaStream_t xs, DType t,
                                                    const void* x, const void* w, bool w_transposed,
                                                    void* out, int64_t m, int64_t k, int64_t n,
                                                    Slot** began) {
  const char* op = "matmul_reduce_scatter";
  const int size = topology_.group_size();
  const int64_t es = DTypeSize(t);
  const int64_t chunk = m * n * es;
  Slot* s = nullptr;
  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(
      Begin(device, op, RequiredBytes(OpKind::kMatmulReduceScatter, chunk, size), &s, &e));
  *began = s;
  const Schedule sched{s->rank, size, fold_rows_};
  const CallDescriptor desc{
      static_cast<uint32_t>(OpKind::kMatmulReduceScatter), static_cast<uint32_t>(t), m, k, n, e};
  std::vector<Wait> waits;
  char* recv = s->buffer;                  // [size] partials addressed to us, by sender
  char* stage = s->buffer + size * chunk;  // [size] partials we computed for each peer
  char* own = recv + s->rank * chunk;      // our own partial, when it is summed in a pass
  // Each block in `pieces` row ranges (Schedule::ReduceScatterPieces); with `fold`, our
  // own product adds the peer's partial in its epilogue and writes `out`, with no sum pass.
  const std::vector<Schedule::Rows> piece_rows = sched.ReduceScatterPieces(m);
  const int pieces = static_cast<int>(piece_rows.size());
  const bool fold = sched.ReduceScatterFolds(m);
  auto offset = [&](int p) { return piece_rows[p].first * n * es; };  // in a partial
  auto input = [&](int d, int p) {                                    // piece p of row block d of x
    return static_cast<const char*>(x) + (d * m + piece_rows[p].first) * k * es;
  };
  // Where our own block's piece p goes, and what it adds (null: nothing).
  char* own_out = size == 1 || fold ? static_cast<char*>(out) : own;
  auto addend = [&](int p) -> const char* {
    return fold ? recv + (1 - s->rank) * chunk + offset(p) : nullptr;
  };
  // A shape's first call picks (and loads) its GEMM kernels before anything waits on a
  // peer (see CublasLtGemm::Prepare), with our own block's operands. Peers may be writing
  // their partials into `recv` meanwhile, which only matters for values; this writes
  // only `out` and our own slot of `recv`, which no peer writes.
  std::vector<CublasLtGemm::Plan*> plans(pieces);
  for (int p = 0; p < pieces; ++p)
    JAX_UB_RETURN_IF_ERROR(s->gemm->Prepare(t, input(s->rank, p), w, w_transposed,
                                            own_out + offset(p), piece_rows[p].count, k, n,
                                            addend(p), s->tune, &plans[p]));
  s->gemm->BeginCall();
  JAX_UB_CUDA(cudaEventRecord(s->start, xs));
  JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->start));
  // Each peer's partial first, each piece sent while the next one is computed; ours last.
  for (int d : sched.ReduceScatterComputeOrder()) {
    for (int p = 0; p < pieces; ++p) {
      const char* a = input(d, p);
      if (d == s->rank) {
        if (fold) {
          const int peer = 1 - s->rank;
          // A first-piece flag says nothing of unpieced calls: report the data flag.
          JAX_UB_RETURN_IF_ERROR(WaitFlag(*s, s->compute, PieceFlag(p, pieces) + peer, e, peer,
                                          "deliver its partial sum", &waits, kDataFlag + peer));
        }
        JAX_UB_RETURN_IF_ERROR(
            s->gemm->Matmul(plans[p], a, w, own_out + offset(p), s->compute, addend(p)));
        continue;
      }
      char* dst = stage + d * chunk + offset(p);
      JAX_UB_RETURN_IF_ERROR(s->gemm->Matmul(plans[p], a, w, dst, s->compute));
      cudaStream_t cs = s->comm[d];
      JAX_UB_CUDA(cudaEventRecord(s->ready[d], s->compute));
      JAX_UB_CUDA(cudaStreamWaitEvent(cs, s->ready[d]));
      if (p == 0) {
        JAX_UB_RETURN_IF_ERROR(
            WaitFlag(*s, cs, kCreditFlag + d, e - 1, d, "free its userbuffer", &waits));
        JAX_UB_RETURN_IF_ERROR(Publish(*s, cs, d, desc));
      }
      JAX_UB_CUDA(cudaMemcpyAsync(s->peer_buffer[d] + s->rank * chunk + offset(p), dst,
                                  piece_rows[p].count * n * es, cudaMemcpyDeviceToDevice, cs));
      JAX_UB_RETURN_IF_ERROR(Signal(cs, s->peer_flags[d] + PieceFlag(p, pieces) + s->rank, e));
    }
    if (d != s->rank) JAX_UB_CUDA(cudaEventRecord(s->comm_done[d], s->comm[d]));
  }
  if (size > 1 && !fold) {
    for (int j : sched.ReductionOrder()) {
      if (j == s->rank) continue;
      JAX_UB_RETURN_IF_ERROR(
          WaitFlag(*s, s->compute, kDataFlag + j, e, j, "deliver its partial sum", &waits));
    }
    JAX_UB_RETURN_IF_ERROR(LaunchSum(t, recv, m * n, size, out, s->compute));
  }
  JAX_UB_RETURN_IF_ERROR(Verify(*s, desc, out, chunk, nullptr, 0));
  // Credits promise peers the whole buffer, staging area included: wait until our own
  // partials have left it, or a peer's next push could overwrite one still in flight.
  const std::vector<int> peers = sched.PushOrder();
  for (int p : peers) JAX_UB_CUDA(cudaStreamWaitEvent(s->compute, s->comm_done[p]));
  for (int p : peers)
    JAX_UB_RETURN_IF_ERROR(Signal(s->compute, s->peer_flags[p] + kCreditFlag + s->rank, e));
  return Finish(*s, xs, op, e, std::move(waits));
}

}  // namespace jax_ub
