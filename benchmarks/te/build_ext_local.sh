#!/usr/bin/env bash
# Dev machine (network, no GPU): build TransformerEngine's JAX extension (transformer_engine_jax
# 2.20.2, from .te/extra's sdist) for the GPU machine's Python 3.12, JAX 0.11.2 and CUDA 13,
# into .te/extra/transformer_engine_jax-2.20.2-cp312-cp312-linux_x86_64.whl (about 1 MB), so
# that device_setup.sh installs it instead of compiling there. Called by prepare.sh.
#
#   bash benchmarks/te/build_ext_local.sh [--venv-only]
#
# The extension is C++ only (pybind11, XLA FFI; no CUDA kernels, so no GPU and no arch list
# matter) and links libnccl.so.2 by soname with NCCL symbols every NCCL 2 has. Its setup.py
# reads the CUDA major version from JAX's CUDA plugin, so the venv holds jax-cuda13-plugin
# (no deps; cudart from this machine's CUDA toolkit). Headers this machine's CUDA toolkit lacks
# (cuDNN, cuBLAS, NVRTC) come from NVIDIA's wheels, their include/ alone, into TE_HEADERS.
# Env: PYTHON312 (a python3.12), TE_VENV (/tmp/te_venv312), TE_HEADERS (/tmp/te_headers),
# CUDA_HOME (/usr/local/cuda), MAX_JOBS (nproc). Took 419 s on 2 cores.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VER=2.20.2
JAX=0.11.2
VENV=${TE_VENV:-/tmp/te_venv312}
HDR=${TE_HEADERS:-/tmp/te_headers}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ ! -x "$VENV/bin/python" ]; then
  py=${PYTHON312:-$(command -v python3.12 || echo /root/.pyenv/versions/3.12.1/bin/python3.12)}
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==$JAX" "jaxlib==$JAX" pybind11 setuptools wheel packaging \
    "nvidia-cudnn-frontend>=1.25" nvidia-nccl-cu13
  "$VENV/bin/pip" install -q --no-deps "jax-cuda13-plugin==$JAX"
fi
[ "${1:-}" = --venv-only ] && exit 0

mkdir -p "$HDR"
for pkg in nvidia-cudnn-cu13 nvidia-cublas nvidia-cuda-nvrtc; do
  [ -e "$HDR/$pkg.done" ] && continue
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps -d "$tmp" "$pkg"
  (cd "$HDR" && unzip -q -o "$tmp"/*.whl '*/include/*')
  rm -rf "$tmp"
  touch "$HDR/$pkg.done"
done
inc=$(find "$HDR" -mindepth 3 -maxdepth 3 -type d -name include | sort | paste -sd:)

src=$(mktemp -d)
tar xzf ".te/extra/transformer_engine_jax-$VER.tar.gz" -C "$src"
# setuptools compiles an extension's files one by one: let pybind11 compile MAX_JOBS at once.
sed -i 's/^import setuptools$/import setuptools\nfrom pybind11.setup_helpers import ParallelCompile\nParallelCompile("MAX_JOBS").install()/' \
  "$src/transformer_engine_jax-$VER/setup.py"
t0=$(date +%s)
(cd "$src/transformer_engine_jax-$VER" && CPATH=$inc NVTE_FRAMEWORK=jax NVTE_CUDA_ARCHS=90 \
  NVTE_NO_LOCAL_VERSION=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w "$src/wheel" .)
cp "$src"/wheel/transformer_engine_jax-$VER-cp312-*.whl .te/extra/
rm -rf "$src"
echo "built $(ls .te/extra/transformer_engine_jax-$VER-cp312-*.whl) in $(($(date +%s) - t0)) s"
