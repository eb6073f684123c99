"""benchmarks/tools/tuning_trace.py on trace lines written as src/cuda/gemm/tune.cc writes them
(JAX_UB_TRACE=1): a long GEMM's tuning per shape, with each candidate's score and rounds, then
the kernel line of the same GPU that names the shape and the tile kept."""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
tuning_trace = pytest.importorskip("tuning_trace")


def _tuning(gpu, seconds, rounds, tail):
    """One tuning line: `rounds` maps (description, index, tile) to (score, times a round)."""
    entries = []
    for (desc, index, tile), (score, ms) in rounds.items():
        per_round = " ".join(f"{t:.4f}@{r % 2 + 1}" for r, t in enumerate(ms))
        entries.append(f"{desc}{index} tile {tile}: {np.median(ms):.4f} x{score:.3f} [{per_round}]")
    return (
        f"jax_ub trace: GPU {gpu} tuning, ms a run (sustained blocks, {seconds:.2f} s): "
        + ", ".join(entries)
        + tail
    )


def _kernel(gpu, m, k, n, tile):
    return (
        f"jax_ub trace: GPU {gpu} GEMM m={m} k={k} n={n}: column description, algo 66 tile {tile} "
        "stages 35, 0.100 ms"
    )


def test_each_tuning_gets_its_shape_kept_tile_scores_and_steady_rounds():
    rng = np.random.default_rng()
    base = rng.uniform(0.05, 2.0)
    slow = list(base * 1.10 * rng.uniform(0.99, 1.01, 8))  # the first pick, 10% behind
    fast = list(base * rng.uniform(0.99, 1.01, 8))
    lines = [
        # GPU 1's tuning comes between GPU 0's and GPU 0's kernel line: each pairs by GPU
        _tuning(
            0,
            1.0,
            {("col", 0, 24): (1.05, slow), ("col", 5, 29): (0.95, fast)},
            "; 6 steady rounds; the first pick x1.100 (rounds 1.2% apart)",
        ),
        _tuning(
            1,
            0.9,
            {("col", 0, 24): (0.99, fast), ("col", 1, 23): (1.01, slow)},
            "; 7 steady rounds",
        ),
        "jax_ub trace: GPU 0 all_gather_matmul call #1 begins",
        _kernel(0, 8192, 512, 4096, 29),
        _kernel(1, 8192, 4096, 768, 24),
        _tuning(
            0,
            1.1,
            {("col", 0, 24): (1.01, slow), ("col", 2, 20): (0.99, fast)},
            "; 5 steady rounds; the first pick x1.020 (rounds 0.8% apart)"
            "; cuBLASLt's first pick holds",
        ),
        _kernel(0, 8192, 4096, 3584, 24),
    ]
    found = tuning_trace.tunings("\n".join(lines))
    assert [(t["shape"], t["kept_tile"], t["steady"], t["held"]) for t in found] == [
        ("8192x512x4096", 29, "6", False),
        ("8192x4096x768", 24, "7", False),
        ("8192x4096x3584", 24, "5", True),
    ]
    score, ms = found[0]["rounds"]["col5 tile 29"]
    assert score == pytest.approx(0.95) and ms == pytest.approx(fast, rel=1e-3)
    first = tuning_trace.report(found[0])
    assert first.startswith("8192x512x4096: kept tile 29, fastest by score col5 tile 29")
    assert "(6 steady rounds), by means col5 tile 29" in first
    lead = float(first.split("the first pick ")[1].split("x")[0])
    assert lead == pytest.approx(np.mean(slow) / np.mean(fast), rel=1e-3)
    assert "(held)" in tuning_trace.report(found[2])
