"""Multi-process tier on CPU, faults: a process killed during bootstrap or in the middle of
a run, a process that never calls the op, processes that disagree on a shape or a setting.
Each fails the others clearly within the deadline instead of hanging. Each test starts real
processes (tests/_mp_worker.py, tests/_mp_fault_worker.py)."""

from __future__ import annotations

import json
import math
import re
import time

from _mp_launch import check_killed_peer, run
from _op_cases import shm_names


def test_peer_killed_during_bootstrap_fails_clearly():
    """A process dies after publishing its userbuffers and before mapping its peers': the
    other fails within the deadline (JAX_UB_TIMEOUT_S=8), naming it, instead of hanging.
    The dead process could not unlink its shared-memory names: the next bootstrap on this
    machine (here, its clean-up alone, or a test's beside it) removes them at once, its pid
    being gone."""
    from jax_ub._src.runtime import bootstrap

    t0 = time.time()
    out = run("killed_in_bootstrap", 2, 1, pids=True)
    elapsed = time.time() - t0
    # (A test beside this one that bootstraps may have removed some already. Without the
    # dead pid's rule they would stay 10 minutes: fresh names outlive this clean-up.)
    bootstrap.remove_stale_regions(timeout_s=8.0)
    assert [n for pid, _, _ in out for n in shm_names(f"jax_ub_{pid}_")] == []
    (_, code0, text0), (_, code1, _) = out
    assert code1 == 9, "the process meant to die did not"
    assert code0 != 0, text0[-2000:]
    assert "process 1 did not map this process's userbuffers" in text0, text0[-2000:]
    assert elapsed < 90


def test_peer_that_cannot_create_its_userbuffers_fails_the_others_at_once():
    """Process 1's communicator cannot be created (tests/_mp_worker.py simulates its GPU out
    of memory): process 0 fails at once with process 1's reason, well within the deadline
    (JAX_UB_TIMEOUT_S=8) it would otherwise wait out for process 1's handles."""
    (code0, text0), (code1, text1) = run("create_fails", 2, 1)
    assert code0 != 0 and code1 != 0, (text0[-2000:], text1[-2000:])
    assert "out of memory (simulated)" in text1, text1[-2000:]
    said = "process 1 failed to create its side of the communicator, so this one cannot either"
    assert said in text0 and "out of memory (simulated)" in text0, text0[-2000:]
    seconds = float(re.search(r"ERROR after ([0-9.]+)s", text0).group(1))
    assert seconds < 6, text0[-2000:]


def test_killed_process_fails_peers_within_deadline_then_recovers():
    """Three processes, one device each, one tp group across them (shared memory). After 3
    good ops the last process SIGKILLs itself (tests/_mp_fault_worker.py). The two survivors
    must fail their next op within JAX_UB_TIMEOUT_S=5 with an error naming the op and rank 2
    (and the call numbers: expected #4, observed #3), fail the op after that at once (broken),
    and after finalize() run both ops correctly on a mesh of the two survivors. Nothing may
    be left in /dev/shm by any of the three. (The checks: _mp_launch.check_killed_peer.)"""
    check_killed_peer(nproc=3)


def test_absent_peer_fails_with_timeout_not_hang():
    """The last process never calls the op: the others fail with an error naming it within
    the deadline (JAX_UB_TIMEOUT_S=8 in the worker). jax.distributed then takes the idle
    process down too, which is its documented reaction to a failed task."""
    check_absent_peer()


def check_absent_peer(**where) -> None:
    """The absent-peer scenario's outcome; ``where``: _mp_launch.run's gpu, share_gpu."""
    t0 = time.time()
    out = run("absent_peer", 3, 1, **where)
    for code, text in out[:-1]:
        assert code != 0, text[-2000:]
        assert "process 2" in text and "did not" in text, text[-2000:]
    assert time.time() - t0 < 120


def test_mismatched_shape_fails_clearly():
    check_mismatched_shape()


def check_mismatched_shape(**where) -> None:
    """Process 0 calls with 8 rows, process 1 with 16: every process fails naming both
    calls. On GPUs a device-side check finds it: the outputs are NaN (each process prints
    their sums) and check_health() raises the error."""
    out = run("mismatched_shape", 2, 1, **where)
    assert all(code != 0 for code, _ in out), [t[-500:] for _, t in out]
    text = "\n".join(t for _, t in out)
    assert "ranks disagree on the call" in text, text[-3000:]
    assert "rows=8" in text and "rows=16" in text, text[-3000:]
    for line in text.splitlines():
        if line.startswith("SUMS "):
            assert all(math.isnan(v) for v in json.loads(line[5:])), line


def test_mismatched_setting_fails_clearly():
    """One process sets reduce_scatter_fold_rows otherwise: every process fails when the
    communicator is created, naming the setting and both values, before any op can wait
    for a piece its peer will never send. (Process 0 hosts jax.distributed's service and
    leaves only after the others have printed their errors, or a loaded machine's slower
    process would be aborted, "Socket closed", before printing: _mp_worker.py's
    exit_after_peers_reported.)"""
    check_mismatched_setting()


def check_mismatched_setting(**where) -> None:
    out = run("mismatched_setting", 2, 1, **where)
    for code, text in out:
        assert code != 0, text[-2000:]
        assert "configured jax_ub differently: reduce_scatter_fold_rows=" in text, text[-2000:]
        assert re.search(r"=(0 there, -1|-1 there, 0) here", text), text[-2000:]
