"""Starting the processes of a multi-process test (tests/_mp_worker.py and
tests/_mp_fault_worker.py) and reading what they report; shared by the CPU tier
(test_multiprocess.py, test_multiprocess_faults.py) and the GPU tier
(test_gpu_multiprocess.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from _op_cases import shm_names

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_mp_worker.py")
FAULT_WORKER = os.path.join(HERE, "_mp_fault_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    # Count without initializing CUDA in this process (JAX would take 75% of every GPU).
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _start(worker, args, nproc, env, timeout, hung) -> list[tuple[int, int, str]]:
    """Runs `worker args[0] i nproc port args[1:]` for i < nproc; (pid, exit code, output)
    of each, in order. Fails the test with `hung` if they are not all done in `timeout` s."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, worker, args[0], str(i), str(nproc), str(port), *args[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(nproc)
    ]
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(hung)
        out.append((p.pid, p.returncode, text))
    return out


def _env(gpu: bool, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_UB_TEST_GPU"] = "1" if gpu else "0"
    env.update(extra)
    return env


def _shared(share_gpu: bool) -> dict:
    return {"JAX_UB_TEST_SHARE_GPU": "1"} if share_gpu else {}


def run(
    scenario: str,
    nproc: int,
    ndev: int,
    timeout: float = 150,
    gpu: bool = False,
    share_gpu: bool = False,
    pids: bool = False,
) -> list[tuple]:
    """(exit code, output) of each of nproc processes of _mp_worker.py, ndev devices each
    (with `share_gpu`, one device each, all on GPU 0); with `pids`, (pid, exit code, output)."""
    out = _start(
        WORKER,
        [scenario, str(ndev)],
        nproc,
        _env(gpu, **_shared(share_gpu)),
        timeout,
        f"{scenario}: processes hung past {timeout} s",
    )
    return out if pids else [(code, text) for _, code, text in out]


def results(out):
    """The RESULT line of every process, each of which must have exited 0."""
    res = []
    for code, text in out:
        assert code == 0, text[-3000:]
        line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert line, text[-3000:]
        res.append(json.loads(line[0][len("RESULT ") :]))
    return res


def check_killed_peer(
    nproc: int, gpu: bool = False, share_gpu: bool = False, new_kernel: bool = False
) -> None:
    """nproc processes, one device each, one tp group across them. After 3 good ops the last
    process SIGKILLs itself (_mp_fault_worker.py "killed_peer"). The survivors must fail
    their next op within JAX_UB_TIMEOUT_S with an error naming the op and the dead rank (and
    the call numbers: expected #4, observed #3), fail the op after that at once (broken),
    finalize() at once (the dead process is not waited for), and then run both ops
    correctly on a mesh of the survivors. Nothing may be left in /dev/shm by any of them.
    (On GPUs the first failed op returns NaN and check_health() gives the error; with
    ``new_kernel``, a program never run before is dispatched right behind it.)"""
    timeout_s = 5
    out = _start(
        FAULT_WORKER,
        ["killed_peer_new_kernel" if new_kernel else "killed_peer"],
        nproc,
        _env(gpu, JAX_UB_TIMEOUT_S=str(timeout_s), **_shared(share_gpu)),
        120,
        "the processes hung (not ended 120 s after start)",
    )
    _, victim_code, victim_text = out[-1]
    assert victim_code == -signal.SIGKILL, victim_text[-2000:]
    assert "KILLING myself" in victim_text, victim_text[-2000:]
    dead = nproc - 1
    for rank, (_, code, text) in enumerate(out[:-1]):
        assert code == 0, f"process {rank}:\n{text[-3000:]}"
        (line,) = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[len("RESULT ") :])
        op = r["failed_op"]
        assert re.search(
            rf"{op}: rank {rank} \(group 0\) (timed out after 5\.0+ s waiting for rank {dead} "
            rf"to (deliver|free) .* for call #4 \(flag holds #3\)|stopped waiting for rank "
            rf"{dead}: rank \d failed: {op}: rank \d \(group 0\) timed out after 5\.0 s "
            rf"waiting for rank {dead})",
            r["failed_error"],
        ), r["failed_error"]
        assert 0.9 * timeout_s <= r["failed_seconds"] < timeout_s + 5, r["failed_seconds"]
        assert re.search(
            rf"communicator is broken by an earlier error .*rank {dead}.*call jax_ub.finalize",
            r["broken_error"],
        ), r["broken_error"]
        assert r["broken_seconds"] < 1.0, r["broken_seconds"]
        assert rf"process {dead} of this job, on this machine, exited)" in r["health_error"], r
        # The dead process is seen to have exited: no wait for its teardown, no warning.
        assert r["finalize_seconds"] < timeout_s / 2, r["finalize_seconds"]
        assert not any("did not finalize" in w for w in r["finalize_warnings"]), r
        assert len(r["rerun_errs"]) == 4 and all(e < 1e-5 for e in r["rerun_errs"]), r["rerun_errs"]
        assert r["comms"] == [nproc - 1], r  # the re-run's communicator: the survivors
    for pid, _, _ in out:
        assert shm_names(f"jax_ub_{pid}_") == [], f"process {pid} left /dev/shm entries"
