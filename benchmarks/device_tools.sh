#!/usr/bin/env bash
# The CUDA diagnostic tools' modes of benchmarks/device_run.sh (sourced by it; uses its step,
# build_tool, OUT, NOISE): cuBLASLt candidates, one rank's schedules, the flag GEMM, the paced
# link, overlap and copy costs, compute-sanitizer.

mode_gemm() {
  # cuBLASLt's candidates per shape in both formulations, then XLA's dot at the same shapes.
  build_tool gemm_candidates
  step -k 5 gemm_candidates "${GEMM_S:-240}" "$OUT/gemm_candidates.log" \
    build/dev/gemm_candidates --candidates "${GEMM_CANDIDATES:-24}" --runs "${GEMM_RUNS:-200}" \
    ${GEMM_WINDOWS:+--windows "$GEMM_WINDOWS"} ${GEMM_COPIES:+--copies "$GEMM_COPIES"} "$@"
  grep -E "^==|best|#|cuBLAS" "$OUT/gemm_candidates.log" | head -n "${GEMM_LINES:-150}"
  step -k 5 "xla dot" 120 "$SCRATCH/xla_dot.log" python3 benchmarks/tools/xla_dot_times.py "$@"
  grep "xla dot" "$SCRATCH/xla_dot.log"
}

# Llama 3 projections as op:name:tokens:in:out (the whole layer's GEMM; per-rank shapes
# follow from tp): 8B (hidden 4096, ffn 14336, qkv 6144) and 70B (8192, 28672, 10240).
SOLO_PROJECTIONS="ag:8b_qkv:8192:4096:6144 ag:8b_gate_up:8192:4096:28672 rs:8b_o:8192:4096:4096 rs:8b_down:8192:14336:4096 ag:70b_qkv:8192:8192:10240 ag:70b_gate_up:8192:8192:57344 rs:70b_o:8192:8192:8192 rs:70b_down:8192:28672:8192"

mode_solo() {
  # One rank's compute schedule per projection and tp on GPU 0, its peers' rows in place,
  # against the GEMM of the rank's whole work (SOLO_TP, default "2 4 8"; SOLO_S seconds a loop).
  build_tool solo_schedule
  local spec op name tokens in out tp m k n gbps from
  : > "$OUT/solo.log"
  for tp in ${SOLO_TP:-2 4 8}; do
    for spec in ${SOLO_SHAPES:-$SOLO_PROJECTIONS}; do
      IFS=: read -r op name tokens in out <<< "$spec"
      m=$((tokens / tp))
      if [ "$op" = ag ]; then k=$in n=$((out / tp)); else k=$((in / tp)) n=$out; fi
      for fold in ${SOLO_FOLDS:-2048}; do
        for sched in ${SOLO_SCHEDULES:-steps}; do
          case $op:${sched%%:*} in ag:ring | ag:merged | ag:one_pass | ag:early | ag:signal | rs:in_turn) continue ;; esac
          gbps=0  # the modelled link paces the RS's partials only
          [ "$op" = rs ] && gbps=${SOLO_GBPS:-0}
          from=$(($(wc -l < "$OUT/solo.log") + 1))  # this run's lines
          step --append -k 5 "solo $name tp=$tp fold_rows=$fold $sched" 120 "$OUT/solo.log" \
            build/dev/solo_schedule "$op" "$tp" "$m,$k,$n" "${SOLO_S:-0.5}" "$fold" "$sched" \
            "${SOLO_MERGE_ROWS:-2048}" "$gbps"
          tail -n "+$from" "$OUT/solo.log" | grep -E "^as enqueued|^graphs|x[0-9.]* \(gated" \
            | sed "s/^/$name, fold_rows=$fold: /"
          tail -n "+$from" "$OUT/solo.log" | grep -E "^(sum pass alone|floor with|paced at)" | sed "s/^/  /"
        done
      done
    done
  done
}

# The all-gather projections of SOLO_PROJECTIONS at each tp of $1, one "M,K,N:tp" a line (M
# the gathered rows, N a rank's columns): the CUTLASS tools' default shapes.
ag_projection_specs() {
  local tp spec op name tokens in out
  for tp in $1; do
    for spec in $SOLO_PROJECTIONS; do
      IFS=: read -r op name tokens in out <<< "$spec"
      [ "$op" = ag ] && echo "$tokens,$in,$((out / tp)):$tp"
    done
  done
}

mode_flaggemm() {
  build_tool flag_gemm 600  # CUTLASS's kernels: about 3 minutes on 2 cores
  [ "$STEP_RC" -eq 0 ] || { echo "flag_gemm needs CUTLASS's headers at configure time (see help)"; return; }
  local spec shape blocks order
  local -a specs=("$@")
  [ ${#specs[@]} -gt 0 ] || mapfile -t specs < <(ag_projection_specs "${FLAG_TP:-4 8}")
  : > "$OUT/flag_gemm.log"
  for spec in "${specs[@]}"; do
    IFS=: read -r shape blocks order <<< "$spec"
    step --append -k 5 "flag_gemm $spec" 150 "$OUT/flag_gemm.log" \
      build/dev/flag_gemm "$shape" "$blocks" "${FLAG_S:-0.3}" all ${order:+"$order"}
  done
  grep -E "^(device|correctness|impl|cublaslt|chunked|coop|ping)|TIMEOUT" "$OUT/flag_gemm.log" \
    | grep -vE "rel_err.*(PASS|as expected\))$"
}

mode_paced() {
  build_tool paced_gemm 600  # CUTLASS's kernels: about 3 minutes on 2 cores
  [ "$STEP_RC" -eq 0 ] || { echo "paced_gemm needs CUTLASS's headers at configure time (see help)"; return; }
  local spec shape tp rank gbps
  local -a specs=("$@")
  [ ${#specs[@]} -gt 0 ] || mapfile -t specs < <(ag_projection_specs "${PACED_TP:-4 8}")
  : > "$OUT/paced_gemm.log"
  for gbps in ${PACED_GBPS:-270}; do
    for spec in "${specs[@]}"; do
      IFS=: read -r shape tp rank <<< "$spec"
      step --append -k 5 "paced_gemm $spec at $gbps GB/s" 150 "$OUT/paced_gemm.log" \
        build/dev/paced_gemm "$shape" "$tp" "${rank:-$((tp / 2))}" "$gbps" "${PACED_S:-0.3}" "${PACED_CONFIGS:-all}" \
        "${PACED_LATENCY_US:-0}"
    done
  done
  grep -E "^(device|correctness|harness|impl|whole|paced)|TIMEOUT|FAIL" "$OUT/paced_gemm.log"
}

mode_signalgemm() {
  # The reduce-scatter's partials from one GEMM raising each row block's flag as it is written
  # (args: tp:m,k,n ..., a rank's; default the RS projections of SOLO_PROJECTIONS at SIGNAL_TP,
  # default "4 8"; SIGNAL_GBPS, default 270: the modelled link; SIGNAL_S seconds a loop).
  build_tool signal_gemm 600
  [ "$STEP_RC" -eq 0 ] || { echo "signal_gemm needs CUTLASS's headers at configure time (see help)"; return; }
  local spec tp shape op name tokens in out
  local -a specs=("$@")
  if [ ${#specs[@]} -eq 0 ]; then
    for tp in ${SIGNAL_TP:-4 8}; do
      for spec in $SOLO_PROJECTIONS; do
        IFS=: read -r op name tokens in out <<< "$spec"
        [ "$op" = rs ] && specs+=("$tp:$((tokens / tp)),$((in / tp)),$out")
      done
    done
  fi
  : > "$OUT/signal_gemm.log"
  for spec in "${specs[@]}"; do
    IFS=: read -r tp shape <<< "$spec"
    step --append -k 5 "signal_gemm $spec" 150 "$OUT/signal_gemm.log" \
      build/dev/signal_gemm "$tp" "$shape" "${SIGNAL_S:-0.25}" "${SIGNAL_GBPS:-270}"
  done
  grep -E "^(call|correctness|tp=|impl|whole|stock|ordered|signal|cached|sum|link)|FAIL" "$OUT/signal_gemm.log"
}

mode_overlapcost() {
  # tp=2's overlapped schedules rebuilt from the library's GEMM and copies, phase by phase
  # (args: m,k,n ...: one rank's chunk), then XLA's dot of the same whole GEMMs.
  local secs=${OVERLAP_SECONDS:-2} shape m k n
  local -a whole=()
  build_tool overlap_cost
  for shape in "$@"; do
    step -k 5 "overlap_cost $shape" 120 "$SCRATCH/overlap_cost.log" \
      build/dev/overlap_cost "$shape" "$secs"
    tee -a "$OUT/overlap_cost.log" < "$SCRATCH/overlap_cost.log"
    IFS=, read -r m k n <<< "$shape"
    whole+=("$((2 * m)),$k,$n")
  done
  step -k 5 "xla dot" 120 "$SCRATCH/xla_dot.log" \
    python3 benchmarks/tools/xla_dot_times.py --loop-seconds "$secs" "${whole[@]}"
  grep "xla dot" "$SCRATCH/xla_dot.log"
}

mode_copyhold() {
  # Whether a copy within a GPU holds back another stream's kernel, with the driver's
  # default hardware queues, 32 and 1 (CUDA_DEVICE_MAX_CONNECTIONS).
  local conn
  build_tool copy_hold
  step -k 5 copy_hold 60 "$SCRATCH/copy_hold.log" env -u CUDA_DEVICE_MAX_CONNECTIONS build/dev/copy_hold
  tee -a "$OUT/copy_hold.log" < "$SCRATCH/copy_hold.log"
  for conn in 32 1; do
    step -k 5 "copy_hold CUDA_DEVICE_MAX_CONNECTIONS=$conn" 60 "$SCRATCH/copy_hold.log" \
      env CUDA_DEVICE_MAX_CONNECTIONS="$conn" build/dev/copy_hold
    grep -A3 "^2\." "$SCRATCH/copy_hold.log" | tee -a "$OUT/copy_hold.log"
  done
}

mode_lazyload() {
  # CUDA's lazy loading against a stream parked on a flag (benchmarks/tools/lazy_load.cu):
  # first launches with modules loaded lazily and eagerly, a module load while only another
  # thread's copy can release the parked stream (the watchdog's way), a flag's round trip.
  local m
  build_tool lazy_load
  for m in LAZY EAGER; do
    step -k 5 "lazy_load local, CUDA_MODULE_LOADING=$m" 60 "$SCRATCH/lazy_load.log" \
      env CUDA_MODULE_LOADING="$m" build/dev/lazy_load local
    tee -a "$OUT/lazy_load.log" < "$SCRATCH/lazy_load.log"
  done
  step --ok any -k 2 "lazy_load deadlock" 20 "$SCRATCH/lazy_load.log" build/dev/lazy_load deadlock
  tee -a "$OUT/lazy_load.log" < "$SCRATCH/lazy_load.log"
  [ "$STEP_RC" -eq 0 ] || echo "lazy_load deadlock: ended by its time limit (rc=$STEP_RC): stuck" |
    tee -a "$OUT/lazy_load.log"
  step -k 5 "lazy_load latency" 60 "$SCRATCH/lazy_load.log" build/dev/lazy_load latency
  tee -a "$OUT/lazy_load.log" < "$SCRATCH/lazy_load.log"
}

mode_sanitize() {
  local -a tools
  local tool
  read -ra tools <<< "${SANITIZE_TOOLS:-memcheck racecheck}"
  for tool in "${tools[@]}"; do
    step "$tool" "${SANITIZE_S:-270}" "$OUT/$tool.log" env XLA_PYTHON_CLIENT_PREALLOCATE=false \
      compute-sanitizer --tool "$tool" --print-limit 50 python3 benchmarks/tools/sanitize_small.py
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|SANITIZE_SMALL_OK|rel err|Invalid|Error" "$OUT/$tool.log" | head
  done
}
