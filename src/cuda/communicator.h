// Userbuffer communicator on CUDA GPUs driven by one process.
//
// Each (group, rank) slot owns, on its GPU: a symmetric buffer that the group's peers
// copy into over NVLink (CUDA peer access, copy engines: no SMs taken from the GEMM),
// and a small flag array with epoch counters. All waiting for peers' data happens on the
// GPU through stream memory operations; no host thread ever waits for another device's
// work. The host threads of one process do meet once per call, after each has enqueued
// its whole call (see AwaitLocalPeers): a GPU must never wait on work that a peer's host
// thread has yet to enqueue, or a driver call that drains a device (a kernel module that
// cuDNN or cuBLAS loads on first use holds the driver's lock while it waits) deadlocks.
// A watchdog thread bounds every wait: past the deadline it names the missing peer,
// marks the communicator broken and releases the stuck streams. No NVLink multicast.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/gemm/cublaslt_gemm.h"
#include "cuda/release.h"
#include "protocol/broken_state.h"
#include "protocol/call_descriptor.h"
#include "protocol/comm_options.h"
#include "protocol/dtype.h"
#include "protocol/schedule.h"
#include "protocol/status.h"
#include "protocol/topology.h"

namespace jax_ub {

class CudaCommunicator {
 public:
  // With `multiprocess`, slots of other processes are mapped later: ExportHandles() gives
  // this process's CUDA IPC handles, Connect() opens the others' (through jax.distributed's
  // key-value store in between). Otherwise every slot must be local.
  // The options' schedule choices (Schedule::Of) shape every call's steps.
  static Status Create(Topology topology, size_t capacity_bytes, const CommOptions& options,
                       bool multiprocess, std::unique_ptr<CudaCommunicator>* out);
  // By slot: the IPC handles (buffer, flags) of local slots, "" for remote ones.
  Status ExportHandles(std::vector<std::string>* handles) const;
  Status Connect(const std::vector<std::string>& handles);
  ~CudaCommunicator();

  // One call of `op` (see CallShape), enqueued after `stream`'s work and joined back into
  // it. fp8 inputs need w stored as its transpose [n, k] (cuBLASLt's fp8 layout).
  Status Call(int device, cudaStream_t stream, OpKind op, const CallShape& shape,
              const Operands& ops);

  // Wait up to the timeout until every local slot has made the same number of calls and
  // all their GPU work has finished. Returns whether that state was reached.
  bool Quiesce();

  // Host time the handler threads spend per call, for finding whether small ops are
  // bound by the host: by local GPU, the calls made, the nanoseconds inside the op
  // (enqueueing included) and the part of it spent in AwaitLocalPeers.
  struct HostTime {
    int device;
    int64_t calls;
    int64_t total_ns;
    int64_t await_ns;
  };
  std::vector<HostTime> HostTimes() const;

  // How many FlagGemm (with `signals`: SignalGemm) kernels each local GPU has launched:
  // (device, launches).
  std::vector<std::pair<int, int64_t>> FlagGemmCalls(bool signals = false) const;

  // Every local GPU's GEMM kernel per shape (CublasLtGemm::Choices), for tests and tools.
  struct KernelChoice {
    int device;
    CublasLtGemm::Choice choice;
  };
  std::vector<KernelChoice> KernelChoices() const;

  const Topology& topology() const { return topology_; }
  // Why the communicator is broken, or "" while it is healthy.
  std::string BrokenReason() const { return broken_.reason(); }

  // Written by the device (host-mapped memory) when a peer's call descriptor differs from
  // this slot's own; read by the watchdog once the call has finished.
  struct DeviceReport {
    uint64_t code;  // nonzero once written
    uint64_t peer;
    CallDescriptor mine;
    CallDescriptor theirs;
  };

  // The outputs of a call that a failed check fills with NaN (Verify): out, the gathered
  // copy, the pre-GELU product (Step::kVerify); an empty one has no bytes.
  struct Output {
    void* data = nullptr;
    size_t bytes = 0;
  };
  struct CallOutputs {
    Output regions[3];
  };

 private:
  // Flag words per slot: data[j] (chunk from rank j landed, by epoch; a ring's partial sums
  // by their slot, Step::slot), first_piece[j] (the first piece of a chunk sent in two,
  // Schedule::ReduceScatterPieces), credit[j] (rank j
  // consumed what this slot sent it, by epoch), health (nonzero once a wait of this slot
  // timed out or a peer's call differed: every later output of the slot is poisoned with
  // NaN), then the call descriptor each rank sent with its latest chunk.
  static constexpr int kDataFlag = 0;
  static constexpr int kFirstPieceFlag = kMaxRanks;
  static constexpr int kCreditFlag = 2 * kMaxRanks;
  static constexpr int kHealthFlag = 3 * kMaxRanks;
  static constexpr int kDescFlag = 3 * kMaxRanks + 8;
  // Then a ring of words into which group rank 0 writes its GEMM kernel choices, and the
  // last of them each rank has read, written into rank 0's (SlotAgreement).
  static constexpr int kChoiceFlag = kDescFlag + kMaxRanks * CallDescriptor::kWords;
  static constexpr int kChoiceRing = 16;
  static constexpr int kChoiceReadFlag = kChoiceFlag + kChoiceRing;
  // Then block[j] (this slot's own GEMM wrote block j for the call, by epoch: SignalGemm's flags)
  // and block_count[j] (its tiles of block j written so far, 0 between calls).
  static constexpr int kBlockFlag = kChoiceReadFlag + kMaxRanks;
  static constexpr int kBlockCountFlag = kBlockFlag + kMaxRanks;
  static constexpr int kNumFlags = kBlockCountFlag + kMaxRanks;

  struct Wait {
    int peer;
    const uint64_t* flag;  // on this slot's device
    uint64_t target;
    const char* what;
    // The flag whose value names the last call the peer delivered, for a timeout's message:
    // `flag` itself, or the data flag where `flag` is one only pieced calls write.
    const uint64_t* progress;
  };
  struct Pending {
    cudaEvent_t done;
    uint64_t epoch;
    const char* op;
    std::vector<Wait> waits;
    std::chrono::steady_clock::time_point since;
  };
  struct Slot {
    // A remote slot's buffer and flags, mapped through CUDA IPC into one local GPU.
    struct Mapping {
      int device = -1;
      char* buffer = nullptr;
      uint64_t* flags = nullptr;
    };
    bool local = false;  // remote slots hold only their IPC mappings
    int device = -1;
    int rank = 0;
    int group = 0;
    char* buffer = nullptr;     // capacity bytes, symmetric across the group
    uint64_t* flags = nullptr;  // kNumFlags words
    // Remote slots: one mapping per local GPU of the group, as an IPC mapping is usable
    // only from the GPU that opened it (several local GPUs: P processes x G GPUs).
    std::vector<Mapping> mappings;
    std::vector<char*> peer_buffer;     // by rank
    std::vector<uint64_t*> peer_flags;  // by rank
    cudaStream_t compute = nullptr;
    // kSecondGemmLane's stream, and its work's end for the compute lane's join.
    cudaStream_t second_gemm = nullptr;
    cudaEvent_t second_gemm_done = nullptr;
    std::vector<cudaStream_t> comm;  // by peer rank
    cudaEvent_t start = nullptr, compute_done = nullptr;
    std::vector<cudaEvent_t> comm_done;  // by peer rank
    std::vector<cudaEvent_t> ready;      // by peer rank: its partial (or gathered copy) is done
    std::unique_ptr<CublasLtGemm> gemm;
    // The reduce-scatter's GEMMs where they take cuBLASLt's heuristic pick while the
    // all-gather's are autotuned (CommOptions::autotune_reduce_scatter); else null.
    std::unique_ptr<CublasLtGemm> reduce_scatter_gemm;
    // How `gemm` agrees on kernels with the group's other GPU (groups of two; see Allocate).
    std::unique_ptr<KernelAgreement> agreement;
    std::atomic<uint64_t> epoch{0};     // advanced by this device's handler thread
    std::atomic<uint64_t> enqueued{0};  // the last call whose work is fully enqueued
    // HostTimes(); written by this device's handler thread only.
    std::atomic<int64_t> host_calls{0}, host_ns{0}, await_ns{0};
    std::atomic<int64_t> flag_gemm_calls{0};    // FlagGemm launches (FlagGemmCalls)
    std::atomic<int64_t> signal_gemm_calls{0};  // SignalGemm launches (FlagGemmCalls)
    std::mutex mu;                              // pending and free_events: shared with the watchdog
    std::deque<Pending> pending;
    std::vector<cudaEvent_t> free_events;
    // Each call's armed release (release.h): the gate's wait and ReleaseWaits, on a stream of
    // their own; the board as the host sees it, and as the device does.
    cudaStream_t release_stream = nullptr;
    ReleaseBoard* board = nullptr;
    ReleaseBoard* board_device = nullptr;
    cudaStream_t tune = nullptr;            // GEMM autotuning: waits only on this device's own work
    DeviceReport* report = nullptr;         // host-mapped, written by VerifyCall
    DeviceReport* report_device = nullptr;  // the same memory, as the device sees it
    bool reported = false;                  // watchdog only
    int sm_count = 0;
    // Whether FlagGemm runs here: built with it, on a GPU of compute capability 9.0.
    bool flag_gemm_runs = false;
    // Whether a rank of another process drives this slot's GPU too (the N-ranks mode of
    // share_gpu): its kernels need this GPU's SMs, so no kernel here may hold them all while
    // it waits for that rank's data (FlagGemm waits for its flags before it starts instead).
    bool shares_gpu = false;
  };

  class SlotAgreement;
  CudaCommunicator() = default;
  Status Allocate(size_t capacity_bytes, double timeout_s, GemmOptions gemm,
                  bool tune_reduce_scatter, bool multiprocess);
  Status Wire();
  // The agreement of slot `s`'s GEMM with its group (agreement.cc).
  std::unique_ptr<KernelAgreement> MakeAgreement(Slot* s);
  Status Begin(int device, const char* op, int64_t need_bytes, Slot** slot, uint64_t* epoch);
  // Enqueues the call's steps (protocol/schedule.h) on the slot's streams, joined back into
  // `stream`; `began` is set once Begin has succeeded.
  Status Enqueue(int device, cudaStream_t stream, OpKind op, const CallShape& shape,
                 const Operands& ops, Slot** began);
  // A kGemm step that waits for its blocks itself (Step::parts): FlagGemm on `stream`, over
  // `src` (our own block from `own`) into `dst`, its flags those of call `epoch`, its waits
  // added to `waits`.
  Status EnqueueFlagGemm(Slot& s, cudaStream_t stream, const Schedule& sched, const Step& step,
                         const CallShape& shape, const void* w, bool w_transposed, const void* src,
                         const void* own, void* dst, uint64_t epoch, std::vector<Wait>* waits);
  // A kGemm step that signals its blocks (Step::signals): SignalGemm on `stream`, over `src`
  // into `dst`, raising this slot's block flags to `epoch`.
  Status EnqueueSignalGemm(Slot& s, cudaStream_t stream, const Schedule& sched, const Step& step,
                           const CallShape& shape, const void* w, bool w_transposed,
                           const void* src, void* dst, uint64_t epoch);
  // The index in a slot's flag words of `flag` for `rank`.
  static int FlagIndex(Flag flag, int rank);
  // Marks the communicator broken when a call that has begun (`s` not null) fails, and
  // counts the call's host time from `since`.
  Status EndCall(Slot* s, const char* op, std::chrono::steady_clock::time_point since, Status st);
  // Enqueues a wait on `stream` until flag `flag_index` reaches `target`, recorded in
  // `waits` for the watchdog; `progress_index` (default: the flag itself) is Wait::progress.
  Status WaitFlag(Slot& s, cudaStream_t stream, int flag_index, uint64_t target, int peer,
                  const char* what, std::vector<Wait>* waits, int progress_index = -1);
  Status Signal(cudaStream_t stream, uint64_t* remote_flag, uint64_t value);
  // Write `desc` into peer `p`'s descriptor words for this slot's rank (stream memory
  // operations: no SMs, ordered before the data flag that follows on `stream`).
  Status Publish(Slot& s, cudaStream_t stream, int p, const CallDescriptor& desc);
  // On the compute stream, after every peer's chunk has landed: compare the peers'
  // descriptors with `desc`; on a mismatch, or once the slot is unhealthy, fill the
  // outputs with NaN and report. Outputs of a failed call are never plausible numbers.
  Status Verify(Slot& s, cudaStream_t stream, const CallDescriptor& desc,
                const CallOutputs& outputs);
  Status Finish(Slot& s, cudaStream_t xla_stream, const char* op, uint64_t epoch,
                std::vector<Wait> waits);
  // Host side, end of every call: wait until every slot of this process in `s`'s group
  // has enqueued call `epoch` too, so no GPU of the process waits on work not yet
  // enqueued once any handler returns to XLA. Bounded by the timeout.
  Status AwaitLocalPeers(Slot& s, const char* op, uint64_t epoch);
  // The host polls `ready` (a Status(bool* done)) until it holds. Once the communicator is
  // broken: an error, `who()` first. Past `deadline` (a steady_clock time): the communicator
  // broken by `timeout_reason()`, and that error. Both texts are made only when needed
  // (communicator_internal.h).
  template <typename Ready, typename Who, typename Reason>
  Status PollHost(Ready ready, std::chrono::steady_clock::time_point deadline, Who who,
                  Reason timeout_reason);
  void WatchdogLoop();
  // Arms call `epoch`'s release (release.h): its end opens the board's gate from
  // `xla_stream`; on the release stream, the gate's wait and ReleaseWaits over `waits`. A call
  // with no waits has nothing to release: nothing is armed.
  Status ArmRelease(Slot& s, cudaStream_t xla_stream, uint64_t epoch,
                    const std::vector<Wait>& waits);
  // The watchdog fires the oldest call in flight, `f`, overdue: two stores to the board, no
  // CUDA call. Then the reason it gives: the first wait not met (peer, what, the call the
  // peer's flag holds), or that the release did not run within kReleaseRunS (the device is
  // stuck).
  std::string FireRelease(Slot& s, const Pending& f);
  // The reason an overdue call gives: its first unmet wait `wt` (its flag held `held`), or,
  // with none known (nullptr), that it did not finish in time.
  std::string StuckReason(const Slot& s, const Pending& f, const Wait* wt = nullptr,
                          uint64_t held = 0) const;
  static constexpr double kReleaseRunS = 2.0;

  Topology topology_;
  size_t capacity_ = 0;
  double timeout_s_ = 0;
  Schedule schedule_;                         // the options' choices, see Create
  bool compute_on_caller_stream_ = false;     // CommOptions::compute_on_caller_stream
  std::vector<std::unique_ptr<Slot>> slots_;  // by slot index; null where not local

  BrokenState broken_;

  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace jax_ub
