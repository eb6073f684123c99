#!/usr/bin/env bash
# The JAX range that pyproject.toml admits, tested at both ends. The main suite runs on the
# JAX pip resolves for CI's Python; this runs a fast subset of the CPU tests, touching every
# module, in a fresh venv on
#   oldest: exactly jax==X and jaxlib==X, X the lower bound (its `jax>=X`), with the flax and
#           optax releases pinned below (flax drops support for old JAX releases);
#   newest: the newest jax, flax and optax on PyPI, under the newest Python 3.12+ found here
#           (newer JAX releases need it); skipped, saying so, where there is none.
# jax_ub is installed editable there, its host extension built against that jaxlib (XLA
# refuses extensions built against a newer FFI API than its own) in a build folder of its
# own, so that the main install's is untouched; no CUDA extension (CPU tests only).
# Usage: bash .ci/jax_range.sh [oldest|newest] [WORK_DIR]   (default oldest, and a new
# folder under /tmp; KEEP=1 keeps it). PYTHON picks the interpreter.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-oldest}
[ "$MODE" = oldest ] || [ "$MODE" = newest ] || { echo "usage: $0 [oldest|newest] [WORK_DIR]"; exit 2; }
PY=${PYTHON:-python3}
if [ "$MODE" = newest ] && [ -z "${PYTHON:-}" ]; then
  PY=
  for v in 3.14 3.13 3.12; do # a pyenv shim may exist without its version selected: run it
    for cand in "python$v" /root/.pyenv/versions/"$v"*/bin/python"$v"; do
      if command -v "$cand" > /dev/null 2>&1 && "$cand" -c "import venv" 2> /dev/null; then
        PY=$cand
        break 2
      fi
    done
  done
  [ -n "$PY" ] || { echo "== newest JAX: SKIPPED: no Python 3.12+ here"; exit 0; }
fi
# Releases that install beside the oldest JAX; raise them with the lower bound.
FLAX=0.12.6
OPTAX=0.2.8

oldest=$(sed -nE 's/^dependencies = .*"jax>=([0-9.]+)".*/\1/p' "$SRC/pyproject.toml")
[ -n "$oldest" ] || { echo "FAIL: no jax>= bound in pyproject.toml's dependencies"; exit 1; }
# The bound is written in three places; they must agree.
grep -qF "\"jax[cuda13]>=$oldest\"" "$SRC/pyproject.toml" \
  || { echo "FAIL: the cuda13 extra's jax bound is not >=$oldest"; exit 1; }
grep -qF "_MIN_JAXLIB = \"$oldest\"" "$SRC/_build_backend/backend.py" \
  || { echo "FAIL: _build_backend/backend.py's _MIN_JAXLIB is not $oldest"; exit 1; }

work=${2:-$(mktemp -d "/tmp/jax_ub_$MODE.XXXXXX")}
work=$(mkdir -p "$work" && cd "$work" && pwd)
case "$work/" in "$SRC"/*) echo "WORK_DIR must be outside the source tree"; exit 2;; esac
rm -rf "$work/venv" "$work/build"
echo "== $MODE JAX (the lower bound: $oldest), $("$PY" --version), in $work"
t0=$(date +%s)

"$PY" -m venv "$work/venv"
vpy=$work/venv/bin/python
# Build requirements too: the build below runs without isolation, against this jaxlib.
if [ "$MODE" = oldest ]; then
  pins=("jax[cpu]==$oldest" "jaxlib==$oldest" "flax==$FLAX" "optax==$OPTAX")
else
  pins=("jax[cpu]" jaxlib flax optax)
fi
if ! { "$vpy" -m pip install --upgrade pip \
       && "$vpy" -m pip install "${pins[@]}" numpy pytest pytest-timeout \
            "scikit-build-core>=0.10" "nanobind>=2.4" cmake ninja; } > "$work/install.log" 2>&1; then
  tail -n 30 "$work/install.log"; echo "FAIL: JAX ($MODE) did not install (log: $work/install.log)"; exit 1
fi
t1=$(date +%s)
if ! JAX_UB_DISABLE_CUDA=1 "$vpy" -m pip install --no-deps --no-build-isolation \
     -C build-dir="$work/build" -e "$SRC" > "$work/build.log" 2>&1; then
  tail -n 40 "$work/build.log"; echo "FAIL: jax_ub did not build against this jaxlib"; exit 1
fi
t2=$(date +%s)
"$vpy" -m jax_ub.info | grep -E "^(jax|jaxlib|flax|extensions)"
if [ "$MODE" = oldest ]; then
  "$vpy" -c "import jax; assert jax.__version__ == '$oldest', jax.__version__"
fi

# One or a few tests of every module (.ci/subset.txt says which).
cd "$SRC"
mapfile -t subset < <(grep -vE '^(#|$)' "$SRC/.ci/subset.txt")
timeout 900 "$vpy" -m pytest -q -p no:cacheprovider "${subset[@]}"
t3=$(date +%s)
echo "== $MODE JAX ($("$vpy" -c 'import jax; print(jax.__version__)')) passed: install $((t1 - t0)) s, build $((t2 - t1)) s," \
  "tests $((t3 - t2)) s"
if [ "${KEEP:-0}" = 0 ]; then rm -rf "$work/venv" "$work/build"; fi
