// Row-major GEMM on one device through cuBLASLt (the library JAX's CUDA plugin ships).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/gemm/choice_file.h"
#include "protocol/comm_options.h"
#include "protocol/dtype.h"
#include "protocol/epilogue.h"
#include "protocol/status.h"

namespace jax_ub {

// How a row-major GEMM is described to cuBLASLt. kColumn: as the column-major product
// C^T = B^T @ A^T (no layout attributes). kRow: as C = A @ B with every matrix in
// CUBLASLT_ORDER_ROW. The two get different candidate kernels, and neither is fastest at
// every shape (up to ~10% apart on an H200; benchmarks/tools/gemm_candidates.cu).
// (GemmOrder itself is in protocol/comm_options.h: a communicator is created with one.)

// The GEMM wrapper's settings. A communicator derives them from its CommOptions (whose
// defaults live in jax_ub's Python Options); the values here serve standalone tools.
struct GemmOptions {
  bool allow_tf32 = false;  // float32 GEMMs may use TF32 tensor cores
  bool autotune = true;     // time cuBLASLt's candidates once per shape (see Prepare)
  // kAuto: with autotuning, time both descriptions' candidates; without, kColumn.
  // Tuning times kernels alone, and "auto" once kept a row kernel that was as fast alone
  // but slower beside the op's copies, hence kColumn.
  GemmOrder order = GemmOrder::kColumn;
  // With autotuning, how many of the fastest candidates (of the chosen description) the
  // op's own first calls of a shape compare before keeping one (see Matmul); 0 or 1: none
  // (a tool's default: its calls then always run tuning's pick).
  int trials = 0;
  // With autotuning: a file of kernel choices (choice_file.h) whose choice for a
  // shape is run without tuning or trials, and to which new choices are added; "": none.
  std::string choices_path;
  // GEMMs of two float8_e4m3fn operands (a forward's) accumulate in cuBLASLt's FAST_ACCUM
  // mode, without promoting partial sums to float32 along k, as XLA's fp8 dots do at
  // default precision; those with an e5m2 operand (a gradient) always promote.
  bool fp8_fast_accumulation = true;
  // With autotuning: cuBLASLt's first pick holds unless tuning's fastest clearly beats it
  // (KeptCandidate); false: the fastest is kept however small its lead.
  bool hold_first_pick = true;

  static GemmOptions From(const CommOptions& o) {
    return GemmOptions{o.allow_tf32, o.autotune_gemm,         o.gemm_order,          o.gemm_trials,
                       o.gemm_cache, o.fp8_fast_accumulation, o.gemm_hold_first_pick};
  }
};

// One of a cuBLASLt algorithm's configuration values (its id, tile, stages, ...), or -1
// where it has none: for saying which kernel a plan runs.
int AlgoConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr);

// The per-run operands of a GEMM besides a, b and c, all device memory: an addend (laid
// out as c), fp8 scales (a's at [0], b's at [kScaleStride], each 16-byte aligned), the
// epilogue's bias [n] and GELU's input (laid out as c; written, or read by DGELU).
struct GemmArgs {
  const void* addend = nullptr;
  const float* scales = nullptr;
  const void* bias = nullptr;
  void* aux = nullptr;
  // Run in the second workspace (AddSecondWorkspace): a GEMM on a second stream, beside one
  // that may be running in the first.
  bool second_workspace = false;
};

// How the GPUs of a tensor-parallel group run the same kernel for each GEMM shape. Tuning
// and the in-op trials time kernels on each GPU, and noise alone made GPUs of one group keep
// different, equally fast kernels; but one GPU's GEMM then runs longer than its peer's
// within the same call, and at every flag the faster GPU waits (seen in a Llama step on
// 2x H200: the GPUs' kernel time differed by up to 4% of the step, the bound's by 0.02%). So
// group rank 0 (the leader) chooses and sends each choice; the others (followers) receive
// it and run it. Messages go in the same order on every rank, as the ranks make the same
// calls and, in groups of two, the same GEMM shapes in the same order: numbered by a
// per-GEMM count, they need no other matching.
class KernelAgreement {
 public:
  virtual ~KernelAgreement() = default;
  virtual bool leader() const = 0;
  // The leader: sends message `serial` (60 bits of `word`) to every follower.
  virtual Status Send(uint64_t serial, uint64_t word) = 0;
  // A follower: waits for the leader's message `serial` (bounded by the op's timeout;
  // `what` says what it waits for, for the error).
  virtual Status Receive(uint64_t serial, const std::string& what, uint64_t* word) = 0;
};

class CublasLtGemm {
 public:
  // Creates the handle and a workspace on the current device.
  static Status Create(GemmOptions options, CublasLtGemm** out);
  ~CublasLtGemm();

  // The candidates a shape's first calls in the op still compare (GemmOptions::trials).
  struct Trial {
    std::vector<cublasLtMatmulAlgo_t> algos;  // autotuning's fastest first
    std::vector<int> indices;                 // their places in cuBLASLt's heuristic list
    // ms[c][r]: candidate c's GEMM times in timed round r + 1 (its op call of that round)
    std::vector<std::vector<std::vector<float>>> ms;
    struct Timing {
      int candidate, round;
      cudaEvent_t begin, end;
    };
    std::deque<Timing> pending;  // recorded, not yet read
    std::vector<cudaEvent_t> spare;
    uint64_t last_call = 0;  // the op call (BeginCall) that last ran this shape
    int calls = 0;           // op calls that ran this shape so far; the last ran
                             // candidate (calls - 1) % algos.size()
  };

  // What Matmul runs for one GEMM shape: made once per shape by Prepare, owned here.
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
    cublasLtMatmulAlgo_t algo;
    bool row = false;              // GemmOrder::kRow: a is the first operand, else b is
    bool ran_with_addend = false;  // its kernels for a nonzero beta are loaded
    bool scaled = false;           // fp8: every run sets its operands' scale pointers
    Epilogue epilogue;             // every run sets its bias and aux pointers
    int64_t m = 0, k = 0, n = 0;
    std::unique_ptr<Trial> trial;  // while the op's calls still compare candidates
    std::string choice_key;        // its line's key in the choice file, once chosen; "": none
    int choice_index = -1;         // algo's place in cuBLASLt's heuristic list (choice file)
  };

  // The plan for this GEMM's shape. A shape's first call chooses it and runs it once on
  // `tune_stream`, overwriting `c`; the calling thread waits. Later calls return the same
  // plan at once; an empty shape (m or n zero) gets null. With autotuning, cuBLASLt's best
  // few candidates of each description (GemmOrder) are timed there with the real operands,
  // in interleaved rounds that keep the GPU busy, for up to about two seconds per shape.
  // XLA's own dot is autotuned; a heuristic's first pick alone ran up to ~10% slower than
  // it at some of our chunk shapes.
  //
  // Call it before the op enqueues anything that waits on a peer. A shape's first call
  // drains the device: CUDA loads kernels lazily, and the first launch of a cuBLASLt
  // kernel waits for the device to go idle while holding its context lock. Were the device
  // then waiting on a peer whose host thread needs that lock to enqueue its copy into our
  // memory, both would hang (seen on 2x H200 with autotuning).
  //
  // c[m, n] = a[m, k] @ b[k, n], row-major and dense. With `b_transposed`, b is stored
  // as its transpose [n, k] (a backward pass's w.T, read in place instead of copied).
  // Accumulates in float32; output in `t`. With an `addend` the plan will also be run with
  // one (see Matmul): its first such Prepare runs it once with exactly these operands,
  // since cuBLASLt may launch other kernels for a nonzero beta or a separate addend (a
  // first launch after a peer wait is enqueued can hang a process that drives both GPUs).
  //
  // a of type `ta`, b of `tb`, c (and the addend) of type `out`: all one type, or fp8 a and
  // b (float8_e4m3fn, float8_e5m2, either) with a bfloat16, float16 or float32 c. fp8
  // GEMMs need b stored transposed (cuBLASLt's fp8 kernels take both operands k-major).
  // `ep` is cuBLASLt's epilogue on the product (a shape with one is another plan; tuned
  // with `args`' bias and aux, which must then be set); it takes no addend.
  Status Prepare(DType ta, DType tb, DType out, const void* a, const void* b, bool b_transposed,
                 void* c, int64_t m, int64_t k, int64_t n, const Epilogue& ep, const GemmArgs& args,
                 cudaStream_t tune_stream, Plan** plan);
  // The same with every operand of type `t` and no epilogue.
  Status Prepare(DType t, const void* a, const void* b, bool b_transposed, void* c, int64_t m,
                 int64_t k, int64_t n, const void* addend, cudaStream_t tune_stream, Plan** plan) {
    GemmArgs args;
    args.addend = addend;
    return Prepare(t, t, t, a, b, b_transposed, c, m, k, n, Epilogue{}, args, tune_stream, plan);
  }

  // From now on this GEMM's kernel choices are agreed through `agreement` (not owned; it
  // must outlive the GEMM's calls). Without one, each GPU chooses alone.
  void SetAgreement(KernelAgreement* agreement) { agreement_ = agreement; }

  // Each plan's current kernel, for tests and tools: shape, description, its place in
  // cuBLASLt's heuristic list, and whether the op's trials are still comparing.
  struct Choice {
    int64_t m, k, n;
    bool row;
    int index;
    bool deciding;
  };
  std::vector<Choice> Choices() const;

  // Marks the start of an op call: a shape's GEMMs within one call run the same trial
  // candidate, so every candidate is timed in every position of the op's schedule.
  void BeginCall() { ++call_; }

  // Allocates the second workspace (GemmArgs::second_workspace) once; a no-op after that.
  Status AddSecondWorkspace();

  // Enqueues `plan`'s GEMM on `stream` for operands laid out as the shape it was made for:
  // c = a @ b, or with an `addend` (laid out as c) c = a @ b + addend, added in the
  // epilogue in float32. A null plan (Prepare's for an empty shape) runs nothing.
  //
  // While the plan has a trial, successive op calls rotate over its candidates (in
  // alternating directions, round by round), each
  // GEMM bracketed by timing events that later calls read without waiting; after a
  // warm-up round and kTrialRounds timed ones, the candidate fastest round by round
  // (TrialRounds) is kept. So the kernel is chosen beside the op's own copies and waits, at the
  // clock the op runs at, which tuning alone cannot see.
  // `args.scales` (fp8 plans): multiplying the product; `args.bias` and `args.aux`: the
  // plan's epilogue's.
  Status Matmul(Plan* plan, const void* a, const void* b, void* c, cudaStream_t stream,
                const GemmArgs& args = {});

 private:
  // What a plan is made for, one plan per key: operand types, shape, b's layout, epilogue.
  struct PlanKey {
    DType a_type, b_type, out_type;
    int64_t m, k, n;
    bool b_transposed;
    int epilogue;  // Epilogue::Code()

    // Any strict order will do: it only keys plans_.
    friend bool operator<(const PlanKey& x, const PlanKey& y) {
      return std::tie(x.a_type, x.b_type, x.out_type, x.m, x.k, x.n, x.b_transposed, x.epilogue) <
             std::tie(y.a_type, y.b_type, y.out_type, y.m, y.k, y.n, y.b_transposed, y.epilogue);
    }
  };
  // One of cuBLASLt's candidates for a shape: its description (an index into the plans
  // MakePlan describes), algorithm, and time per run in each timed round.
  struct Candidate {
    int description;
    cublasLtMatmulAlgo_t algo;
    std::vector<float> ms;
    int index;  // its place in its description's heuristic list
  };

  // Describing and running a GEMM (cublaslt_gemm.cc).

  // The descriptor and layouts of `key` as `row` describes it.
  Status Describe(const PlanKey& key, bool row, Plan* p) const;
  static void Destroy(Plan& p);
  // Whether `key`'s GEMM accumulates in FAST_ACCUM mode (GemmOptions::fp8_fast_accumulation).
  bool FastAccumulation(const PlanKey& key) const;
  // Points `p`'s fp8 scales at `scales` (as Matmul's, device memory).
  Status SetScales(const Plan& p, const float* scales) const;
  // Points `p`'s epilogue at its bias and pre-GELU output.
  Status SetEpilogueOperands(const Plan& p, const GemmArgs& args) const;
  // Enqueues one GEMM of `p`'s shape with `algo`.
  Status Run(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* a, const void* b, void* c,
             cudaStream_t stream, const GemmArgs& args = {});

  // Choosing a new shape's kernel (kernel_choice.cc).

  // cuBLASLt's best `want` candidates for `p` (at least one, else an error).
  Status Heuristic(const Plan& p, int want,
                   std::vector<cublasLtMatmulHeuristicResult_t>* out) const;
  // A new plan for `key`, stored in plans_: a follower's from its leader's message
  // (PlanFromLeader), else ChoosePlan's, sent to the followers where they follow.
  Status MakePlan(const PlanKey& key, const Epilogue& ep, const void* a, const void* b, void* c,
                  const GemmArgs& args, cudaStream_t stream, Plan** plan);
  // A new plan for `key` chosen here (cuBLASLt's heuristic pick, or with options_.autotune
  // the fastest candidate, timed on `stream`), stored in plans_.
  Status ChoosePlan(const PlanKey& key, const Epilogue& ep, const void* a, const void* b, void* c,
                    const GemmArgs& args, cudaStream_t stream, Plan** plan);
  // Times `candidates` on `stream` (see tune.cc) and sets `best` to the fastest
  // one's index, or -1 if none can run here, and `sustained` to whether they were timed in
  // sustained blocks (long GEMMs, kSustainMinMs) or in bursts.
  Status Tune(const std::vector<Plan>& described, const void* a, const void* b, void* c,
              const GemmArgs& args, cudaStream_t stream, std::vector<Candidate>* candidates,
              int* best, bool* sustained);
  // The choice file's key for `key` on this GPU and cuBLASLt, or "" when it is not used.
  std::string ChoiceKey(const PlanKey& key) const;
  // A plan for `key` from the choice file's kernel, run once; null where the file has none
  // for it or cuBLASLt refuses it here (then the shape is tuned as if there were no file).
  Status PlanFromChoices(const PlanKey& key, const std::string& choice_key, const Epilogue& ep,
                         const std::vector<bool>& rows, const void* a, const void* b, void* c,
                         const GemmArgs& args, cudaStream_t stream, Plan** plan);
  // Adds `p`'s final kernel to the choice file. A file that cannot be written is reported
  // once on stderr and otherwise ignored: it only saves later processes' tuning.
  void RecordChoice(const Plan& p);

  // Comparing the fastest candidates inside the op's own calls (trials.cc).

  // Matmul while `p` has a trial.
  Status TrialMatmul(Plan& p, const void* a, const void* b, void* c, cudaStream_t stream,
                     const GemmArgs& args);
  // Reads the trial's finished timings, without waiting (or, with `wait`, once all are
  // in); keeps the fastest candidate and ends the trial once every timing is in.
  Status Harvest(Plan& p, bool wait = false);
  // Ends `p`'s trial keeping its candidate `best`.
  void Decide(Plan& p, int best);
  // With an agreement, at the op call after the trial's last timed round (the same call
  // on every rank): the leader decides from its timings and sends its pick; a follower
  // runs the pick it receives.
  Status AgreeOnTrial(Plan& p);

  // Agreeing on a new shape's kernels (kernel_choice.cc).

  // Whether this GEMM agrees its tuned choices with a group, and follows its leader's.
  bool Agrees() const { return agreement_ != nullptr && options_.autotune; }
  bool Follows() const { return Agrees() && !agreement_->leader(); }
  // The leader: sends `p`'s kernel and trial candidates as its plan's message.
  Status SendPlan(const Plan& p);
  // `p` described as `row` (or not) running cuBLASLt's candidates at `indices` of its
  // heuristic list, a choice made elsewhere (the choice file, group rank 0), each run once
  // here; the first is its kernel, and two or more its trial's. `usable` is false, and `p`
  // destroyed, where cuBLASLt lacks any of them here or one fails to run.
  Status KnownKernels(const PlanKey& key, const Epilogue& ep, bool row,
                      const std::vector<int>& indices, const void* a, const void* b, void* c,
                      const GemmArgs& args, cudaStream_t stream, Plan* p, bool* usable);
  // A follower: the plan for `key` made of the leader's message, its kernels run once.
  Status PlanFromLeader(const PlanKey& key, const Epilogue& ep, const void* a, const void* b,
                        void* c, const GemmArgs& args, cudaStream_t stream, Plan** plan);
  // "GEMM m=.. k=.. n=..", for errors.
  static std::string ShapeText(int64_t m, int64_t k, int64_t n);
  // A trial of these candidates (autotuning's fastest first, their places in cuBLASLt's
  // heuristic list), none timed yet.
  static std::unique_ptr<Trial> NewTrial(std::vector<cublasLtMatmulAlgo_t> algos,
                                         std::vector<int> indices);
  static void DestroyTrial(Trial& t);

  cublasLtHandle_t handle_ = nullptr;
  int device_ = -1;       // the GPU it was created on, for traces (each GPU keeps its own kernels)
  std::string gpu_name_;  // its model (cudaDeviceProp::name), for the choice file's keys
  GemmChoiceFile choices_;
  bool choices_failed_ = false;  // a failed write was reported
  void* workspace_ = nullptr;
  void* second_workspace_ = nullptr;  // AddSecondWorkspace's, workspace_bytes_ too
  // Device floats of 1 laid out as Matmul's scales: fp8 plans' scales wherever a run has none
  // (heuristics and tuning included, as cuBLASLt may pick kernels that cannot scale when none is
  // set).
  float* ones_ = nullptr;
  size_t workspace_bytes_ = 0;
  GemmOptions options_;
  std::map<PlanKey, Plan> plans_;  // one per shape; only the owning device's thread uses it
  uint64_t call_ = 0;              // BeginCall's count
  KernelAgreement* agreement_ = nullptr;
  uint64_t messages_ = 0;  // agreement messages sent or received so far
};

}  // namespace jax_ub
