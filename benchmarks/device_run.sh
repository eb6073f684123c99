#!/usr/bin/env bash
# On a GPU machine: build, then GPU tests or a benchmark. Logs go to $OUT.
# Usage (on the GPU machine, repo root):
#   [TAG=name] bash benchmarks/device_run.sh MODE [args...], MODE one of tests, bench, all,
#   flax, sanitize, processes, profile, stepprofile, gemm, power, overlapcost, layer,
#   layerprofile, fp8train, stepmemory, copyhold
# TAG names the bench outputs ($OUT/TAG.json/.png/.log; default "bench", "layer" for layer).
# layer: one sequence-parallel transformer layer, fwd and fwd+bwd, jax_ub vs XLA vs the
# no-communication bound (python -m jax_ub.bench.layer; args: its own, e.g. --sizes).
# flax: the TP transformer example, jax_ub vs XLA step time; sanitize: compute-sanitizer
# memcheck and racecheck (SANITIZE_TOOLS) on a small 2-GPU run (SANITIZE_TP, SANITIZE_CASE:
# sanitize_small.py; slow: minutes each); processes: the bench in
# one process, 4 x 1 and 2 x 2 processes x GPUs (4 GPUs); profile: profile_kernels.py for
# both ops (args: --tp, --shape); stepprofile: profile_train_step.py (its args); gemm:
# benchmarks/tools/gemm_candidates.cu and XLA's dot per m,k,n shape; power: power_clocks.py;
# overlapcost: benchmarks/tools/overlap_cost.cu per m,k,n chunk shape, then XLA's dot of the
# whole GEMM (2m rows) in loops as long (OVERLAP_SECONDS, default 2); layerprofile:
# profile_layer.py (its args); fp8train: the TP example with --fp8 --compare-bf16 (its args);
# stepmemory: benchmarks/tools/step_memory.py (bench.model's args; live ranges and buffer
# assignment in $OUT/step_memory.tgz); copyhold: benchmarks/tools/copy_hold.cu.
# Anything else only builds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
cat "$OUT/gpus.txt" | head -12
t0=$(date +%s)
timeout 300 bash -c 'cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_UB_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90-real} \
  -DPython_EXECUTABLE=$(command -v python3) > '"$OUT"'/build.log 2>&1 && ninja -C build/dev >> '"$OUT"'/build.log 2>&1' \
  || { echo BUILD FAILED; tail -40 "$OUT/build.log"; exit 1; }
ln -sf "$(pwd)"/build/dev/_host*.so "$(pwd)"/build/dev/_cuda*.so jax_ub/_src/
echo "built in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$(pwd)
# Kill what a step left behind (a hung test's processes would hold the GPUs and skew
# every later measurement). Matches command lines: keep these words out of the command
# that starts this script.
# Log lines of JAX/XLA/gRPC that say nothing about the run; filtered from what is printed.
NOISE='^[WI][0-9]{4} |GRPC|grpc_util|Source Location|^:'
cleanup() {
  pkill -9 -f "pytest|jax_ub.bench|train_llama|power_clocks|_mp_worker|_mp_fault_worker|train_tp_transformer|sanitize_small|profile_kernels|profile_train_step|profile_layer|step_memory" 2>/dev/null
  sleep 1
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  # One file at a time, each with its own limit, so a hang costs one file, not the run.
  # A file that times out runs again with JAX_UB_TRACE=1 for a minute: the last trace
  # lines of each GPU say where it stopped.
  : > "$OUT/gpu_tests.log"
  # TEST_SPECS overrides the files and their limits ("file:seconds ..."); TEST_K selects
  # tests by pytest's -k expression. The trace rerun does not capture output (-s).
  for spec in ${TEST_SPECS:-test_gpu.py:300 test_gpu_layouts.py:360 test_gpu_flax.py:150 test_gpu_multiprocess.py:260 test_gpu_reliability.py:200 test_gpu_fp8.py:150 test_gpu_epilogue.py:200 test_gpu_gemm_cache.py:150 test_gpu_models.py:300}; do
    file=${spec%%:*}; limit=${spec##*:}
    timeout -k 10 "$limit" python3 -m pytest -v -rsxX -m gpu "tests/$file" -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} \
      >> "$OUT/gpu_tests.log" 2>&1
    rc=$?; cleanup
    echo "tests/$file: rc=$rc"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      echo "tests/$file TIMED OUT after $limit s" >> "$OUT/gpu_tests.log"
      JAX_UB_TRACE=1 timeout -k 5 60 python3 -m pytest -x -q -s -m gpu "tests/$file" ${TEST_K:+-k "$TEST_K"} \
        -p no:cacheprovider > "$OUT/trace_$file.log" 2>&1
      cleanup
      grep "jax_ub trace" "$OUT/trace_$file.log" | tail -12
    fi
  done
  grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED|TIMED OUT" "$OUT/gpu_tests.log" | grep -v "^tests.*PASSED" | tail -30
  echo "passed: $(grep -cE " PASSED" "$OUT/gpu_tests.log")"; grep -E "^=+ .* in [0-9.]+s" "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  tag=${TAG:-bench}
  timeout -k 10 400 python3 -m jax_ub.bench --json "$OUT/$tag.json" --png "$OUT/$tag.png" "$@" 2>&1 \
    | tee "$OUT/$tag.log" | grep -v "^  .*failed" | grep -vE "$NOISE" | tail -60
  cleanup
fi
if [ "$what" = model ]; then
  # One training step of the Llama-style model per variant (python -m jax_ub.bench.model;
  # args: its own). MEM_FRACTION: the share of each GPU JAX may take.
  tag=${TAG:-model}
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9} timeout -k 10 ${MODEL_S:-450} \
    python3 -m jax_ub.bench.model --json "$OUT/$tag.json" "$@" 2>&1 \
    | tee "$OUT/$tag.log" | grep -vE "$NOISE" | tail -${MODEL_LINES:-30}
  cleanup
fi
if [ "$what" = llama ]; then
  # examples/train_llama.py (args: its own, e.g. --fp8 current --seeds 3).
  timeout -k 10 ${TRAIN_S:-300} python3 examples/train_llama.py "$@" > "$OUT/${TAG:-llama}.log" 2>&1
  echo "train_llama: rc=$?"
  grep -vE "$NOISE" "$OUT/${TAG:-llama}.log" | tail -12
  cleanup
fi
if [ "$what" = layer ]; then
  tag=${TAG:-layer}
  timeout -k 10 ${LAYER_S:-450} python3 -m jax_ub.bench.layer --json "$OUT/$tag.json" --png "$OUT/$tag.png" "$@" 2>&1 \
    | tee "$OUT/$tag.log" | grep -vE "$NOISE" | tail -40
  cleanup
fi
if [ "$what" = processes ]; then
  # The same bench as one process, as 4 x 1 and as 2 x 2 processes x GPUs, one
  # after the other in one call, so drift between them stays small. Prints jax_ub/GEMM.
  for layout in "1 0" "4 1" "2 2"; do
    set -- $layout; procs=$1; per=$2
    extra=""; [ "$procs" != 1 ] && extra="--processes $procs --gpus-per-process $per"
    timeout -k 10 ${PROCESS_BENCH_S:-150} python3 -m jax_ub.bench --json "$OUT/procs_${procs}x${per}.json" \
      --shapes ${SHAPE:-8192x8192x32768} --rounds 3 --iters 20 --no-windowed-einsum $extra \
      > "$OUT/procs_${procs}x${per}.log" 2>&1
    echo "== processes ${procs} x ${per} GPUs (0: one process, all GPUs): rc=$?"
    grep -E "^(AG|RS) |jax_ub / gemm" "$OUT/procs_${procs}x${per}.log"
    cleanup
  done
fi
if [ "$what" = flax ]; then
  timeout -k 10 500 python3 examples/train_tp_transformer.py --compare-xla --rounds 3 --steps 30 --log-every 10 "$@" 2>&1 \
    | tee "$OUT/flax.log" | tail -30
  cleanup
fi
if [ "$what" = profile ]; then
  # Kernels and the idle time between them, per call: GEMM alone, XLA, jax_ub (both ops).
  for op in ag rs; do
    timeout -k 10 ${PROFILE_S:-150} python3 benchmarks/tools/profile_kernels.py --op $op "$@" \
      > "$OUT/profile_$op.log" 2>&1
    echo "profile $op: rc=$?"
    grep -vE "$NOISE" "$OUT/profile_$op.log" | tail -45
    cleanup
  done
fi
if [ "$what" = layerprofile ]; then
  # The layer's ops in order per variant: wall time against their GEMMs, idle time
  # (benchmarks/tools/profile_layer.py; args: its own, e.g. --size, --pass).
  timeout -k 10 ${PROFILE_S:-250} python3 benchmarks/tools/profile_layer.py "$@" \
    > "$OUT/layer_profile.log" 2>&1
  echo "layer profile: rc=$?"
  grep -vE "$NOISE" "$OUT/layer_profile.log" | tail -${PROFILE_LINES:-150}
  cleanup
fi
if [ "$what" = fp8train ]; then
  # The TP transformer example in fp8 against the same run without fp8 (args: its own).
  timeout -k 10 ${TRAIN_S:-300} python3 examples/train_tp_transformer.py --fp8 --compare-bf16 \
    --no-progress "$@" > "$OUT/fp8_train.log" 2>&1
  echo "fp8 training: rc=$?"
  grep -vE "$NOISE" "$OUT/fp8_train.log" | tail -20
  cleanup
fi
if [ "$what" = stepprofile ]; then
  # The Flax step's kernels by kind and its idle gaps, jax_ub vs XLA (profile_train_step.py).
  timeout -k 10 ${PROFILE_S:-250} python3 benchmarks/tools/profile_train_step.py "$@" \
    > "$OUT/step_profile.log" 2>&1
  echo "step profile: rc=$?"
  grep -vE "$NOISE" "$OUT/step_profile.log" | tail -70
  cleanup
fi
if [ "$what" = stepmemory ]; then
  # What fills the Llama step's peak memory per variant (step_memory.py; args: bench.model's).
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9} timeout -k 10 ${PROFILE_S:-250} \
    python3 benchmarks/tools/step_memory.py --out /tmp/step_memory "$@" > "$OUT/step_memory.log" 2>&1
  echo "step memory: rc=$?"
  grep -vE "$NOISE" "$OUT/step_memory.log" | tail -${PROFILE_LINES:-120}
  tar czf "$OUT/step_memory.tgz" -C /tmp step_memory 2>/dev/null
  cleanup
fi
if [ "$what" = power ]; then
  # SM clock and power per implementation (benchmarks/tools/power_clocks.py; args: its own).
  for op in ag rs; do
    timeout -k 10 ${POWER_S:-200} python3 benchmarks/tools/power_clocks.py --op $op "$@" > "$OUT/power_$op.log" 2>&1
    echo "power $op: rc=$?"
    grep -vE "$NOISE" "$OUT/power_$op.log" | tail -12
    cleanup
  done
fi
if [ "$what" = overlapcost ]; then
  # tp=2's overlapped schedules rebuilt from the library's GEMM and copies, phase by
  # phase (args: m,k,n ...: one rank's chunk), then XLA's dot of the same whole GEMMs.
  secs=${OVERLAP_SECONDS:-2}
  timeout 120 ninja -C build/dev overlap_cost >> "$OUT/build.log" 2>&1 || { echo TOOL BUILD FAILED; tail -20 "$OUT/build.log"; }
  whole=""
  for shape in "$@"; do
    timeout -k 5 120 build/dev/overlap_cost "$shape" "$secs" 2>&1 | tee -a "$OUT/overlap_cost.log"
    IFS=, read -r m k n <<< "$shape"; whole="$whole $((2 * m)),$k,$n"
  done
  timeout -k 5 120 python3 benchmarks/tools/xla_dot_times.py --loop-seconds "$secs" $whole 2>&1 | grep "xla dot"
fi
if [ "$what" = copyhold ]; then
  # Whether a copy within a GPU holds back another stream's kernel, with the driver's
  # default hardware queues, 32 and 1 (CUDA_DEVICE_MAX_CONNECTIONS).
  timeout 120 ninja -C build/dev copy_hold >> "$OUT/build.log" 2>&1 || { echo TOOL BUILD FAILED; tail -20 "$OUT/build.log"; }
  timeout -k 5 60 env -u CUDA_DEVICE_MAX_CONNECTIONS build/dev/copy_hold 2>&1 | tee -a "$OUT/copy_hold.log"
  for conn in 32 1; do
    CUDA_DEVICE_MAX_CONNECTIONS=$conn timeout -k 5 60 build/dev/copy_hold 2>&1 | grep -A3 "^2\." \
      | tee -a "$OUT/copy_hold.log"
  done
fi
if [ "$what" = gemm ]; then
  # cuBLASLt's candidates per shape in both formulations, then XLA's dot at the same
  # shapes (args: m,k,n ...).
  timeout 120 ninja -C build/dev gemm_candidates >> "$OUT/build.log" 2>&1 || { echo GEMM TOOL BUILD FAILED; tail -20 "$OUT/build.log"; }
  timeout -k 5 ${GEMM_S:-240} build/dev/gemm_candidates --candidates ${GEMM_CANDIDATES:-24} "$@" > "$OUT/gemm_candidates.log" 2>&1
  echo "gemm_candidates: rc=$?"; grep -E "^==|best|#" "$OUT/gemm_candidates.log" | head -${GEMM_LINES:-150}
  timeout -k 5 120 python3 benchmarks/tools/xla_dot_times.py "$@" 2>&1 | grep "xla dot"
fi
if [ "$what" = sanitize ]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout ${SANITIZE_S:-270} compute-sanitizer --tool $tool --print-limit 50 \
      python3 benchmarks/tools/sanitize_small.py > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE_SMALL_OK|rel err|Invalid|Error" "$OUT/$tool.log" | head
  done
fi
