#!/usr/bin/env bash
# GPU machine (no network): put TransformerEngine 2.20.2 for JAX together from the parts that
# benchmarks/te/prepare.sh made, one part per device call, and install it into /tmp/te_site.
#
#   bash benchmarks/te/device_setup.sh PART_INDEX NPARTS
#
# Call i carries .te/part.NN (NN: i in two digits) and .te/SHA256; the last call .te/extra too.
# Each call appends its part to /tmp/te/wheel.part. The last one checks the whole wheel's
# sha256, installs the core wheel, the metapackage's dist-info and pydantic with pip --target
# /tmp/te_site, then the JAX extension: the wheel prebuilt by prepare.sh where it imports, else
# built here from the sdist against this machine's JAX, CUDA, cuDNN and NCCL. Prints one of
#   TE_PART i/n        part i appended (or already there); go on with the next call
#   TE_COLD            exit 3: /tmp/te lacks the parts of earlier calls (the machine went cold
#                      between calls): start again at part 0
#   TE_SHA_MISMATCH    exit 4: the joined wheel is not the one prepare.sh split: start again
#   TE_FAILED ...      exit 5: install or build failed ($OUT/te_setup.log says why)
#   TE_READY           PYTHONPATH=/tmp/te_site python3 -c 'import transformer_engine.jax' works
# A machine that is already TE_READY answers TE_READY at once, whatever the part.
# Env: PYTHON (python3), TE_BUILD=1 (build the extension here even with a prebuilt one),
# TE_BUILD_S (the build's time limit, 900 s), MAX_JOBS (16 compiles at once).
set -u
[ $# -eq 2 ] || { echo "usage: $0 PART_INDEX NPARTS"; exit 2; }
i=$((10#$1)) n=$((10#$2))
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/te_setup.log
ST=${TE_STAGE:-/tmp/te}
SITE=${TE_SITE:-/tmp/te_site}
PY=${PYTHON:-python3}
VER=2.20.2
export PYTHONNOUSERSITE=1 UB_SKIPMC=1 NCCL_NVLS_ENABLE=0
# The NCCL that JAX uses (pip nvidia-nccl-cu13): the extension links libnccl.so.2.
NCCL_LIB=$($PY -c "import importlib.metadata as m; print(m.distribution('nvidia-nccl-cu13').locate_file('nvidia/nccl/lib'))" 2> /dev/null)
# And JAX's pip cuDNN: TE would otherwise load a system cuDNN's sub-libraries beside it
# (undefined symbols); compare.py sets the same for its processes.
CUDNN_ROOT=$($PY -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2> /dev/null)
[ -n "$CUDNN_ROOT" ] && export CUDNN_PATH=$CUDNN_ROOT CUDNN_HOME=$CUDNN_ROOT
export LD_LIBRARY_PATH=${CUDNN_ROOT:+$CUDNN_ROOT/lib:}${NCCL_LIB:+$NCCL_LIB:}${LD_LIBRARY_PATH:-}

imports() {
  PYTHONPATH=$SITE timeout 300 $PY -c 'import transformer_engine.jax, transformer_engine_jax as e
from importlib.metadata import version
print("transformer_engine.jax imports:", version("transformer_engine_cu13"), e.__file__)' >> "$LOG" 2>&1
}
if [ -e "$SITE/.te_ready" ] && imports; then
  echo "TE_READY (installed by an earlier call)"
  exit 0
fi

part=.te/part.$(printf %02d "$i")
[ -f "$part" ] || { echo "TE_FAILED: $part is missing: name it in carry"; exit 5; }
if [ "$i" = 0 ]; then
  rm -rf "$ST" "$SITE"
  mkdir -p "$ST"
  echo 0 > "$ST/next"
fi
next=$(cat "$ST/next" 2> /dev/null || echo none)
if [ "$next" = none ] || [ "$next" -lt "$i" ]; then
  held="no parts"
  [ "$next" != none ] && [ "$next" -gt 0 ] && held="parts 0..$((next - 1)) only"
  echo "TE_COLD: this call carries part $i of $n, but $ST holds $held (the machine was" \
    "given back since): start again with part 0"
  exit 3
fi
if [ "$next" = "$i" ]; then
  cat "$part" >> "$ST/wheel.part" && echo $((i + 1)) > "$ST/next"
fi
echo "TE_PART $((i + 1))/$n ($(cat "$ST/wheel.part" "$ST"/*.whl 2> /dev/null | wc -c) bytes so far)"
[ $((i + 1)) -lt "$n" ] && exit 0

# The last part: check, install, build.
{
  echo "== $(date -u +%FT%TZ) device_setup $i $n"
  nvidia-smi --query-gpu=name --format=csv,noheader
  $PY -c 'import sys, jax, jaxlib; print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__)'
} >> "$LOG" 2>&1
read -r want name < .te/SHA256
if [ ! -f "$ST/$name" ]; then # else checked by an earlier try of this call
  got=$(sha256sum "$ST/wheel.part" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    echo "TE_SHA_MISMATCH: joined $(stat -c %s "$ST/wheel.part") bytes, sha256 $got, want" \
      "$want: start again with part 0"
    rm -rf "$ST"
    exit 4
  fi
  mv "$ST/wheel.part" "$ST/$name"
fi
tag=$($PY -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheels=("$ST/$name" .te/extra/transformer_engine-$VER-py3-none-any.whl)
for w in .te/extra/*.whl; do
  case $(basename "$w") in pydantic* | annotated_types* | typing_*) wheels+=("$w") ;; esac
done
prebuilt=$(ls .te/extra/transformer_engine_jax-$VER-$tag-*.whl 2> /dev/null | head -1)
[ "${TE_BUILD:-0}" = 1 ] && prebuilt= # build the extension here even where one was prebuilt
[ -n "$prebuilt" ] && wheels+=("$prebuilt")
echo "installing ${wheels[*]}" >> "$LOG"
timeout 300 $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" >> "$LOG" 2>&1 \
  || { echo "TE_FAILED: pip install (see te_setup.log)"; tail -5 "$LOG"; exit 5; }

if [ -n "$prebuilt" ] && imports; then
  echo "extension: prebuilt $(basename "$prebuilt")" | tee -a "$LOG"
else
  [ -n "$prebuilt" ] && { echo "the prebuilt extension does not import: building it here" | tee -a "$LOG"; tail -3 "$LOG"; }
  rm -rf "$SITE"/transformer_engine_jax* "$SITE"/transformer_engine/wheel_lib/transformer_engine_jax*
  t0=$(date +%s)
  # Headers: the CUDA toolkit's where nvcc lives, plus NVIDIA's pip wheels (cuDNN, cuBLAS, NVRTC).
  inc=$($PY -c 'import glob, os, sysconfig
print(":".join(sorted(glob.glob(os.path.join(sysconfig.get_path("purelib"), "nvidia", "*", "include")))))')
  rm -rf "$ST/build" "$ST/bdeps" "$ST/wheel"
  mkdir -p "$ST/build"
  tar xzf .te/extra/transformer_engine_jax-$VER.tar.gz -C "$ST/build"
  src=$ST/build/transformer_engine_jax-$VER
  # setuptools compiles an extension's files one by one: let pybind11 compile MAX_JOBS at once.
  sed -i 's/^import setuptools$/import setuptools\nfrom pybind11.setup_helpers import ParallelCompile\nParallelCompile("MAX_JOBS").install()/' "$src/setup.py"
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$ST/bdeps" .te/extra/nvidia_cudnn_frontend-*.whl >> "$LOG" 2>&1
  nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -d /usr/local/cuda/include ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  echo "building: nvcc $nvcc_bin, CUDA_HOME ${CUDA_HOME:-unset}, CPATH $inc" >> "$LOG"
  # A wheel, unpacked into $SITE: pip --target would skip transformer_engine/, already there.
  (cd "$src" && PYTHONPATH=$ST/bdeps CPATH=$inc${CPATH:+:$CPATH} NVTE_FRAMEWORK=jax NVTE_CUDA_ARCHS=90 \
    NVTE_NO_LOCAL_VERSION=1 MAX_JOBS=${MAX_JOBS:-16} timeout "${TE_BUILD_S:-900}" $PY -m pip wheel -v \
    --no-index --no-deps --no-build-isolation -w "$ST/wheel" . >> "$LOG" 2>&1) \
    && $PY -m zipfile -e "$ST"/wheel/transformer_engine_jax-$VER-*.whl "$SITE" \
    || { echo "TE_FAILED: building the extension (see te_setup.log)"; grep -E "error|Error" "$LOG" | tail -8; exit 5; }
  echo "extension: built here in $(($(date +%s) - t0)) s" | tee -a "$LOG"
  imports || { echo "TE_FAILED: import transformer_engine.jax"; tail -8 "$LOG"; exit 5; }
fi
touch "$SITE/.te_ready"
grep "imports:" "$LOG" | tail -1
echo TE_READY
