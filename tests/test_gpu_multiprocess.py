"""GPU tier, several processes: TP groups spanning processes on one host, their userbuffers
shared through CUDA IPC handles bootstrapped over jax.distributed. Same worker and checks
as the CPU multi-process tests. Skipped without at least 2 GPUs."""

from __future__ import annotations

import pytest
from test_multiprocess import _gpu_count, _results, _run

pytestmark = pytest.mark.gpu


GPUS = _gpu_count()


@pytest.mark.parametrize("nproc,ndev", [(2, 1), (4, 1), (2, 2)])
def test_tp_group_across_processes_on_gpus(nproc, ndev):
    if GPUS < nproc * ndev:
        pytest.skip(f"needs {nproc * ndev} GPUs, found {GPUS}")
    for r in _results(_run("tp_across_processes", nproc, ndev, timeout=300, gpu=True)):
        # f32 on both sides (the worker asks XLA for full-precision dots, not TF32).
        assert all(e < 1e-4 for e in r["errs"]), r["errs"]


def test_dp_across_processes_tp_inside_on_gpus():
    if GPUS < 4:
        pytest.skip("needs 4 GPUs")
    for r in _results(_run("dp_across_tp_inside", 2, 2, timeout=300, gpu=True)):
        assert all(e < 1e-4 for e in r["errs"]), r["errs"]
