"""examples/multiprocess.py as the README runs it: two processes on this machine (CPU
devices, one tensor-parallel group across both), and a clear usage message, not JAX's
"coordinator_address should be defined", when started without a launcher or flags."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from _mp_launch import free_port

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multiprocess.py"
# What jax.distributed.initialize() reads to find its place (JAX's cluster detection).
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "TPU_", "MEGASCALE_")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


def test_without_a_launcher_it_says_how_to_start_it():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "coordinator_address" not in out.stderr, out.stderr
    assert "none of --process-id/--num-processes" in out.stderr, out.stderr
    for line in (
        "python3 examples/multiprocess.py --process-id 0 --num-processes 2 &",
        "python3 examples/multiprocess.py --process-id 1 --num-processes 2",
        "srun -N 2 --ntasks-per-node=1 python3 examples/multiprocess.py --layout dp_tp",
    ):
        assert line in out.stderr, out.stderr


def test_process_id_without_count_is_a_usage_error():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--process-id", "0"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--process-id and --num-processes go together, got --process-id=0 " in out.stderr


def test_two_processes_as_the_readme_starts_them():
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--coordinator", coordinator]
            + ["--process-id", str(i), "--num-processes", "2"],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, text) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, text[-3000:]
        assert f"process {i}/2: mesh {{'tp': 4}}, loss ub " in text, text[-3000:]
