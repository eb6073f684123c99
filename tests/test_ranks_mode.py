"""The N-ranks mode (``pytest --ranks N``, tests/_ranks.py) on CPU devices: two processes,
each one rank of a jax.distributed group, run tests/_ranks_cases.py; the launcher shows
rank 0's output, reports a failed rank's log, and exits with the worst rank's status."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import _ranks_gpu
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--ranks", "2", "--ranks-logs", str(tmp_path)]
    cmd += ["-q", "-rs", "-p", "no:cacheprovider", os.path.join(HERE, "_ranks_cases.py")]
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        cmd, cwd=HERE, env=dict(full_env, **env), capture_output=True, text=True, timeout=240
    )


def test_two_ranks_pass_skip_and_fail(tmp_path):
    """Every rank runs every case; one skipped on the ranks' own decision (a mesh of fewer
    devices); a fetch only rank 0 makes (JAX_UB_TEST_RANKS_SKIP_FETCH) fails there naming
    the array instead of hanging, as its case expects; and the last rank fails one case on
    purpose (JAX_UB_TEST_RANKS_FAIL): the launcher reports its log and exits 1."""
    done = _run(
        tmp_path,
        JAX_UB_TEST_RANKS_SKIP_FETCH="1",
        JAX_UB_TEST_RANKS_FETCH_TIMEOUT_MS="3000",
        JAX_UB_TEST_RANKS_GRACE_S="20",
        JAX_UB_TEST_RANKS_FAIL="1",
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 processes" in done.stdout
    assert "4 passed, 1 skipped" in done.stdout, done.stdout[-3000:]  # rank 0's summary
    assert "a mesh of 1 devices; this run has 2 ranks" in done.stdout
    assert "rank 1 ended with status 1" in done.stdout, done.stdout[-3000:]
    assert "rank 1 fails on purpose" in done.stdout
    assert "exit status of each rank: [0, 1]" in done.stdout
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert "4 passed, 1 skipped" in logs[0], logs[0][-2000:]  # every rank ran every case
    assert "1 failed, 3 passed, 1 skipped" in logs[1], logs[1][-2000:]


def test_a_rank_gone_ends_the_run(tmp_path):
    # Rank 1 exits mid-test, rank 0 would wait on for good (as at a collective or at
    # jax.distributed's shutdown): the run ends a grace period later, naming both.
    done = _run(tmp_path, JAX_UB_TEST_RANKS_GONE="1", JAX_UB_TEST_RANKS_GRACE_S="5")
    assert done.returncode != 0, done.stdout[-3000:]
    assert "rank 0 had not ended 5 s after the first rank ended: killed" in done.stdout
    assert "rank 1 ended with status 3" in done.stdout, done.stdout[-3000:]


def test_a_launcher_ended_by_a_signal_has_the_ranks_print_their_stacks(tmp_path):
    # As device_run.sh's time limit ends a hung group: timeout's TERM to the launcher. Each
    # rank still running prints its threads' stacks beside its log before it is killed.
    # Their native stacks too, where cuda-gdb is on PATH: here a stand-in that says how it
    # was called.
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    (bin_dir / "cuda-gdb").write_text('#!/bin/sh\necho "cuda-gdb $*"\n')
    (bin_dir / "cuda-gdb").chmod(0o755)
    cmd = [sys.executable, "-m", "pytest", "--ranks", "2", "--ranks-logs", str(logs)]
    cmd += ["-q", "-p", "no:cacheprovider", os.path.join(HERE, "_ranks_cases.py")]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_UB_TEST_RANKS_GONE="1", JAX_UB_TEST_RANKS_GRACE_S="200")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    launcher = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        log = logs / "rank0.log"
        # Rank 0 sleeps in the GONE case once rank 1 has left: its third case began.
        while time.monotonic() < deadline and launcher.poll() is None:
            if log.exists() and log.read_text().count(".") >= 2:
                break
            time.sleep(0.5)
        time.sleep(2)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    text = (logs / "rank0_stacks.txt").read_text()
    assert "test_a_rank_gone_does_not_hang_the_others" in text, text[-3000:]
    assert "Thread" in text or "Current thread" in text, text[-3000:]
    native = (logs / "rank0_native.txt").read_text()
    assert re.search(r"^cuda-gdb -p \d+ -batch .*thread apply all bt", native), native


def _fake_tools(tmp_path, monkeypatch) -> str:
    """nvidia-smi listing a GPU and an nvidia-cuda-mps-control that logs its arguments and
    input, first on PATH; the log's path."""
    bin_dir, log = tmp_path / "bin", tmp_path / "mps_calls.log"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (bin_dir / "nvidia-cuda-mps-control").write_text(
        f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        f'[ "$1" = -d ] || cat >> {log}\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv(_ranks_gpu.MPS_ENV, raising=False)
    monkeypatch.setattr(_ranks_gpu, "MPS_DEFAULT_PIPE", str(tmp_path / "no_default_daemon"))
    return str(log)


def test_the_launcher_starts_and_stops_an_mps_daemon_of_its_own(tmp_path, monkeypatch):
    log = _fake_tools(tmp_path, monkeypatch)
    folder = tmp_path / "mps"
    env = _ranks_gpu.start_mps(str(folder))
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(folder / "pipe"), env
    assert os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
    _ranks_gpu.stop_mps(env)
    calls = open(log).read().splitlines()
    assert calls == [f"args=-d pipe={folder}/pipe", f"args= pipe={folder}/pipe", "quit"], calls
    assert not folder.exists()


def test_no_daemon_where_one_runs_or_it_is_off(tmp_path, monkeypatch):
    log = _fake_tools(tmp_path, monkeypatch)
    off = (_ranks_gpu.MPS_ENV, "0")
    for name, value in (("CUDA_MPS_PIPE_DIRECTORY", "/the/callers/daemon"), off):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            folder = tmp_path / f"mps_{name}"
            folder.mkdir()
            assert _ranks_gpu.start_mps(str(folder)) == {}
            assert not folder.exists()
    assert not os.path.exists(log)  # never started


def test_mps_required_where_there_is_none_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_ranks_gpu.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv(_ranks_gpu.MPS_ENV, "1")
    with pytest.raises(SystemExit, match="JAX_UB_TEST_RANKS_MPS=1, but this machine has no"):
        _ranks_gpu.start_mps(str(tmp_path / "mps"))
    monkeypatch.setenv(_ranks_gpu.MPS_ENV, "yes")
    with pytest.raises(SystemExit, match="must be auto, 0 or 1, got 'yes'"):
        _ranks_gpu.start_mps(str(tmp_path / "mps"))


def test_a_rank_whose_gpu_did_not_start_fails(monkeypatch):
    """On a machine with a GPU, a rank that finds none (its GPU plugin failed to start)
    fails the file, with JAX's reason, instead of skipping every GPU test in it."""
    import conftest

    monkeypatch.setattr(conftest, "RANKS", 2)
    monkeypatch.setattr(_ranks_gpu, "has_gpu", lambda: True)
    monkeypatch.setattr(conftest, "_gpus_and_why", lambda: ([], "cuda: the plugin failed"))
    with pytest.raises(pytest.fail.Exception, match="JAX found none.*the plugin failed"):
        conftest.need_gpus(1)
    monkeypatch.setattr(_ranks_gpu, "has_gpu", lambda: False)  # no GPU here: skipped as ever
    with pytest.raises(pytest.skip.Exception, match="needs a GPU"):
        conftest.need_gpus(1)
