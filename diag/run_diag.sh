#!/usr/bin/env bash
# Diagnosis of the (dp=2, tp=1) compile crash on 2 GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/device_run.sh build 2>&1 | tail -5
export PYTHONPATH=$(pwd)
python3 -c "import jax; print(jax.__version__, jax.devices())"
run() { local name=$1; shift; timeout -k 5 120 env "$@" > "$OUT/v_$name.log" 2>&1; local rc=$?;
  echo "== $name rc=$rc: $(grep -E 'rel err|Fatal|Error|error' "$OUT/v_$name.log" | grep -v '^[WI][0-9]' | head -3)"; }
run ag python3 diag/repro_tp1.py ag
run ag_cpu python3 diag/repro_tp1.py ag cpu
run rs python3 diag/repro_tp1.py rs
run ag_tp2 python3 diag/repro_tp1.py ag_tp2
run ag_f32 python3 diag/repro_tp1.py ag_f32
run ag_full python3 diag/repro_tp1.py ag_full
run ag_setmesh python3 diag/repro_tp1.py ag_setmesh
run ag_gathered python3 diag/repro_tp1.py ag_gathered
run ag_zspec DIAG_ZSPEC=1 python3 diag/repro_tp1.py ag
run ag_gspmd DIAG_GSPMD=1 python3 diag/repro_tp1.py ag
run ag_noside DIAG_NOSIDE=1 python3 diag/repro_tp1.py ag
run ag_full_zspec DIAG_ZSPEC=1 python3 diag/repro_tp1.py ag_full
mkdir -p /tmp/dump
run ag_dump XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_pass_re=.*" python3 diag/repro_tp1.py ag
echo "== last dumped files:"; ls -t /tmp/dump | head -8
(cd /tmp && tar czf "$OUT/dump.tgz" dump)
timeout -k 5 240 cuda-gdb -batch -ex "set pagination off" -ex run -ex bt -ex "info sharedlibrary" --args python3 diag/repro_tp1.py ag > "$OUT/gdb.log" 2>&1
echo "gdb rc=$?"; grep -E "^#[0-9]+" "$OUT/gdb.log" | head -40
