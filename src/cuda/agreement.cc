// How a group's GPUs agree on GEMM kernels (KernelAgreement, cuda/gemm/cublaslt_gemm.h):
// group rank 0's host writes each message into a ring of flag words of every other rank,
// whose host polls its own ring. A message is rare (a new GEMM shape, a trial's end) and
// waits only on the leader's host, which sends before it waits on anything of ours.
#include <string>

#include "cuda/check.h"
#include "cuda/communicator.h"
#include "cuda/communicator_internal.h"

namespace jax_ub {

class CudaCommunicator::SlotAgreement : public KernelAgreement {
 public:
  SlotAgreement(CudaCommunicator* comm, Slot* slot) : comm_(comm), s_(slot) {}

  bool leader() const override { return s_->rank == 0; }

  Status Send(uint64_t serial, uint64_t word) override {
    const uint64_t tagged = Tagged(serial, word);
    for (int r = 0; r < comm_->topology_.group_size(); ++r) {
      if (r == s_->rank) continue;
      // The ring's word is free once the follower has read the message kChoiceRing before.
      if (serial > kChoiceRing) {
        JAX_UB_RETURN_IF_ERROR(Await(
            s_->flags + kChoiceReadFlag + r,
            [&](uint64_t seen) { return seen + kChoiceRing >= serial; },
            "rank " + std::to_string(r) + " to read kernel message #" +
                std::to_string(serial - kChoiceRing)));
      }
      JAX_UB_RETURN_IF_ERROR(Write(s_->peer_flags[r] + Word(serial), tagged));
    }
    return Status::Ok();
  }

  Status Receive(uint64_t serial, const std::string& what, uint64_t* word) override {
    uint64_t got = 0;
    JAX_UB_RETURN_IF_ERROR(Await(
        s_->flags + Word(serial),
        [&](uint64_t seen) {
          got = seen;
          return seen >> kTagShift == Tag(serial);
        },
        "group rank 0 to send " + what + " (kernel message #" + std::to_string(serial) + ")"));
    *word = got & kPayload;
    return Write(s_->peer_flags[0] + kChoiceReadFlag + s_->rank, serial);
  }

 private:
  // The host writes one word of (peer) device memory.
  Status Write(uint64_t* dst, uint64_t value) {
    JAX_UB_CUDA(cudaMemcpyAsync(dst, &value, sizeof(value), cudaMemcpyHostToDevice, s_->tune));
    JAX_UB_CUDA(cudaStreamSynchronize(s_->tune));
    return Status::Ok();
  }

  // Polls a word of this slot's flags until `done` holds, within the op's timeout.
  template <typename Done>
  Status Await(const uint64_t* flag, Done done, const std::string& what) {
    const std::string who = "GPU " + std::to_string(s_->device) + " (rank " +
                            std::to_string(s_->rank) + " of group " + std::to_string(s_->group) +
                            ")";
    auto read = [&](bool* ok) {
      uint64_t seen = 0;
      JAX_UB_CUDA(cudaMemcpyAsync(&seen, flag, sizeof(seen), cudaMemcpyDeviceToHost, s_->tune));
      JAX_UB_CUDA(cudaStreamSynchronize(s_->tune));
      *ok = done(seen);
      return Status::Ok();
    };
    return comm_->PollHost(
        read, DeadlineIn(comm_->timeout_s_), [&] { return who; },
        [&] {
          return who + " timed out after " + std::to_string(comm_->timeout_s_) + " s waiting for " +
                 what + ", which never arrived, failed, or runs a different program";
        });
  }

  // A message word: a 16-bit tag from the serial number (never 0, which an unwritten word
  // holds) above a 48-bit payload. The ring holds kChoiceRing messages; the leader waits
  // for a follower to have read a message before writing over it.
  static constexpr int kTagShift = 48;
  static constexpr uint64_t kPayload = (uint64_t{1} << kTagShift) - 1;
  static uint64_t Tag(uint64_t serial) { return (serial - 1) % 0xffff + 1; }
  static uint64_t Tagged(uint64_t serial, uint64_t word) {
    return Tag(serial) << kTagShift | (word & kPayload);
  }
  static int Word(uint64_t serial) { return kChoiceFlag + static_cast<int>(serial % kChoiceRing); }

  CudaCommunicator* comm_;
  Slot* s_;
};

std::unique_ptr<KernelAgreement> CudaCommunicator::MakeAgreement(Slot* s) {
  return std::make_unique<SlotAgreement>(this, s);
}

std::vector<CudaCommunicator::KernelChoice> CudaCommunicator::KernelChoices() const {
  std::vector<KernelChoice> out;
  for (const auto& sp : slots_) {
    if (!sp || !sp->local) continue;
    for (const CublasLtGemm* g : {sp->gemm.get(), sp->reduce_scatter_gemm.get()}) {
      if (g == nullptr) continue;
      for (const CublasLtGemm::Choice& c : g->Choices()) out.push_back(KernelChoice{sp->device, c});
    }
  }
  return out;
}

}  // namespace jax_ub
