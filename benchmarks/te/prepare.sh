#!/usr/bin/env bash
# Dev machine (network): get TransformerEngine 2.20.2 for JAX ready to carry to the GPU machine,
# which has no network, in calls of at most 64 MiB each (benchmarks/te/README.md).
#
#   bash benchmarks/te/prepare.sh [--no-build]
#
# Into .te/ (ignored through .git/info/exclude): the core wheel transformer-engine-cu13 split
# into parts of PART_MIB (56) MiB, .te/part.00, .te/part.01, ..., and .te/SHA256 (of the whole
# wheel); into .te/extra/: the jax extension's sdist, the transformer-engine metapackage (its
# dist-info is what `import transformer_engine.jax` checks for), pydantic and its needs for
# Python 3.12 (the core imports pydantic; the GPU image lacks it), nvidia-cudnn-frontend (headers,
# for building the extension there) and, unless --no-build, the extension prebuilt here for
# CPython 3.12 (build_ext_local.sh). Files already there are kept; TE_CACHE (default
# /tmp/te_dl) is looked in before downloading. Prints the parts and each device call's carry.
#
# Recompressing the core wheel does not pay: its 328 MiB libtransformer_engine.so is 272.5 MB
# deflated in the wheel, 260.7 MB with `xz -9`, 260.2 MB with `zstd -19 --long=27`; either way
# 5 parts of 56 MiB, so the parts are the wheel as PyPI serves it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VER=2.20.2
PART_MIB=${PART_MIB:-56}
CACHE=${TE_CACHE:-/tmp/te_dl}
CORE=transformer_engine_cu13-$VER-py3-none-manylinux_2_28_x86_64.whl
SDIST=transformer_engine_jax-$VER.tar.gz
META=transformer_engine-$VER-py3-none-any.whl
build=1
[ "${1:-}" = --no-build ] && build=0
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" .te/extra
grep -qxF '/.te/' "$exclude" 2>/dev/null || echo '/.te/' >> "$exclude"
PY312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# The file $2 in directory $1: from the cache if there, else by `pip download ${@:3}`.
fetch() {
  local dir=$1 name=$2; shift 2
  [ -s "$dir/$name" ] && return
  if [ -s "$CACHE/$name" ]; then
    ln -f "$CACHE/$name" "$dir/$name" 2>/dev/null || cp "$CACHE/$name" "$dir/$name"
  else
    python3 -m pip download -q --no-deps -d "$dir" "$@"
  fi
  [ -s "$dir/$name" ] || { echo "prepare: $name not fetched" >&2; exit 1; }
}
fetch .te "$CORE" "${PY312[@]}" "transformer-engine-cu13==$VER"
fetch .te/extra "$META" "transformer-engine==$VER"
if [ ! -s ".te/extra/$SDIST" ] && [ ! -s "$CACHE/$SDIST" ]; then
  # pip prepares an sdist's metadata even to download it, which runs TE's setup.py: that needs
  # JAX with its CUDA plugin, so do it in the build environment of build_ext_local.sh.
  bash benchmarks/te/build_ext_local.sh --venv-only
  CUDA_HOME=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64 "${TE_VENV:-/tmp/te_venv312}/bin/pip" \
    download -q --no-deps --no-build-isolation -d .te/extra "transformer-engine-jax==$VER"
fi
fetch .te/extra "$SDIST" "transformer-engine-jax==$VER"
if ! ls .te/extra/pydantic_core-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q -d .te/extra "${PY312[@]}" pydantic
fi
if ! ls .te/extra/nvidia_cudnn_frontend-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps -d .te/extra "${PY312[@]}" "nvidia-cudnn-frontend>=1.25"
fi
if [ $build = 1 ] && ! ls .te/extra/transformer_engine_jax-$VER-cp312-*.whl > /dev/null 2>&1; then
  bash benchmarks/te/build_ext_local.sh || echo "prepare: the local build failed; the device builds from the sdist"
fi

# The parts, rewritten only when the wheel changed.
sum=$(sha256sum ".te/$CORE" | cut -d' ' -f1)
if [ "$(cat .te/SHA256 2>/dev/null)" != "$sum  $CORE" ] || [ ! -e .te/part.00 ]; then
  rm -f .te/part.*
  split -b "${PART_MIB}M" -d -a 2 ".te/$CORE" .te/part.
  echo "$sum  $CORE" > .te/SHA256
fi
parts=(.te/part.*)
n=${#parts[@]}
echo "core wheel: $(stat -c %s ".te/$CORE") bytes, sha256 $sum; $n parts of at most $PART_MIB MiB:"
ls -l .te/part.* | awk '{print "  " $NF ": " $5 " bytes"}'
echo "extra (carried by the last call only): $(du -sb .te/extra | cut -f1) bytes"
ls -l .te/extra | awk 'NR > 1 {print "  " $NF ": " $5 " bytes"}'
echo "repo that travels with each call: about $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes"
echo "device calls (run's carry; command: bash benchmarks/te/device_setup.sh I $n):"
for i in $(seq 0 $((n - 1))); do
  carry="\".te/part.$(printf %02d "$i")\", \".te/SHA256\""
  [ "$i" = $((n - 1)) ] && carry="$carry, \".te/extra\""
  echo "  call $i: carry [$carry]"
done
