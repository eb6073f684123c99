#!/usr/bin/env bash
# On a GPU machine: build and install this checkout, then GPU tests or a benchmark. Logs go
# to $OUT. Usage (on the GPU machine, repo root; `help` lists the modes, from MODES below):
#   [TAG=name] bash benchmarks/device_run.sh [MODE [args...]]
# Each step runs in a process group of its own under `timeout`; when it ends or times out,
# whatever is left in that group is killed (a hung test's processes would hold the GPUs and
# skew every later measurement), and nothing else on the machine. Each step's exit status
# is printed; the script exits 1 when a step failed, 2 on an unknown mode (before building).
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}

# The modes: name, what it does (the usage text), the function that runs it. Every mode but
# help first builds and installs this checkout (build_and_install).
MODES=(
  all          "tests, then bench (args: bench's)"                                    mode_all
  build        "only build and install this checkout"                                 mode_build
  tests        "the GPU test files one at a time, each under its own limit (TEST_SPECS=\"file:seconds ...\", TEST_K: pytest's -k); a file that times out runs again with JAX_UB_TRACE=1 for 60 s, whose last trace lines say where each GPU stopped (\$OUT/gpu_tests.log, trace_FILE.log)" mode_tests
  ranks        "the GPU test files in the N-ranks mode: N processes share GPU 0, each one rank (pytest --ranks N; on GPUs rank 0 compiles each program for all), for each N of RANKS (default 4; e.g. RANKS=\"2 4 8\"), the items of RANKS_FILES (\"file[@k]:seconds[:N0] ...\", @k: pytest's -k, + for a space; N0: the least N to run it at) or of a set; RANKS_PARALLEL=L: the items of every N dealt over L lanes that run at once (longest first, to the least loaded lane), spread over the GPUs (RANKS_GPUS, e.g. \"1\": only those), each item's limit scaled by lanes/3 above 3 lanes a GPU; fewer lanes where their ranks would not fit a GPU's memory at RANKS_RANK_MIB (default 3700) each; RANKS_THREADS=1: benchmarks/tools/hot_threads.py every 30 s meanwhile, into \$OUT/ranks_threads.log; args: quick (the default: the ops' values and gradients, dp x tp, fp8, epilogues; about 3 minutes at N = 8 with 3 lanes) or all (every file: the gradient matrix in every way to call, layouts, models, faults; and once, processes of their own on GPU 0: RANKS_ONCE; about 17 minutes on one H200: N = 8 with 4 lanes 9 minutes, N = 2 and 4 with 6 lanes 7.5); the ranks of every lane share one MPS daemon where the machine has MPS (JAX_UB_TEST_RANKS_MPS=0: none), then pytest's own (e.g. -k); logs in \$OUT/ranks_laneL.log. Correctness only: never timings" mode_ranks
  check        "a commit's GPU check in one call: the N-ranks quick set (as ranks quick; RANKS default \"2 4 8\", RANKS_PARALLEL 3; on one H100, run apart, N = 8 took 2.4 minutes and N = 2, 4 2.5), tests/test_gpu_gemm_cache.py, then tests/test_gpu_multiprocess.py's faults on one shared GPU (a killed peer, an absent one, mismatched calls; FAULTS_S, default 240); then, where CHECK_TABLE gives its args (e.g. \"--models 8b --tp 8 --slot-ms 30\"), as table (TABLE_S default 200)" mode_check
  table        "benchmarks/gemm_table.py (args: its own, e.g. --models 8b --tp 1,2,4,8 --slot-ms 30; TABLE_S, default 500; TAG: gemm_table) with JAX_UB_TRACE=1 (less every op call's two lines), its tunings read by benchmarks/tools/tuning_trace.py into \$OUT/tunings.log" mode_table
  bench        "python -m jax_ub.bench (args: its own) -> \$OUT/TAG.json/.png/.log (TAG: bench)" mode_bench
  model        "one training step of the Llama-style model per variant: python -m jax_ub.bench.model (args: its own; MEM_FRACTION: the share of each GPU JAX may take; MODEL_S, MODEL_LINES; TAG: model)" mode_model
  llama        "examples/train_llama.py (args: its own, e.g. --fp8 current --seeds 3; TRAIN_S; TAG: llama)" mode_llama
  layer        "one sequence-parallel transformer layer, fwd and fwd+bwd, jax_ub vs XLA vs the no-communication bound: python -m jax_ub.bench.layer (args: its own, e.g. --sizes; LAYER_S; TAG: layer)" mode_layer
  processes    "the bench in one process, as 4 x 1 and as 2 x 2 processes x GPUs (4 GPUs; SHAPE, PROCESS_BENCH_S); prints jax_ub/GEMM" mode_processes
  flax         "the TP transformer example, jax_ub vs XLA step time (args: its own)"  mode_flax
  fp8train     "the TP transformer example with --fp8 --compare-bf16 (args: its own; TRAIN_S)" mode_fp8train
  profile      "benchmarks/tools/profile_kernels.py for both ops (args: e.g. --tp, --shape; PROFILE_S)" mode_profile
  layerprofile "benchmarks/tools/profile_layer.py (args: its own, e.g. --size, --pass; PROFILE_S, PROFILE_LINES)" mode_layerprofile
  stepprofile  "benchmarks/tools/profile_train_step.py (args: its own; PROFILE_S)"     mode_stepprofile
  stepmemory   "benchmarks/tools/step_memory.py (args: bench.model's; MEM_FRACTION, PROFILE_S, PROFILE_LINES); live ranges and buffer assignment in \$OUT/step_memory.tgz" mode_stepmemory
  power        "benchmarks/tools/power_clocks.py for both ops (args: its own; POWER_S)" mode_power
  gemm         "benchmarks/tools/gemm_candidates.cu (cuBLASLt's candidates and cuBLAS's own GEMM) and XLA's dot per m,k,n shape (args: m,k,n ...; GEMM_S: the tool's time limit, default 240 s; GEMM_CANDIDATES, GEMM_RUNS: runs a candidate's time averages, default 200, GEMM_LINES; GEMM_WINDOWS: its --windows; GEMM_COPIES: its --copies)" mode_gemm
  solo         "benchmarks/tools/solo_schedule.cu: one rank's compute schedule of each Llama 3 8B/70B projection at tp 2, 4, 8 on GPU 0, its peers' rows in place, against the GEMM of the rank's whole work (SOLO_TP, SOLO_SHAPES op:name:tokens:in:out, SOLO_S, SOLO_FOLDS: reduce_scatter_fold_rows values, default 2048; SOLO_SCHEDULES: \"steps one_pass early ring merged\" adds the RS with its early sum off and on (Tuning.reduce_scatter_early_sum; steps: by shape), the RS's ring, off by default in the library, and the RS with runs of block GEMMs merged to at least SOLO_MERGE_ROWS rows, default 2048, not in the library; \"signal\" the RS with its signal GEMM (Tuning.reduce_scatter_signal_gemm, off by default; CUTLASS's headers); and \"in_turn\" the AG in turn (Tuning.all_gather_in_turn, chosen by shape); \"steps\" is the AG all at once; a schedule ending in :1lane or :2lanes runs its GEMMs on one lane or two taking turns (default: by shape); SOLO_GBPS: the RS's partials land as a modelled link of that many GB/s would deliver them, the op timed against its floor, with SOLO_FOLDS=-1 at tp=2)" mode_solo
  flaggemm     "benchmarks/tools/flag_gemm.cu (Hopper; CUTLASS's headers: pip install nvidia-cutlass, or JAX_UB_CUTLASS_INCLUDE set for the build): one CUTLASS GEMM that waits per row block for its flag, as each row block lands, against cuBLASLt's whole GEMM and the library's span GEMMs; correctness with flags released late, and a wait giving up when the call is fired (args: M,K,N:blocks[:order] ..., default the all-gather projections of solo's SOLO_PROJECTIONS at FLAG_TP, default \"4 8\"; FLAG_S seconds a loop)" mode_flaggemm
  paced        "benchmarks/tools/paced_gemm.cu (as flaggemm, CUTLASS's headers): one rank's all-gather GEMM schedules on GPU 0 with its peers' row blocks landing at a modelled link's pace (a kernel raises each block's flag at its time): the library's steps (blocks land together), the all-gather in turn (one by one) with the library's GEMMs (over the blocks landed by their start) and with a GEMM per block, each also on two GEMM streams taking turns, and flag_gemm's one GEMM taking the blocks in turn, against the whole GEMM (args: M,K,N:tp[:rank] ..., default the all-gather projections of solo's SOLO_PROJECTIONS at PACED_TP, default \"4 8\", rank tp/2; PACED_GBPS, default 270: the link's GB/s, a list runs each; PACED_LATENCY_US per block in turn, default 0; PACED_S seconds a loop; PACED_CONFIGS: the flag GEMM configurations, comma-separated, default all)" mode_paced
  signalgemm   "benchmarks/tools/signal_gemm.cu (as flaggemm, CUTLASS's headers): the reduce-scatter's partials from one persistent GEMM that raises each row block's flag once the block is written (the library's SignalGemm, off by default), checked by copying each block at its flag, timed against cuBLASLt's whole GEMM and the same kernel without signals, and with solo_schedule's modelled link: its partials' pushes, then the sum pass, against the floor (args: tp:m,k,n ..., a rank's; default the RS projections of SOLO_PROJECTIONS at SIGNAL_TP, default \"4 8\"; SIGNAL_GBPS, default 270; SIGNAL_S seconds a loop)" mode_signalgemm
  overlapcost  "benchmarks/tools/overlap_cost.cu per m,k,n chunk shape, then XLA's dot of the whole GEMM (2m rows) in loops as long (args: m,k,n ...; OVERLAP_SECONDS, default 2)" mode_overlapcost
  copyhold     "benchmarks/tools/copy_hold.cu, with the driver's default hardware queues, 32 and 1 (CUDA_DEVICE_MAX_CONNECTIONS)" mode_copyhold
  lazyload     "benchmarks/tools/lazy_load.cu: whether a kernel's first launch (CUDA's lazy loading) waits for a stream parked on a flag, and holds another thread's event query and copy meanwhile (modules loaded lazily and eagerly); whether a module load while only another thread's copy can release the parked stream (the watchdog's way) is stuck; a flag's round trip in device and in host-mapped memory" mode_lazyload
  sanitize     "compute-sanitizer memcheck and racecheck (SANITIZE_TOOLS, SANITIZE_S) on a small 2-GPU run: benchmarks/tools/sanitize_small.py (SANITIZE_TP, SANITIZE_CASE); slow: minutes each" mode_sanitize
  help         "this text (builds nothing)"                                           mode_help
)

usage() {
  cat <<'EOF'
Usage (on a GPU machine, in the repo root):
  [TAG=name] bash benchmarks/device_run.sh [MODE [args...]]      (MODE: all when left out)
Builds and installs this checkout into python3's environment (pip install --no-build-isolation
--no-deps -e ., CMake build in build/dev for CUDA_ARCHS, default 90-real; needs
scikit-build-core, nanobind, CMake and ninja there), then runs MODE. Logs go to $OUT (default
/tmp/out); TAG names a benchmark's outputs. DRY_RUN=1 prints each step's command, runs none; NO_BUILD=1
skips the build (the jax_ub installed already runs); PACK=name: at exit, a timeout's too, everything
under $OUT goes into $OUT/name.tgz, the loose files removed (one file to copy back).
Modes:
EOF
  local i line first
  for ((i = 0; i < ${#MODES[@]}; i += 3)); do
    first=1
    while IFS= read -r line; do  # the description folded, under its first line
      line=${line%" "}
      if [ -n "$first" ]; then printf '  %-13s %s\n' "${MODES[i]}" "$line"; else printf '%16s%s\n' '' "$line"; fi
      first=""
    done < <(fold -s -w 80 <<< "${MODES[i + 1]}")
  done
}

# Log lines of JAX/XLA/gRPC that say nothing about the run; filtered from what is printed.
NOISE='^[WI][0-9]{4} |GRPC|grpc_util|Source Location|^:'

dry_run() { [ -n "${DRY_RUN:-}" ]; }

# The kernel log's GPU lines (NVRM, Xid: the engine that faulted, the address, the process)
# that appeared since this script started, where dmesg can be read. A fault in one of the
# processes that share a GPU under MPS reaches them all as an illegal address; only these
# lines say which engine (a copy engine, or the SMs) it was, and their times (dmesg -T)
# against the steps' wall-clock spans which step, of several lanes, ran then.
KMSG_START=0
kernel_log() { dmesg -T 2> /dev/null || dmesg 2> /dev/null; }
new_gpu_kernel_lines() {
  kernel_log | tail -n "+$((KMSG_START + 1))" | grep -E "NVRM|Xid" | tail -n 20
}

STEP_PGID=""  # the process group of the step running now (killed on exit, too)
STEP_RC=0     # the exit status of the last step
FAILED=()     # the steps that failed, with their status

# End what is left of the running step's process group.
end_step_group() {
  if [ -n "$STEP_PGID" ] && kill -0 -- "-$STEP_PGID" 2> /dev/null; then
    kill -9 -- "-$STEP_PGID" 2> /dev/null
    sleep 1  # let the GPUs' memory go before the next step
  fi
  STEP_PGID=""
}

# step [--append] [--ok "CODES"|any] [-k SECONDS] NAME LIMIT LOG CMD [ARGS...]
# Runs CMD (a program, not a shell function) under `timeout LIMIT` (-k: SIGKILL SECONDS after
# the SIGTERM), in a process group of its own (set -m: its id is timeout's pid), stdin from
# /dev/null, stdout and stderr to LOG (--append: added to it); then kills what is left in
# that group. Prints "NAME: rc=N (S s)" and sets STEP_RC; a status not in CODES (default 0; any:
# none fails) is recorded as a failure.
step() {
  local append="" ok="0" kill_after=""
  while :; do
    case $1 in
      --append) append=1; shift ;;
      --ok) ok=$2; shift 2 ;;
      -k) kill_after=$2; shift 2 ;;
      *) break ;;
    esac
  done
  local name=$1 limit=$2 log=$3
  shift 3
  local -a run=(timeout)
  [ -n "$kill_after" ] && run+=(-k "$kill_after")
  run+=("$limit" "$@")
  if dry_run; then
    printf '[dry run] %s: %s %s %s\n' "$name" "$(printf '%q ' "${run[@]}")" "${append:+>}>" "$log"
    : >> "$log"  # empty, for what reads it after
    STEP_RC=0
    return 0
  fi
  [ -n "$append" ] || : > "$log"
  local started=$SECONDS since
  since=$(date +%T)  # wall clock: to place a fault of the kernel log (dmesg -T) in a step
  set -m
  "${run[@]}" < /dev/null >> "$log" 2>&1 &
  STEP_PGID=$!
  set +m
  wait "$STEP_PGID"
  STEP_RC=$?
  end_step_group
  local timed_out=""
  if [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ]; then
    timed_out=", TIMED OUT after $limit s"
  fi
  echo "$name: rc=$STEP_RC$timed_out ($((SECONDS - started)) s, $since-$(date +%T))"
  if [ "$ok" != any ] && [[ " $ok " != *" $STEP_RC "* ]]; then
    FAILED+=("$name (rc=$STEP_RC$timed_out)")
    new_gpu_kernel_lines | sed 's/^/  kernel log: /'
  fi
}

# A diagnostic CUDA tool of the CMake build (EXCLUDE_FROM_ALL: built on request).
build_tool() {  # NAME [LIMIT seconds, default 120]
  step --append "build $1" "${2:-120}" "$OUT/build.log" ninja -C build/dev "$1"
  [ "$STEP_RC" -eq 0 ] || { echo "TOOL BUILD FAILED: $1"; tail -n 20 "$OUT/build.log"; }
}

# This checkout, built with CMake in build/dev and installed in place (scikit-build-core's
# editable install: the package's Python files from here, its extensions from the build).
build_and_install() {
  local t0=$SECONDS
  # Links to built extensions that earlier versions of this script left in the package.
  dry_run || find jax_ub/_src -maxdepth 1 -type l \( -name '_host*.so' -o -name '_cuda*.so' \) -delete
  # CUTLASS's headers (the flag and signal GEMMs): a GPU machine without network or the
  # nvidia-cutlass package takes them from its wheel, carried in .whl (README).
  local cutlass=${JAX_UB_CUTLASS_INCLUDE:-} whl
  dry_run || : > "$OUT/build.log"
  whl=$(compgen -G ".whl/nvidia_cutlass-*.whl" | head -n 1)
  if [ -z "$cutlass" ] && [ -n "$whl" ] && ! python3 -c 'import importlib.util as u, sys
sys.exit(u.find_spec("cutlass_library") is None)' 2> /dev/null; then
    step "cutlass headers" 120 "$OUT/build.log" python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("cutlass_library/source/include/")])' \
      "$whl" build/cutlass
    cutlass=$PWD/build/cutlass/cutlass_library/source/include
  fi
  step --append build 300 "$OUT/build.log" env CMAKE_GENERATOR=Ninja PIP_DISABLE_PIP_VERSION_CHECK=1 \
    JAX_UB_CUTLASS_INCLUDE="$cutlass" \
    python3 -m pip install -v --no-build-isolation --no-deps --no-index -e . \
    --config-settings=build-dir=build/dev \
    "--config-settings=cmake.define.JAX_UB_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90-real}"
  if [ "$STEP_RC" -ne 0 ]; then
    echo "BUILD FAILED"
    tail -n 40 "$OUT/build.log"
    exit 1
  fi
  step --append "build: import" 120 "$OUT/build.log" python3 -c '
from jax_ub._src.runtime import extension as e
print("host extension:", e._host.__file__)
print("CUDA extension:", e.cuda_import_error() or "loaded")
m = e.module_for("cuda")
print("FlagGemm:", "built" if m is not None and m.flag_gemm_built() else "not built (no CUTLASS)")'
  if [ "$STEP_RC" -ne 0 ]; then
    echo "BUILD FAILED: the installed jax_ub does not import"
    tail -n 40 "$OUT/build.log"
    exit 1
  fi
  dry_run || tail -n 2 "$OUT/build.log"
  dry_run || grep -q "^FlagGemm: built" "$OUT/build.log" || echo "NO CUTLASS: the flag and signal" \
    "GEMMs are not built and their GPU tests skip (carry the nvidia-cutlass wheel in .whl)"
  echo "built in $((SECONDS - t0)) s"
}

mode_help() { usage; }

mode_build() { :; }

mode_all() {
  mode_tests
  mode_bench "$@"
}

mode_tests() {
  local -a specs k=()
  read -ra specs <<< "${TEST_SPECS:-test_gpu.py:300 test_gpu_schedules.py:200 test_gpu_layouts.py:360 test_gpu_flax.py:150 test_gpu_multiprocess.py:260 test_gpu_reliability.py:200 test_gpu_fp8.py:150 test_gpu_epilogue.py:200 test_gpu_gemm_cache.py:200 test_gpu_models.py:300}"
  [ -n "${TEST_K:-}" ] && k=(-k "$TEST_K")
  local spec file limit
  : > "$OUT/gpu_tests.log"
  for spec in "${specs[@]}"; do
    file=${spec%%:*}
    limit=${spec##*:}
    step --append --ok "0 5" -k 10 "tests/$file" "$limit" "$OUT/gpu_tests.log" \
      python3 -m pytest -v -rsxX -m gpu "tests/$file" -p no:cacheprovider "${k[@]}"
    # 5: none ran (too few GPUs for the file, or TEST_K selected none): not a failure.
    [ "$STEP_RC" -eq 5 ] && echo "tests/$file: no tests ran"
    if [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ]; then
      echo "tests/$file TIMED OUT after $limit s" >> "$OUT/gpu_tests.log"
      # The trace rerun does not capture output (-s): the last trace lines of each GPU.
      step --ok any -k 5 "tests/$file, traced" 60 "$OUT/trace_$file.log" \
        env JAX_UB_TRACE=1 python3 -m pytest -x -q -s -m gpu "tests/$file" "${k[@]}" -p no:cacheprovider
      grep "jax_ub trace" "$OUT/trace_$file.log" | tail -n 12
    fi
  done
  grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED|TIMED OUT" "$OUT/gpu_tests.log" \
    | grep -v "^tests.*PASSED" | tail -n 30
  echo "passed: $(grep -cE " PASSED" "$OUT/gpu_tests.log")"
  grep -E "^=+ .* in [0-9.]+s" "$OUT/gpu_tests.log"
}

mode_check() {
  # Correctness first (a wrong number or a hang outranks a slow op): the ops at tp 2, 4, 8 as
  # N ranks, the GEMM cache, then the timeout path on one GPU (a killed peer, an absent one,
  # mismatched calls: each must end in the named error, never a hang). The GEMM table only
  # where CHECK_TABLE gives its args.
  RANKS=${RANKS:-2 4 8} RANKS_PARALLEL=${RANKS_PARALLEL:-3} mode_ranks quick
  step -k 10 "tests/test_gpu_gemm_cache.py" 200 "$OUT/gemm_cache.log" \
    python3 -m pytest -q -rsxX -m gpu tests/test_gpu_gemm_cache.py -p no:cacheprovider
  tail -n 2 "$OUT/gemm_cache.log"
  step -k 10 "tests/test_gpu_multiprocess.py (faults)" "${FAULTS_S:-240}" "$OUT/faults.log" \
    python3 -m pytest -q -rfEs -m gpu tests/test_gpu_multiprocess.py -p no:cacheprovider \
    -k "killed_process or faults_on_one_shared_gpu"
  tail -n 4 "$OUT/faults.log"
  [ -z "${CHECK_TABLE:-}" ] && return 0
  local -a table
  read -ra table <<< "$CHECK_TABLE"
  TABLE_S=${TABLE_S:-200} mode_table "${table[@]}"
}

# Runs "$@" with its stderr in its stdout, less the trace's two lines of every op call (a
# table's loops would write megabytes of them); keeps its exit status.
WITHOUT_CALL_LINES='set -o pipefail; "$@" 2>&1 |
  { grep --line-buffered -vE "^jax_ub trace: GPU [0-9]+ [a-z_]+ call #[0-9]+ (begins|enqueued)$" || true; }'

mode_table() {
  local log="$OUT/${TAG:-gemm_table}.log"
  # Traced for the kernel choices (tunings.log).
  step -k 10 "gemm table" "${TABLE_S:-500}" "$log" \
    env JAX_UB_TRACE=1 bash -c "$WITHOUT_CALL_LINES" calls python3 benchmarks/gemm_table.py "$@"
  grep -vE "$NOISE|^jax_ub trace" "$log" | tail -n 40
  step --ok any tunings 60 "$OUT/tunings.log" python3 benchmarks/tools/tuning_trace.py "$log"
  dry_run || cat "$OUT/tunings.log"
}

mode_bench() {
  local tag=${TAG:-bench}
  step -k 10 bench 400 "$OUT/$tag.log" \
    python3 -m jax_ub.bench --json "$OUT/$tag.json" --png "$OUT/$tag.png" "$@"
  grep -v "^  .*failed" "$OUT/$tag.log" | grep -vE "$NOISE" | tail -n 60
}

mode_model() {
  local tag=${TAG:-model}
  step -k 10 model "${MODEL_S:-450}" "$OUT/$tag.log" \
    env XLA_PYTHON_CLIENT_MEM_FRACTION="${MEM_FRACTION:-0.9}" \
    python3 -m jax_ub.bench.model --json "$OUT/$tag.json" "$@"
  grep -vE "$NOISE" "$OUT/$tag.log" | tail -n "${MODEL_LINES:-30}"
}

mode_llama() {
  local log="$OUT/${TAG:-llama}.log"
  step -k 10 train_llama "${TRAIN_S:-300}" "$log" python3 examples/train_llama.py "$@"
  grep -vE "$NOISE" "$log" | tail -n 12
}

mode_layer() {
  local tag=${TAG:-layer}
  step -k 10 layer "${LAYER_S:-450}" "$OUT/$tag.log" \
    python3 -m jax_ub.bench.layer --json "$OUT/$tag.json" --png "$OUT/$tag.png" "$@"
  grep -vE "$NOISE" "$OUT/$tag.log" | tail -n 40
}

mode_processes() {
  # One after the other in one call, so that drift between them stays small.
  local layout procs per name
  for layout in "1 0" "4 1" "2 2"; do
    read -r procs per <<< "$layout"
    local -a extra=()
    if [ "$procs" != 1 ]; then extra=(--processes "$procs" --gpus-per-process "$per"); fi
    name="procs_${procs}x${per}"
    echo "== processes ${procs} x ${per} GPUs (0: one process, all GPUs)"
    step -k 10 "processes ${procs} x ${per}" "${PROCESS_BENCH_S:-150}" "$OUT/$name.log" \
      python3 -m jax_ub.bench --json "$OUT/$name.json" --shapes "${SHAPE:-8192x8192x32768}" \
      --rounds 3 --iters 20 --no-windowed-einsum "${extra[@]}"
    grep -E "^(AG|RS) |jax_ub / gemm" "$OUT/$name.log"
  done
}

mode_flax() {
  step -k 10 flax 500 "$OUT/flax.log" python3 examples/train_tp_transformer.py --compare-xla \
    --rounds 3 --steps 30 --log-every 10 "$@"
  tail -n 30 "$OUT/flax.log"
}

mode_fp8train() {
  step -k 10 "fp8 training" "${TRAIN_S:-300}" "$OUT/fp8_train.log" \
    python3 examples/train_tp_transformer.py --fp8 --compare-bf16 --no-progress "$@"
  grep -vE "$NOISE" "$OUT/fp8_train.log" | tail -n 20
}

mode_profile() {
  # Kernels and the idle time between them, per call: GEMM alone, XLA, jax_ub (both ops).
  local op
  for op in ag rs; do
    step -k 10 "profile $op" "${PROFILE_S:-150}" "$OUT/profile_$op.log" \
      python3 benchmarks/tools/profile_kernels.py --op "$op" "$@"
    grep -vE "$NOISE" "$OUT/profile_$op.log" | tail -n 45
  done
}

mode_layerprofile() {
  # The layer's ops in order per variant: wall time against their GEMMs, idle time.
  step -k 10 "layer profile" "${PROFILE_S:-250}" "$OUT/layer_profile.log" \
    python3 benchmarks/tools/profile_layer.py "$@"
  grep -vE "$NOISE" "$OUT/layer_profile.log" | tail -n "${PROFILE_LINES:-150}"
}

mode_stepprofile() {
  # The Flax step's kernels by kind and its idle gaps, jax_ub vs XLA.
  step -k 10 "step profile" "${PROFILE_S:-250}" "$OUT/step_profile.log" \
    python3 benchmarks/tools/profile_train_step.py "$@"
  grep -vE "$NOISE" "$OUT/step_profile.log" | tail -n 70
}

mode_stepmemory() {
  # What fills the Llama step's peak memory per variant.
  step -k 10 "step memory" "${PROFILE_S:-250}" "$OUT/step_memory.log" \
    env XLA_PYTHON_CLIENT_MEM_FRACTION="${MEM_FRACTION:-0.9}" \
    python3 benchmarks/tools/step_memory.py --out /tmp/step_memory "$@"
  grep -vE "$NOISE" "$OUT/step_memory.log" | tail -n "${PROFILE_LINES:-120}"
  dry_run || tar czf "$OUT/step_memory.tgz" -C /tmp step_memory 2> /dev/null
}

mode_power() {
  # SM clock and power per implementation.
  local op
  for op in ag rs; do
    step -k 10 "power $op" "${POWER_S:-200}" "$OUT/power_$op.log" \
      python3 benchmarks/tools/power_clocks.py --op "$op" "$@"
    grep -vE "$NOISE" "$OUT/power_$op.log" | tail -n 12
  done
}

# The modes kept in files of their own.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/device_ranks.sh"
source "$HERE/device_tools.sh"

# Dispatch: the mode's function from MODES, or usage and exit 2 before anything runs.
what=${1:-all}
[ $# -gt 0 ] && shift
case $what in -h | --help) what=help ;; esac
mode_fn=""
for ((i = 0; i < ${#MODES[@]}; i += 3)); do
  if [ "${MODES[i]}" = "$what" ]; then mode_fn=${MODES[i + 2]}; fi
done
if [ -z "$mode_fn" ]; then
  echo "device_run.sh: unknown mode '$what'" >&2
  usage >&2
  exit 2
fi
if [ "$what" = help ]; then
  "$mode_fn"
  exit 0
fi

mkdir -p "$OUT"
KMSG_START=$(kernel_log | wc -l)
SCRATCH=$(mktemp -d)
# PACK=name: everything under $OUT into one archive at exit (the device's copy-back takes few files).
pack_out() {
  [ -n "${PACK:-}" ] || return 0
  local -a names
  mapfile -t names < <(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name "$PACK.tgz" -printf '%P\n')
  [ ${#names[@]} -gt 0 ] || return 0
  (cd "$OUT" && tar czf "$PACK.tgz" -- "${names[@]}" && rm -rf -- "${names[@]}")
}
trap 'end_step_group; stop_ranks_mps; rm -rf "$SCRATCH"; pack_out' EXIT
trap 'echo "device_run.sh: interrupted" >&2; exit 130' INT
trap 'echo "device_run.sh: terminated" >&2; exit 143' TERM HUP

step --ok any gpus 60 "$OUT/gpus.txt" nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
step --append --ok any "gpu topology" 60 "$OUT/gpus.txt" nvidia-smi topo -m
dry_run || head -n 12 "$OUT/gpus.txt"
if [ -n "${NO_BUILD:-}" ]; then echo "NO_BUILD: the jax_ub installed already"; else build_and_install; fi
"$mode_fn" "$@"

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "device_run.sh $what: ${#FAILED[@]} step(s) failed:"
  printf '  %s\n' "${FAILED[@]}"
  exit 1
fi
echo "device_run.sh $what: every step passed"
