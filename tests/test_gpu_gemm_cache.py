"""GPU tier: the kernel choice file (``jax_ub.configure(gemm_cache=...)``, env
``JAX_UB_GEMM_CACHE``). A process that finds its GEMMs' choices in the file runs those
kernels from the first call, with no tuning and no trials, and so computes the same bits as
the process that chose them; damaged lines are skipped. Each process here is a fresh one
(the file is read when a shape first runs); skipped without a GPU (counted with
nvidia-smi: this process must not initialize CUDA)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _mp_launch import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.own_processes]

if gpu_count() < 1:
    pytest.skip("needs a GPU", allow_module_level=True)

WORKER = str(Path(__file__).with_name("_gemm_cache_worker.py"))
CHOSEN = re.compile(r"GEMM m=(\d+) k=(\d+) n=(\d+) in the op, .* keeping candidate")
FROM_FILE = re.compile(r"GEMM m=(\d+) k=(\d+) n=(\d+): \w+ description, tile \d+, from the choice")
TUNED = re.compile(r"GEMM m=(\d+) k=(\d+) n=(\d+): \w+ description, algo")
TIMED_IN = re.compile(r"tuning, ms a run \((sustained blocks|bursts), [0-9.]+ s\)")
TUNING_S = re.compile(r"tuning, ms a run \(sustained blocks, ([0-9.]+) s\)")
# a sustained tuning's line: "... s): col1 tile 24: 1.6205 x0.995 [1.6201@1 ...], col2 tile 23: ..."
SUSTAINED_TIMES = re.compile(r"tuning, ms a run \(sustained blocks, [0-9.]+ s\): (.*)")


def _run(cache: Path | None, out: Path, *worker_args: str, **env_vars: str) -> str:
    """A worker process; cache None: no JAX_UB_GEMM_CACHE (the default, "auto")."""
    env = dict(os.environ, JAX_UB_TRACE="1", CUDA_VISIBLE_DEVICES="0")
    env.pop("JAX_UB_GEMM_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(env_vars)
    if cache is not None:
        env["JAX_UB_GEMM_CACHE"] = str(cache)
    p = subprocess.run(
        [sys.executable, WORKER, str(out), *worker_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stderr


def _shapes(pattern: re.Pattern, log: str) -> set[tuple[int, ...]]:
    return {tuple(int(v) for v in m.groups()) for m in pattern.finditer(log)}


def _timed_counts(log: str) -> list[int]:
    """How many candidates each sustained tuning timed."""
    return [len(m.group(1).split(", ")) for m in SUSTAINED_TIMES.finditer(log)]


def _lines(cache: Path) -> list[str]:
    return cache.read_text().splitlines()


def test_second_process_runs_the_first_ones_kernels(tmp_path):
    cache = tmp_path / "choices.txt"
    first = _run(cache, tmp_path / "first.npz")
    tuned = _shapes(TUNED, first)
    assert tuned and _shapes(CHOSEN, first) <= tuned, first[-3000:]
    assert set(TIMED_IN.findall(first)) == {"bursts"}, first[-3000:]  # short GEMMs
    assert not _shapes(FROM_FILE, first)
    lines = _lines(cache)
    assert len(lines) == len(tuned), lines  # one choice per shape

    second = _run(cache, tmp_path / "second.npz")
    assert _shapes(FROM_FILE, second) == tuned, second[-3000:]
    assert not _shapes(TUNED, second) and not _shapes(CHOSEN, second)
    assert _lines(cache) == lines  # nothing new to record
    a, b = np.load(tmp_path / "first.npz"), np.load(tmp_path / "second.npz")
    for name in ("h", "y"):
        assert np.isfinite(a[name]).all()
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_by_default_the_choices_live_in_jax_compilation_cache(tmp_path):
    """With JAX's persistent compilation cache on (JAX_COMPILATION_CACHE_DIR) and no file
    named, the choices go to jax_ub_gemm_choices.txt in its folder: a restart runs them from
    its first call, as it runs XLA's cached programs. Without the cache, nothing is kept."""
    folder = tmp_path / "xla_cache"
    first = _run(None, tmp_path / "first.npz", JAX_COMPILATION_CACHE_DIR=str(folder))
    tuned = _shapes(TUNED, first)
    cache = folder / "jax_ub_gemm_choices.txt"
    assert tuned and len(_lines(cache)) == len(tuned), first[-3000:]
    second = _run(None, tmp_path / "second.npz", JAX_COMPILATION_CACHE_DIR=str(folder))
    assert _shapes(FROM_FILE, second) == tuned and not _shapes(TUNED, second), second[-3000:]
    plain = _run(None, tmp_path / "plain.npz")
    assert _shapes(TUNED, plain) == tuned and not _shapes(FROM_FILE, plain), plain[-3000:]


def test_damaged_lines_are_skipped(tmp_path):
    cache = tmp_path / "choices.txt"
    _run(cache, tmp_path / "first.npz")
    good = _lines(cache)
    # The first line's key with a kernel cuBLASLt's list does not have, lines that do not
    # parse, noise.
    key = good[0].split(" | ")[0]
    damaged = [f"{key} | 0 999", f"{key} | 1 ab", "not a choice", f"{key} | 0 1 2"]
    cache.write_text("\n".join(damaged + good[1:]) + "\n")
    log = _run(cache, tmp_path / "again.npz")
    refused = re.compile(r"GEMM m=(\d+) k=(\d+) n=(\d+): the choice file's kernel is refused")
    assert len(_shapes(refused, log)) == 1, log[-3000:]
    assert _shapes(TUNED, log) == _shapes(refused, log)  # that shape was tuned again
    assert len(_shapes(FROM_FILE, log)) == len(good) - 1
    assert len(_lines(cache)) == len(damaged) + len(good)  # its new choice appended
    a, b = np.load(tmp_path / "first.npz"), np.load(tmp_path / "again.npz")
    for name in ("h", "y"):
        rel = np.linalg.norm(a[name] - b[name]) / np.linalg.norm(a[name])
        assert np.isfinite(b[name]).all() and rel < 1e-2, (name, rel)


def test_a_long_gemm_is_timed_in_sustained_blocks_and_kept_at_once(tmp_path):
    """GEMMs of a fraction of a millisecond (4096 x 2048 x 8192 and, reduce-scattering,
    4096 x 8192 x 2048 bf16: ~0.2 ms each on an H200) are tuned in blocks of runs long enough
    for the clock to follow the candidate's own power, and the pick is final: no trials
    (they time single calls), so the choice file holds both shapes after the first call.
    The values still equal the product's."""
    cache = tmp_path / "choices.txt"
    log = _run(cache, tmp_path / "long.npz", "4096,2048,8192", "1")
    assert "sustained blocks" in TIMED_IN.findall(log), log[-3000:]
    assert "bursts" not in TIMED_IN.findall(log), log[-3000:]
    # the budget (2 s a shape) holds: no block starts once it is spent
    assert all(float(s) < 2.5 for s in TUNING_S.findall(log)), log[-3000:]
    # blocks time the ranking's fastest 4 (kSustainKept) and cuBLAS's pick, not every candidate
    assert all(1 <= n <= 5 for n in _timed_counts(log)), log[-3000:]
    assert not _shapes(CHOSEN, log), log[-3000:]  # no trial decided anything
    assert len(_lines(cache)) == len(_shapes(TUNED, log)) == 2, log[-3000:]
    got = np.load(tmp_path / "long.npz")
    for name, want in (("h", got["x"] @ got["w"]), ("y", got["h"] @ got["w"].T)):
        assert np.isfinite(got[name]).all(), name
        err = np.abs(got[name] - want).max() / np.abs(want).max()
        assert err < 1e-2, (name, err)
