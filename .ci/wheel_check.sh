#!/usr/bin/env bash
# The toolkit-free GPU build, checked on a machine without a GPU:
#  1. builds the wheel with every CUDA toolkit hidden (no nvcc on PATH, no CUDA_HOME,
#     /usr/local/cuda* empty), so that nvcc and the CUDA headers must come from the NVIDIA
#     PyPI wheels that _build_backend/backend.py asks for;
#  2. checks that the wheel has the CUDA extension, and what GPU code it carries;
#  3. installs the wheel with its test extra into a fresh venv outside the source tree;
#  4. runs the CPU tests of .ci/subset.txt (WHOLE=1: the whole suite) against the installed
#     wheel, from outside the source tree;
#  5. installs nvidia-cublas there and loads the CUDA extension (no GPU needed for that).
# The toolkit is hidden in a private mount namespace (unshare: root, or a user namespace
# otherwise), which nothing outside this script sees. Where no namespace can be made, the
# build is told to take the wheels (JAX_UB_CUDA_FROM_WHEELS=1) and says loudly that the
# toolkit was only off PATH, not hidden.
# Usage: bash .ci/wheel_check.sh [WORK_DIR]   (default: a new folder under /tmp; the wheel
# is left in WORK_DIR/dist; KEEP=1 keeps the build folder and the venv too). PYTHON picks
# the interpreter (default python3); QUICK=1 runs test_ops_forward.py, not the whole suite.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TOOLS="nvcc ptxas cudafe++ fatbinary nvlink"

if [ "${1:-}" = --hidden-build ]; then
  # Runs inside the mount namespace: hide every toolkit, prove it, build the wheel.
  work=$2
  for d in /usr/local/cuda /usr/local/cuda-* ${CUDA_HOME:-} ${CUDA_PATH:-}; do
    [ -d "$d" ] || continue
    mount -t tmpfs -o ro,size=4k jax_ub_no_cuda "$(realpath "$d")"
  done
  # Left on PATH by the toolkit (e.g. wrapper scripts in /usr/local/bin): an empty file
  # that is not executable is bound over each.
  : > "$work/not_a_tool"; chmod 644 "$work/not_a_tool"
  IFS=: read -ra path_dirs <<< "$PATH"
  for dir in "${path_dirs[@]}"; do
    for tool in $TOOLS; do
      [ -e "$dir/$tool" ] && mount --bind "$work/not_a_tool" "$dir/$tool"
    done
  done
  unset CUDA_HOME CUDA_PATH CUDACXX CUDAToolkit_ROOT
  for dir in "${path_dirs[@]}"; do
    for tool in $TOOLS; do
      if [ -x "$dir/$tool" ]; then echo "FAIL: $dir/$tool still on PATH"; exit 1; fi
    done
  done
  for d in /usr/local/cuda /usr/local/cuda-*; do
    if [ -e "$d" ] && [ -n "$(ls -A "$d")" ]; then echo "FAIL: $d still readable"; exit 1; fi
  done
  echo "toolkit hidden: no $TOOLS on PATH; /usr/local/cuda* empty; no CUDA_HOME"
  exec "$PY" -m pip wheel --no-deps -w "$work/dist" -C build-dir="$work/build" "$SRC"
fi

work=${1:-$(mktemp -d /tmp/jax_ub_wheel.XXXXXX)}
work=$(mkdir -p "$work" && cd "$work" && pwd)
case "$work/" in "$SRC"/*) echo "WORK_DIR must be outside the source tree"; exit 2;; esac
rm -rf "$work/dist" "$work/build" "$work/venv" "$work/suite"
echo "== wheel check in $work"
t0=$(date +%s)

# 1. Build with the toolkit hidden.
ns=""
for cmd in "unshare -m" "unshare -rm"; do
  if $cmd true 2> /dev/null && $cmd sh -c 'mount -t tmpfs none /mnt' 2> /dev/null; then
    ns=$cmd; break
  fi
done
if [ -n "$ns" ]; then
  echo "== 1. building the wheel, toolkit hidden ($ns)"
  build=($ns bash "$SRC/.ci/wheel_check.sh" --hidden-build "$work")
else
  echo "WARNING: no mount namespace here (unshare -m and unshare -rm both failed): the"
  echo "WARNING: toolkit cannot be hidden. Building with JAX_UB_CUDA_FROM_WHEELS=1 and no"
  echo "WARNING: toolkit on PATH: this checks the wheels' nvcc, not that the toolkit is unused."
  nopath=$(echo "$PATH" | tr : '\n' | while read -r d; do [ -e "$d/nvcc" ] || echo "$d"; done | paste -sd:)
  build=(env -u CUDA_HOME -u CUDA_PATH -u CUDACXX PATH="$nopath" JAX_UB_CUDA_FROM_WHEELS=1
    "$PY" -m pip wheel --no-deps -w "$work/dist" -C build-dir="$work/build" "$SRC")
fi
if ! "${build[@]}" > "$work/build.log" 2>&1; then
  tail -n 60 "$work/build.log"; echo "FAIL: the wheel did not build (log: $work/build.log)"; exit 1
fi
grep -E "^toolkit hidden" "$work/build.log" || true
wheel=$(ls "$work"/dist/jax_ub-*.whl)
t1=$(date +%s)
echo "built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB) in $((t1 - t0)) s"
echo "build used: $(grep -E '^CMAKE_CUDA_COMPILER:' "$work/build/CMakeCache.txt" || echo 'no CUDA compiler')"
grep -q '^CMAKE_CUDA_COMPILER:.*/cuda_from_wheels/bin/nvcc$' "$work/build/CMakeCache.txt" \
  || { echo "FAIL: the CUDA compiler was not the wheels' nvcc"; exit 1; }

# 2. The wheel has the CUDA extension, with code for the GPUs it targets.
echo "== 2. wheel contents"
mkdir -p "$work/unpacked"
"$PY" - "$wheel" "$work/unpacked" << 'EOF'
import fnmatch, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for pattern in ("jax_ub/_src/_host*.so", "jax_ub/_src/_cuda*.so"):
    found = fnmatch.filter(names, pattern)
    print(pattern, "->", found or "MISSING")
    if not found:
        sys.exit("FAIL: the wheel has no " + pattern)
    zipfile.ZipFile(sys.argv[1]).extract(found[0], sys.argv[2])
EOF
so=$(ls "$work"/unpacked/jax_ub/_src/_cuda*.so)
readelf -d "$so" | grep -E "NEEDED|RUNPATH|RPATH" | sed 's/^ *0x[0-9a-f]* *//'
# (grep -c, not -q: -q would stop reading, and readelf's SIGPIPE fail the pipe)
readelf -S "$so" | grep -c nv_fatbin > /dev/null || { echo "FAIL: no GPU code (.nv_fatbin) in $so"; exit 1; }
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2> /dev/null || true)
if [ -n "$cuobjdump" ]; then
  "$cuobjdump" --list-elf --list-ptx "$so" | sed -E 's/.*\.(sm_[0-9a-z]+)\.(cubin|ptx)$/\2 \1/' | sort | uniq -c
else
  echo "(no cuobjdump here: GPU code checked by its .nv_fatbin section only)"
fi

# 3. A fresh venv outside the source tree, jax and the test tools from the index.
echo "== 3. installing the wheel into $work/venv"
"$PY" -m venv "$work/venv"
if ! { "$work/venv/bin/python" -m pip install --upgrade pip \
       && "$work/venv/bin/python" -m pip install "$wheel[test]"; } > "$work/install.log" 2>&1; then
  tail -n 30 "$work/install.log"; echo "FAIL: the wheel did not install (log: $work/install.log)"; exit 1
fi
t2=$(date +%s)
echo "installed in $((t2 - t1)) s"

# 4. The CPU tests against the installed wheel. The README and examples/ go with tests/:
#    tests read them relative to tests/.
echo "== 4. CPU tests against the installed wheel"
mkdir -p "$work/suite"
cp -r "$SRC/tests" "$SRC/examples" "$SRC/README.md" "$work/suite/"
find "$work/suite" -name __pycache__ -prune -exec rm -rf {} +
cat > "$work/suite/pytest.ini" << 'EOF'
[pytest]
timeout = 300
EOF
cd "$work/suite"
loaded=$("$work/venv/bin/python" -c "import jax_ub; print(jax_ub.__file__)")
echo "jax_ub imported from $loaded"
case "$loaded" in "$work/venv/"*) ;; *) echo "FAIL: jax_ub is not the installed wheel's"; exit 1;; esac
timeout 300 "$work/venv/bin/python" -m jax_ub.info | grep -vE "^  [0-9]+: "
if [ "${QUICK:-0}" != 0 ]; then
  timeout 900 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_ops_forward.py
elif [ "${WHOLE:-0}" != 0 ]; then
  timeout 1500 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests
else  # the subset of every module that the JAX range runs too; the suite ran in CI already
  mapfile -t subset < <(grep -vE '^(#|$)' "$SRC/.ci/subset.txt")
  timeout 900 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "${subset[@]}"
fi
t3=$(date +%s)

# 5. The CUDA extension loads (links, and its symbols resolve) once cuBLASLt is there, as
#    on a GPU machine with jax[cuda13]; no GPU needed. After the tests, which ran without.
echo "== 5. the CUDA extension loads, with nvidia-cublas installed"
"$work/venv/bin/python" -m pip install nvidia-cublas > "$work/install_cublas.log" 2>&1 \
  || { tail -n 30 "$work/install_cublas.log"; echo "FAIL: nvidia-cublas did not install"; exit 1; }
timeout 300 "$work/venv/bin/python" -c "
from jax_ub._src.runtime import extension
cuda = extension.cuda_module()
assert cuda is not None, extension.cuda_import_error()
runtime, driver = cuda.cuda_versions()
print('CUDA extension loaded from', cuda.__file__, '(runtime', runtime, 'driver', driver, ')')"
t4=$(date +%s)
echo "== wheel check passed: build $((t1 - t0)) s, install $((t2 - t1)) s, tests $((t3 - t2)) s," \
  "load check $((t4 - t3)) s"
if [ "${KEEP:-0}" = 0 ]; then rm -rf "$work/venv" "$work/build" "$work/unpacked" "$work/suite"; fi
echo "wheel: $wheel"
