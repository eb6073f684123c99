#!/usr/bin/env bash
# The N-ranks mode of benchmarks/device_run.sh (sourced by it; uses its step, OUT, SCRATCH,
# FAILED): GPU test files run as N ranks sharing a GPU, in lanes.

# The N-ranks mode's test sets: items file[@k]:seconds[:N0], each run at every N (from N0 on,
# where given: below it the selection holds no test), under a limit of about 1.5x the
# longest time seen at N = 2-8 on one H200 with 3 or 4 lanes on it (rank 0 compiling for
# all; the most is at N = 8), scaled by lanes/3 above 3 lanes a GPU. Without MPS, 6 lanes of
# N = 8 saturated the host's 16 cores and items ran past their limits; under MPS 4 lanes of
# N = 8 kept 5 to 14 cores busy and the GPU was often idle, each group's rank 0 (compiling
# for all) its busiest thread. @k: only pytest -k k's tests, a "+" in k standing for a
# space; the long files are split so that parallel lanes balance. quick: about 3 minutes at
# N = 8 with 3 lanes.
RANKS_QUICK="test_gpu.py:200 test_gpu_schedules.py:220 test_gpu_fp8.py:210 test_gpu_epilogue.py:110"
RANKS_ALL="$RANKS_QUICK test_gpu_grad_matrix.py@op_gradients+and+dp1x:200
  test_gpu_grad_matrix.py@op_gradients+and+not+dp1x:180:4 test_gpu_grad_matrix.py@layer_gradients+and+dp1x:220
  test_gpu_grad_matrix.py@layer_gradients+and+not+dp1x:230:4 test_gpu_layouts.py:200 test_gpu_flax.py:60
  test_gpu_reliability.py:150 test_gpu_models.py@trains_as:380 test_gpu_models.py@not+trains_as:510
  test_gpu_general_lm.py:310 test_gpu_ported_lm.py:280"
# Items of the whole set run once, not per N (N shown as 0; RANKS_ONCE="" for none): tests
# that start processes of their own on GPU 0, the fault tests among them.
RANKS_ONCE=${RANKS_ONCE-"test_gpu_multiprocess.py@one_gpu+or+one_shared_gpu:400"}
# Files whose ranks each need several GiB (test_gpu.py's largest case makes its global
# arrays whole on every rank): with several lanes, all their items run one after another in
# lane 0, so that no two of them hold that memory at once.
RANKS_HEAVY="test_gpu.py"

# The MPS daemon of the N-ranks mode (mode_ranks), stopped at its end or at the script's.
RANKS_MPS_DIR=""
RANKS_MPS_VARS=()
stop_ranks_mps() {
  if [ -n "$RANKS_MPS_DIR" ]; then python3 tests/_ranks_gpu.py mps-stop "$RANKS_MPS_DIR"; fi
  RANKS_MPS_DIR=""
  RANKS_MPS_VARS=()
}

# One item of the N-ranks mode at one N: ranks_item N FILE K LIMIT LOG (K: pytest's -k, or
# empty), the test run appended to LOG; pytest's own args follow in RANKS_ARGS.
ranks_item() {
  local n=$1 file=$2 k=$3 limit=$4 log=$5 start tag=${file%.py}
  local -a sel=()
  if [ -n "$k" ]; then
    sel=(-k "$k")
    tag+=_$(tr -c 'A-Za-z0-9_\n' _ <<< "$k")
  fi
  start=$(wc -l < "$log")
  if [ "$n" -eq 0 ]; then  # an item of RANKS_ONCE: its tests start their own processes
    step --append --ok "0 5" -k 10 "processes on GPU 0: tests/$file${k:+ -k \"$k\"}" "$limit" "$log" \
      python3 -m pytest -q -rfEs -m gpu "tests/$file" "${sel[@]}" "${RANKS_ARGS[@]}"
  else
    local logs="${RANKS_LOGS:-$SCRATCH}/ranks_${n}_$tag"
    # -k 75: a launcher that the limit ends takes its ranks' stacks first (tests/_ranks.py).
    step --append --ok "0 5" -k 75 "ranks=$n tests/$file${k:+ -k \"$k\"}" "$limit" "$log" \
      env "${RANKS_MPS_VARS[@]}" python3 -m pytest --ranks "$n" --ranks-logs "$logs" -q -rfEs \
      -m gpu "tests/$file" "${sel[@]}" "${RANKS_ARGS[@]}"
    # A failed item's rank logs (the launcher prints rank 0's alone) and, where a limit ended
    # it, each rank's stacks (rank<i>_stacks.txt, rank<i>_native.txt), as one file in $OUT.
    if [ "$STEP_RC" -ne 0 ] && [ "$STEP_RC" -ne 5 ] && [ -d "$logs" ]; then
      tar czf "$OUT/ranks_failed_${n}_$tag.tgz" -C "$(dirname "$logs")" "$(basename "$logs")" &&
        echo "  rank logs: ranks_failed_${n}_$tag.tgz"
    fi
  fi
  tail -n "+$((start + 1))" "$log" \
    | grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|rank [0-9]+ (ended|had not)" | tail -n 4
}

# Every item at every N from its N0 on (and RANKS_ONCE_SPECS' at N = 0), as lines
# "seconds n file k" (k: "-" for none), longest first.
ranks_work() {
  local n spec file k secs from
  for n in "$@"; do
    local -a specs=("${RANKS_SPECS[@]}")
    [ "$n" -eq 0 ] && specs=("${RANKS_ONCE_SPECS[@]}")
    for spec in "${specs[@]}"; do
      IFS=: read -r file secs from <<< "$spec"
      [ "$n" -gt 0 ] && [ "$n" -lt "${from:-0}" ] && continue
      k=-
      if [[ $file == *@* ]]; then
        k=${file#*@}
        file=${file%%@*}
      fi
      echo "$secs $n $file $k"
    done
  done | sort -rn -k1,1
}

# What a rank of the N-ranks mode holds on its GPU, about (MiB; RANKS_RANK_MIB): 3 lanes of
# N = 8 (24 ranks) ran an H100's 80 GB out of memory, 4 lanes (32) fit an H200's 141 GB.
RANK_GPU_MIB=${RANKS_RANK_MIB:-3700}

# plan_lanes LANES GPUS: the items of ranks_work dealt over LANES lanes (the heavy files'
# items to lane 0, one after another; then each other item, longest first, to the lane
# with the least work so far). Sets load, items, most (each lane's largest N) and on_gpu
# (the ranks on each GPU at once: its lanes' largest N summed; lane L shares GPU L % GPUS).
plan_lanes() {
  local lanes=$1 gpus=$2 lane i pass heavy secs n file k
  load=() items=() most=() on_gpu=()
  for ((lane = 0; lane < lanes; lane++)); do load[lane]=0; items[lane]=""; most[lane]=0; done
  for pass in heavy rest; do
    while read -r secs n file k; do
      [[ " $RANKS_HEAVY " == *" $file "* ]] && heavy=heavy || heavy=rest
      [ "$heavy" = "$pass" ] || continue
      lane=0
      if [ "$pass" = rest ]; then
        for ((i = 1; i < lanes; i++)); do [ "${load[i]}" -lt "${load[lane]}" ] && lane=$i; done
      fi
      load[lane]=$((load[lane] + secs))
      items[lane]+="$n $file $k $secs;"
      [ "$n" -gt "${most[lane]}" ] && most[lane]=$n
    done < <(ranks_work "${ranks[@]}" "${once[@]}")
  done
  for ((lane = 0; lane < lanes; lane++)); do
    on_gpu[lane % gpus]=$((${on_gpu[lane % gpus]:-0} + most[lane]))
  done
}

# lanes_fit GPUS: whether every GPU's ranks at once (on_gpu) fit 0.85 of its memory
# (GPU_MIB; unknown fits) at RANK_GPU_MIB each.
lanes_fit() {
  local g mib
  for ((g = 0; g < $1; g++)); do
    mib=${GPU_MIB[g]:-}
    [[ $mib =~ ^[0-9]+$ ]] || continue
    [ $((${on_gpu[g]:-0} * RANK_GPU_MIB * 100)) -le $((mib * 85)) ] || return 1
  done
  return 0
}

mode_ranks() {
  local set=quick
  case ${1:-} in quick | all) set=$1; shift ;; esac
  RANKS_ARGS=("$@")
  if [ -n "${RANKS_FILES:-}" ]; then read -ra RANKS_SPECS <<< "$RANKS_FILES"
  elif [ "$set" = all ]; then read -ra RANKS_SPECS <<< "${RANKS_ALL//$'\n'/ }"; else read -ra RANKS_SPECS <<< "$RANKS_QUICK"; fi
  local -a ranks once=()
  read -ra ranks <<< "${RANKS:-4}"
  RANKS_ONCE_SPECS=()
  if [ "$set" = all ] && [ -z "${RANKS_FILES:-}" ]; then read -ra RANKS_ONCE_SPECS <<< "$RANKS_ONCE"; once=(0); fi
  local lanes=${RANKS_PARALLEL:-1} gpus secs n file k lane i
  local -a load=() items=() most=() on_gpu=() GPU_MIB=()
  [[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "RANKS_PARALLEL must be a count of lanes, got '$lanes'"; exit 2; }
  # The GPUs the lanes share: RANKS_GPUS (e.g. "1"), else every GPU nvidia-smi lists.
  local -a gpu_ids
  if [ -n "${RANKS_GPUS:-}" ]; then read -ra gpu_ids <<< "$RANKS_GPUS"
  else read -ra gpu_ids <<< "$(nvidia-smi --query-gpu=index --format=csv,noheader 2> /dev/null | tr '\n' ' ')"; fi
  [ ${#gpu_ids[@]} -ge 1 ] || gpu_ids=(0)
  gpus=${#gpu_ids[@]}
  # Each GPU's memory in MiB: RANKS_GPU_MIB, else nvidia-smi's (once, not per plan).
  for ((i = 0; i < gpus; i++)); do
    GPU_MIB[i]=${RANKS_GPU_MIB:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits \
      -i "${gpu_ids[i]}" 2> /dev/null | head -n 1)}
  done
  plan_lanes "$lanes" "$gpus"
  # Fewer lanes where the ranks they put on a GPU at once would not fit its memory.
  local wanted=$lanes
  while [ "$lanes" -gt 1 ] && ! lanes_fit "$gpus"; do
    lanes=$((lanes - 1))
    plan_lanes "$lanes" "$gpus"
  done
  [ "$lanes" -lt "$wanted" ] && echo "RANKS_PARALLEL=$wanted: $lanes lane(s), so that each of" \
    "the ${on_gpu[0]} ranks on a GPU at once has about $RANK_GPU_MIB MiB of its ${GPU_MIB[0]}" \
    "(0.85 of it in all; RANKS_RANK_MIB)"
  # One MPS daemon for every lane's ranks (tests/_ranks_gpu.py start_mps; none where the machine
  # has none, or JAX_UB_TEST_RANKS_MPS=0), so that their kernels run side by side instead of
  # taking turns on the GPU; RANKS_ONCE's processes run without it.
  if ! dry_run; then
    RANKS_MPS_DIR=$SCRATCH/mps
    read -ra RANKS_MPS_VARS <<< "$(python3 tests/_ranks_gpu.py mps-start "$RANKS_MPS_DIR")"
    echo "ranks share the GPU: ${RANKS_MPS_VARS[*]:-taking turns (no MPS daemon)}"
  fi
  # RANKS_THREADS=1: where the host's CPU time goes meanwhile, every 30 s
  local sampler=""
  if [ -n "${RANKS_THREADS:-}" ] && ! dry_run; then
    python3 benchmarks/tools/hot_threads.py --seconds 100000 --every 30 --top 16 \
      > "$OUT/ranks_threads.log" 2>&1 &
    sampler=$!
  fi
  for ((lane = 0; lane < lanes; lane++)); do
    (
      export JAX_UB_TEST_RANKS_GPU=${gpu_ids[lane % gpus]} JAX_UB_TEST_RANKS_ON_GPU=${on_gpu[lane % gpus]}
      # lanes sharing this lane's GPU (and its host's cores with the others)
      sharing=$(((lanes + gpus - 1 - lane % gpus) / gpus))
      FAILED=()
      log="$OUT/ranks_lane$lane.log"
      : > "$log"
      IFS=';' read -ra work <<< "${items[lane]}"
      for item in "${work[@]}"; do
        read -r n file k secs <<< "$item"
        [ "$k" = - ] && k="" || k=${k//+/ }
        ranks_item "$n" "$file" "$k" "$((sharing > 3 ? secs * sharing / 3 : secs))" "$log"
      done > "$SCRATCH/lane_$lane.out"
      printf '%s\n' "${FAILED[@]}" > "$SCRATCH/lane_$lane.failed"
    ) &
    lane_pids[lane]=$!
  done
  for ((lane = 0; lane < lanes; lane++)); do wait "${lane_pids[lane]}"; done
  [ -n "$sampler" ] && kill "$sampler" 2> /dev/null
  # Where an item failed, what the GPU's side saw: under MPS one client's fatal fault reaches
  # every client on the GPU, so the rank that reports an error may not be the one that made
  # it; the daemon's logs and the kernel's Xid lines name the faulting process.
  if cat "$SCRATCH"/lane_*.failed 2> /dev/null | grep -q .; then
    if [ -n "$RANKS_MPS_DIR" ] && [ -d "$RANKS_MPS_DIR/log" ]; then
      tar czf "$OUT/ranks_mps_logs.tgz" -C "$RANKS_MPS_DIR" log && echo "MPS logs: ranks_mps_logs.tgz"
    fi
    { dmesg 2> /dev/null || journalctl -k --no-pager 2> /dev/null; } | grep -iE "xid|nvrm" \
      | tail -n 200 > "$OUT/ranks_xid.log" || true
  fi
  stop_ranks_mps
  for ((lane = 0; lane < lanes; lane++)); do
    echo "-- lane $lane (GPU ${gpu_ids[lane % gpus]}, about ${load[lane]} s of limits; log: ranks_lane$lane.log):"
    cat "$SCRATCH/lane_$lane.out"
    while IFS= read -r f; do [ -n "$f" ] && FAILED+=("$f"); done < "$SCRATCH/lane_$lane.failed"
  done
}
