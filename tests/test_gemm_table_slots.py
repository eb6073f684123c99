"""benchmarks/gemm_table.py's timing (time_row) against a power-capped GPU's clock, simulated:
the host's clock is a fake one that each GEMM advances by its cost, 20% slower for 0.3 s of
every second (what one H100 at its 700 W cap did under load). With --slot-ms the
implementations take turns in short slots, so the dips catch some slots of each and the
median of its slots reads its true time; one loop a round instead lands whole in a dip or
not, and the ratios move with where the dip falls."""

import math
import os
import runpy
import time

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gemm_table.py")
DIP_EVERY_S, DIP_S, DIP_SLOWER = 1.0, 0.3, 1.20


@pytest.fixture(scope="module")
def time_row():
    return runpy.run_path(SCRIPT)["time_row"]


def _ratio(time_row, monkeypatch, phase_s, slot_s, costs_ms, rounds=3, seconds=0.2):
    """time_row's median ms of "b" over "a", on the simulated clock started at `phase_s`."""
    now = [phase_s]

    def clock():
        return now[0]

    def gemm(cost_ms):
        def step():
            in_dip = math.fmod(now[0], DIP_EVERY_S) >= DIP_EVERY_S - DIP_S
            now[0] += 1e-3 * cost_ms * (DIP_SLOWER if in_dip else 1.0)

        return step, lambda: None

    monkeypatch.setattr(time, "perf_counter", clock)
    impls = {name: gemm(ms) for name, ms in costs_ms.items()}
    times, _ = time_row(impls, seconds, rounds, 1, slot_s)
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    return med["b"] / med["a"]


def test_slots_read_the_true_ratio_wherever_the_dip_falls(time_row, monkeypatch):
    rng = np.random.default_rng()
    truth = rng.uniform(1.02, 1.06)
    a_ms = rng.uniform(0.2, 1.0)
    for phase in rng.uniform(0, DIP_EVERY_S, 12):
        ratio = _ratio(time_row, monkeypatch, phase, 0.02, {"a": a_ms, "b": truth * a_ms})
        assert ratio == pytest.approx(truth, rel=0.01), (phase, ratio, truth)


def test_one_loop_a_round_reads_the_dip_as_a_difference(time_row, monkeypatch):
    # Why the slots: the same GEMMs, one loop each a round, read up to 20% apart.
    errors = [
        abs(_ratio(time_row, monkeypatch, phase, 0.0, {"a": 0.5, "b": 0.5}) - 1)
        for phase in np.arange(0, DIP_EVERY_S, 0.1)
    ]
    assert max(errors) > 0.05, errors
