#!/usr/bin/env bash
# The wheel built without a CUDA toolkit (.ci/wheel_check.sh), checked on a GPU machine: no
# network there; JAX with its CUDA 13 plugin is already installed. Installs the wheel over
# any jax_ub installed (no dependencies), then from a temporary folder outside the source
# tree runs `python -m jax_ub.info` and the GPU tests tests/test_gpu.py and
# tests/test_gpu_layouts.py (copied out of the repo) against the installed wheel.
# Usage: bash benchmarks/wheel_gpu_check.sh path/to/jax_ub-*.whl
# Logs go to $OUT if set (wheel_gpu_check.log, info.txt, test_*.log). PYTHON picks the
# interpreter (default python3). Exit status: 0 when every step passed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
unset PYTHONPATH  # the installed wheel, never the source tree
[ -f "${1:-}" ] || { echo "usage: $0 path/to/jax_ub-*.whl"; exit 2; }
wheel=$(realpath "$1")
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
tmp=$(mktemp -d /tmp/jax_ub_wheel_gpu.XXXXXX)
logs=${OUT:-$tmp/logs}
mkdir -p "$logs"
log="$logs/wheel_gpu_check.log"
: > "$log"
say() { echo "$*" | tee -a "$log"; }
failed=0
fail() { say "FAIL: $*"; failed=1; }

say "== wheel $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB); work folder $tmp"
timeout 60 nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>&1 | tee -a "$log"

say "== install (no dependencies, no index)"
timeout 300 "$PY" -m pip install --no-deps --no-index --force-reinstall "$wheel" >> "$log" 2>&1 \
  || { fail "pip install"; tail -n 20 "$log"; exit 1; }

mkdir -p "$tmp/suite/tests"
cp "$SRC"/tests/conftest.py "$SRC"/tests/test_gpu.py "$SRC"/tests/test_gpu_layouts.py "$tmp/suite/tests/"
cat > "$tmp/suite/pytest.ini" << 'EOF'
[pytest]
timeout = 300
markers =
    gpu: needs CUDA GPUs (skipped without them)
EOF
cd "$tmp/suite" || exit 1

loaded=$(timeout 120 "$PY" -c "import jax_ub; print(jax_ub.__file__)" 2>> "$log")
say "jax_ub imported from $loaded"
case "$loaded" in
  "$SRC"/* | "") fail "jax_ub is not the installed wheel's" ;;
esac
so=$(dirname "$loaded")/_src
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2> /dev/null || true)
if [ -n "$cuobjdump" ]; then
  say "GPU code in the CUDA extension (count, kind, architecture):"
  "$cuobjdump" --list-elf --list-ptx "$so"/_cuda*.so 2>&1 \
    | sed -E 's/.*\.(sm_[0-9a-z]+)\.(cubin|ptx)$/\2 \1/' | sort | uniq -c | tee -a "$log"
fi

say "== python -m jax_ub.info"
timeout 300 "$PY" -m jax_ub.info > "$logs/info.txt" 2>&1 || fail "jax_ub.info (rc=$?)"
tee -a "$log" < "$logs/info.txt"
grep -q "CUDA loaded" "$logs/info.txt" || fail "the CUDA extension did not load"
grep -q "^devices (gpu" "$logs/info.txt" || fail "JAX sees no GPU"

# One file at a time under its own limit, as benchmarks/device_run.sh does. Each file must
# run tests: test_gpu.py needs 2 GPUs, test_gpu_layouts.py 1.
ngpus=$(timeout 60 nvidia-smi -L 2> /dev/null | grep -c "^GPU ")
for spec in test_gpu.py:300:2 test_gpu_layouts.py:200:1; do
  IFS=: read -r file limit needs <<< "$spec"
  say "== tests/$file (limit $limit s)"
  timeout -k 10 "$limit" "$PY" -m pytest -v -rsxX -m gpu -p no:cacheprovider "tests/$file" \
    > "$logs/${file%.py}.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)|SKIPPED|^=+ .* in [0-9.]+s" "$logs/${file%.py}.log" | tail -n 15 | tee -a "$log"
  passed=$(grep -c " PASSED" "$logs/${file%.py}.log")
  say "tests/$file: rc=$rc, passed=$passed"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then  # 5: pytest ran none (all skipped)
    fail "tests/$file"
  elif [ "$passed" -eq 0 ]; then
    if [ "$ngpus" -ge "$needs" ]; then fail "tests/$file: none ran"; else say "(needs $needs GPUs)"; fi
  fi
done

if [ "$failed" -eq 0 ]; then say "== wheel GPU check passed"; else say "== wheel GPU check FAILED"; fi
say "logs: $logs"
exit "$failed"
