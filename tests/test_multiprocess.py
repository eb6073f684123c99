"""Multi-process tier on CPU: processes joined by jax.distributed, one TP group spanning
them, the host protocol running over POSIX shared memory bootstrapped through the
key-value store. Each test starts real processes (tests/_mp_worker.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_mp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    # Count without initializing CUDA in this process (JAX would take 75% of every GPU).
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _run(
    scenario: str, nproc: int, ndev: int, timeout: float = 150, gpu: bool = False
) -> list[tuple[int, str]]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_UB_TEST_GPU"] = "1" if gpu else "0"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(i), str(nproc), str(port), str(ndev)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(nproc)
    ]
    out = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: processes hung past {timeout} s")
        out.append((p.returncode, text))
    return out


def _results(out):
    res = []
    for code, text in out:
        assert code == 0, text[-3000:]
        line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert line, text[-3000:]
        res.append(json.loads(line[0][len("RESULT ") :]))
    return res


@pytest.mark.parametrize("nproc,ndev", [(2, 1), (4, 1), (2, 2)])
def test_tp_group_across_processes(nproc, ndev):
    for r in _results(_run("tp_across_processes", nproc, ndev)):
        assert len(r["errs"]) == 5
        assert all(e < 1e-5 for e in r["errs"]), r["errs"]


def test_dp_across_processes_tp_inside():
    for r in _results(_run("dp_across_tp_inside", 2, 2)):
        assert all(e < 1e-5 for e in r["errs"]), r["errs"]


def test_peer_killed_during_bootstrap_fails_clearly():
    """A process dies after publishing its userbuffers and before mapping its peers': the
    other fails within the deadline (JAX_UB_TIMEOUT_S=8), naming it, instead of hanging."""
    shm = "/dev/shm"
    before = set(os.listdir(shm)) if os.path.isdir(shm) else set()
    t0 = time.time()
    out = _run("killed_in_bootstrap", 2, 1)
    elapsed = time.time() - t0
    # The dead process could not unlink its shared-memory names: remove them here.
    for name in (set(os.listdir(shm)) if os.path.isdir(shm) else set()) - before:
        if name.startswith("jax_ub_"):
            os.unlink(os.path.join(shm, name))
    (code0, text0), (code1, _) = out
    assert code1 == 9, "the process meant to die did not"
    assert code0 != 0, text0[-2000:]
    assert "process 1 did not map this process's userbuffers" in text0, text0[-2000:]
    assert elapsed < 90


def test_group_across_hosts_falls_back_or_fails_clearly():
    """Each process claims its own host (JAX_UB_HOST_ID), so the tp group cannot share
    memory: impl="auto" gives XLA's results with exactly one warning naming the hosts,
    impl="ub" raises naming the devices and hosts. No process hangs."""
    for r in _results(_run("different_hosts", 2, 2)):
        res = r["errs"]
        assert all(e < 1e-5 for e in res["errs"]), res["errs"]
        assert len(res["fallback_warnings"]) == 1, res["fallback_warnings"]
        for text in (res["fallback_warnings"][0], res["ub_error"]):
            assert "must be on one host" in text, text
            # Global device ids: CPU devices of process 1 are numbered from 2048.
            assert re.search(
                r"devices \[\d+, \d+\] on host 'host0'; devices \[\d+, \d+\] "
                r"on host 'host1'",
                text,
            ), text
        assert res["ub_error"].startswith("ValueError: all_gather_matmul: impl='ub' cannot"), res


def test_mismatched_shape_fails_clearly():
    out = _run("mismatched_shape", 2, 1)
    assert all(code != 0 for code, _ in out), [t[-500:] for _, t in out]
    text = "\n".join(t for _, t in out)
    assert "ranks disagree on the call" in text, text[-3000:]
    assert "rows=8" in text and "rows=16" in text, text[-3000:]


def test_mismatched_setting_fails_clearly():
    """One process sets reduce_scatter_fold_rows otherwise: every process fails when the
    communicator is created, naming the setting and both values, before any op can wait
    for a piece its peer will never send."""
    out = _run("mismatched_setting", 2, 1)
    for code, text in out:
        assert code != 0, text[-2000:]
        assert "configured jax_ub differently: reduce_scatter_fold_rows=" in text, text[-2000:]
        assert re.search(r"=(0 there, -1|-1 there, 0) here", text), text[-2000:]


def test_absent_peer_fails_with_timeout_not_hang():
    """The last process never calls the op: the others fail with an error naming it within
    the deadline (JAX_UB_TIMEOUT_S=8 in the worker). jax.distributed then takes the idle
    process down too, which is its documented reaction to a failed task."""
    t0 = time.time()
    out = _run("absent_peer", 3, 1)
    for code, text in out[:-1]:
        assert code != 0, text[-2000:]
        assert "process 2" in text and "did not" in text, text[-2000:]
    assert time.time() - t0 < 120
