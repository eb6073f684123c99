// The two ops on GPUs: each call's steps (protocol/schedule.h, the same list the host communicator
// runs) enqueued on this slot's streams: lanes become streams, flags stream memory
// operations, copies copy-engine transfers, GEMMs cuBLASLt.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda/check.h"
#include "cuda/communicator.h"
#include "cuda/communicator_internal.h"
#include "cuda/driver_api.h"
#include "cuda/gemm/block_gemm_calls.h"
#include "cuda/gemm/flag_gemm.h"
#include "cuda/sum.h"
#include "cuda/trace.h"
#include "cuda/verify.h"
#include "protocol/buffer_layout.h"
#include "protocol/schedule.h"

namespace jax_ub {

int CudaCommunicator::FlagIndex(Flag flag, int rank) {
  switch (flag) {
    case Flag::kData:
      return kDataFlag + rank;
    case Flag::kFirstPiece:
      return kFirstPieceFlag + rank;
    case Flag::kBlock:
      return kBlockFlag + rank;
    case Flag::kCredit:
      break;
  }
  return kCreditFlag + rank;
}

Status CudaCommunicator::EnqueueFlagGemm(Slot& s, cudaStream_t stream, const Schedule& sched,
                                         const Step& step, const CallShape& shape, const void* w,
                                         bool w_transposed, const void* src, const void* own,
                                         void* dst, uint64_t epoch, std::vector<Wait>* waits) {
  if (own == nullptr) return Internal("FlagGemm: a call without its own block's place (x)");
  FlagGemmCall c;
  static_cast<BlockGemmCall&>(c) = BlockCall(sched, step, shape, w, w_transposed, src, dst);
  c.own = own;
  c.own_block = sched.rank;
  c.flags = s.flags + FlagIndex(Flag::kData, 0);
  c.target = epoch;
  c.fired = &s.board_device->fired;  // the watchdog's, where a peer stalls in the kernel's waits
  c.health = s.flags + kHealthFlag;
  for (int j : sched.FlagGemmOrder(step.parts)) {
    c.order |= uint64_t(j) << (4 * c.count++);
    if (j == sched.rank) continue;  // ours is the op's input (c.own): the kernel takes it at once
    const int index = FlagIndex(Flag::kData, j);
    // The kernel holds every SM while it waits, so nothing its peers' chunks depend on may
    // need this GPU's SMs then. Where a peer shares this GPU, its kernels and copies do: the
    // stream waits for every chunk before the kernel. Elsewhere the stream waits until every
    // peer has begun the call (its descriptor, which each push lane publishes before its copy
    // once the call's inputs are ready), so that what is left are copy-engine transfers: not
    // on work of this GPU's other streams (a collective of another axis) that a peer's inputs
    // may wait for. The kernel's own waits are listed for the watchdog, which names an
    // overdue one and releases it by raising its flag.
    if (s.shares_gpu) {
      JAX_UB_RETURN_IF_ERROR(WaitFlag(s, stream, index, epoch, j, "deliver its chunk", waits));
    } else if (epoch > 0) {
      constexpr int kEpochWord = offsetof(CallDescriptor, epoch) / sizeof(uint64_t);
      JAX_UB_RETURN_IF_ERROR(WaitFlag(s, stream,
                                      kDescFlag + j * CallDescriptor::kWords + kEpochWord, epoch, j,
                                      "begin the call (publish its descriptor)", waits));
      waits->push_back(Wait{j, s.flags + index, epoch, "deliver its chunk", s.flags + index});
    }
  }
  JAX_UB_RETURN_IF_ERROR(LaunchFlagGemm(c, s.device, s.sm_count, stream));
  s.flag_gemm_calls.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status CudaCommunicator::EnqueueSignalGemm(Slot& s, cudaStream_t stream, const Schedule& sched,
                                           const Step& step, const CallShape& shape, const void* w,
                                           bool w_transposed, const void* src, void* dst,
                                           uint64_t epoch) {
  const SignalGemmCall c = SignalCall(
      sched, step, shape, w, w_transposed, src, dst, s.flags + FlagIndex(Flag::kBlock, 0),
      reinterpret_cast<unsigned long long*>(s.flags + kBlockCountFlag), epoch);
  JAX_UB_RETURN_IF_ERROR(LaunchSignalGemm(c, s.device, s.sm_count, stream));
  s.signal_gemm_calls.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status CudaCommunicator::Enqueue(int device, cudaStream_t xs, OpKind op, const CallShape& shape,
                                 const Operands& ops, Slot** began) {
  const char* name = OpName(op);
  const int size = topology_.group_size();
  Slot* s = nullptr;
  uint64_t e = 0;
  JAX_UB_RETURN_IF_ERROR(
      Begin(device, name, RequiredBytes(op, shape, schedule_.For(0, size)), &s, &e));
  *began = s;
  // The flag GEMM (all-gather) or the signal GEMM (reduce-scatter) where this GPU and the call
  // allow it (FlagGemmFits; TMA reads x and w, and writes out or the buffer, 16-byte aligned);
  // else the call keeps its library GEMMs.
  Schedule sched = schedule_.For(s->rank, size);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool fits = s->flag_gemm_runs &&
                    FlagGemmFits(shape.in, shape.w_type, shape.out, shape.epilogue.Any(), shape.m,
                                 shape.k, shape.n, size) &&
                    aligned(ops.x) && aligned(ops.w);
  if (op != OpKind::kAllGatherMatmul || !fits || !aligned(ops.out))
    sched.flag_gemm = ScheduleChoice::kOff;
  if (op != OpKind::kMatmulReduceScatter || !fits) sched.signal_gemm = ScheduleChoice::kOff;
  const std::vector<Step> steps = CallSteps(op, sched, shape);
  const CallDescriptor desc = DescribeCall(op, shape, e);
  // fp8 products are scaled by x_scale and w_scale on the device; others are not.
  const float* scales = IsFp8(shape.in) ? ops.scales : nullptr;
  auto at = [&](const Ref& r) {
    return Resolve(r, ops, s->buffer, [&](int p) { return s->peer_buffer[p]; });
  };
  // A shape's first call picks (and loads) its GEMM kernels before anything waits on a
  // peer (see CublasLtGemm::Prepare), with the operands of its steps. Peers may be writing
  // their chunks into our buffer meanwhile, which only matters for values: Prepare writes
  // only its step's destination (our output or staging area), which the step rewrites.
  auto gemm_args = [&](const Step& g) {
    GemmArgs args;
    args.addend = at(g.addend);
    args.scales = scales;
    args.second_workspace = g.lane == kSecondGemmLane;
    if (g.epilogue) {
      args.bias = ops.bias;
      args.aux = at(g.aux);
    }
    return args;
  };
  // The reduce-scatter's GEMMs run cuBLASLt's heuristic pick where it is not tuned (see
  // CommOptions::autotune_reduce_scatter), but in fp8: there tuning's pick was faster.
  const bool heuristic = op == OpKind::kMatmulReduceScatter && !IsFp8(shape.in);
  CublasLtGemm* gemm =
      heuristic && s->reduce_scatter_gemm != nullptr ? s->reduce_scatter_gemm.get() : s->gemm.get();
  std::vector<CublasLtGemm::Plan*> plans(steps.size(), nullptr);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& g = steps[i];
    if (g.kind != Step::Kind::kGemm || g.parts != 0) continue;  // FlagGemm has no plan
    if (g.lane == kSecondGemmLane) JAX_UB_RETURN_IF_ERROR(gemm->AddSecondWorkspace());
    JAX_UB_RETURN_IF_ERROR(gemm->Prepare(shape.in, shape.w_type, shape.out, at(g.src), ops.w,
                                         ops.w_transposed, at(g.dst), g.rows, shape.k, shape.n,
                                         g.epilogue ? shape.epilogue : Epilogue{}, gemm_args(g),
                                         s->tune, &plans[i]));
  }
  gemm->BeginCall();
  // Lanes: the compute stream, the second GEMM lane's and one copy-engine stream per rank,
  // each starting after the caller's work (on its first step), marked by `start` before any
  // step is enqueued. A call whose steps all run on XLA's stream (a group of one, its GEMM
  // on the caller's stream) needs no mark: one CUDA call fewer on every such call.
  std::vector<bool> started(size, false);
  bool second_started = false;
  // The compute lane: XLA's stream itself, or ours after XLA's work.
  cudaStream_t compute = compute_on_caller_stream_ ? xs : s->compute;
  const bool other_lanes =
      compute != xs ||
      std::any_of(steps.begin(), steps.end(), [](const Step& g) { return g.lane != kComputeLane; });
  if (other_lanes) JAX_UB_CUDA(cudaEventRecord(s->start, xs));
  auto lane = [&](int l) -> cudaStream_t {
    if (l == kComputeLane) return compute;
    return l == kSecondGemmLane ? s->second_gemm : s->comm[l];
  };
  if (compute != xs) JAX_UB_CUDA(cudaStreamWaitEvent(compute, s->start));
  std::vector<Wait> waits;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    cudaStream_t stream = lane(step.lane);
    const int slot = FlagSlot(step, s->rank);  // a wait's or signal's flag word
    if (step.lane >= 0 && !started[step.lane]) {
      JAX_UB_CUDA(cudaStreamWaitEvent(stream, s->start));
      started[step.lane] = true;
    } else if (step.lane == kSecondGemmLane && !second_started) {
      JAX_UB_CUDA(cudaStreamWaitEvent(stream, s->start));
      second_started = true;
    }
    switch (step.kind) {
      case Step::Kind::kWait: {
        // Our own GEMM's block flag is not the watchdog's to release (its push would send a
        // partial not yet written): a call stuck there is named as a whole.
        std::vector<Wait> own_gemm;
        JAX_UB_RETURN_IF_ERROR(WaitFlag(*s, stream, FlagIndex(step.flag, slot), e - Lag(step.flag),
                                        step.peer, step.what,
                                        step.flag == Flag::kBlock ? &own_gemm : &waits,
                                        FlagIndex(ProgressFlag(step.flag), slot)));
        break;
      }
      case Step::Kind::kPublish:
        JAX_UB_RETURN_IF_ERROR(Publish(*s, stream, step.peer, desc));
        break;
      case Step::Kind::kCopy:
        JAX_UB_CUDA(cudaMemcpyAsync(at(step.dst), at(step.src), step.bytes,
                                    cudaMemcpyDeviceToDevice, stream));
        break;
      case Step::Kind::kSignal:
        JAX_UB_RETURN_IF_ERROR(
            Signal(stream, s->peer_flags[step.peer] + FlagIndex(step.flag, slot), e));
        break;
      case Step::Kind::kGemm:
        if (step.signals) {
          JAX_UB_RETURN_IF_ERROR(EnqueueSignalGemm(*s, stream, sched, step, shape, ops.w,
                                                   ops.w_transposed, at(step.src), at(step.dst),
                                                   e));
          break;
        }
        if (step.parts != 0) {
          JAX_UB_RETURN_IF_ERROR(EnqueueFlagGemm(*s, stream, sched, step, shape, ops.w,
                                                 ops.w_transposed, at(step.src), at(step.own),
                                                 at(step.dst), e, &waits));
          break;
        }
        JAX_UB_RETURN_IF_ERROR(
            gemm->Matmul(plans[i], at(step.src), ops.w, at(step.dst), stream, gemm_args(step)));
        break;
      case Step::Kind::kSum:
        JAX_UB_RETURN_IF_ERROR(LaunchSumStep(shape.out, step, shape.n, at(step.src),
                                             at(step.addend), at(step.dst), stream));
        break;
      case Step::Kind::kJoin: {
        // A copy lane's event is its own, as the second GEMM lane's; the compute lane's, one
        // per copy lane it releases (the second GEMM lane starts after the caller's work and
        // never waits for the compute lane's).
        if (step.on_lane == kComputeLane && step.lane < 0)
          return Internal("a step list joins the compute lane into lane " +
                          std::to_string(step.lane) + ", which has no event for it");
        cudaEvent_t ev = step.on_lane == kComputeLane      ? s->ready[step.lane]
                         : step.on_lane == kSecondGemmLane ? s->second_gemm_done
                                                           : s->comm_done[step.on_lane];
        JAX_UB_CUDA(cudaEventRecord(ev, lane(step.on_lane)));
        JAX_UB_CUDA(cudaStreamWaitEvent(stream, ev));
        break;
      }
      case Step::Kind::kVerify: {
        CallOutputs outputs;
        outputs.regions[0] = {at(step.dst), static_cast<size_t>(step.bytes)};
        outputs.regions[1] = {at(step.src), static_cast<size_t>(step.src_bytes)};
        if (step.aux.region != Region::kNone)  // laid out as out
          outputs.regions[2] = {at(step.aux), static_cast<size_t>(step.bytes)};
        JAX_UB_RETURN_IF_ERROR(Verify(*s, compute, desc, outputs));
        break;
      }
    }
  }
  // Every copy lane joins the caller's stream in Finish.
  for (int r = 0; r < size; ++r)
    if (started[r]) JAX_UB_CUDA(cudaEventRecord(s->comm_done[r], s->comm[r]));
  return Finish(*s, xs, name, e, std::move(waits));
}

}  // namespace jax_ub
