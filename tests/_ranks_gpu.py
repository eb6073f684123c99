"""The GPU that the N-ranks mode's ranks share (tests/_ranks.py): an MPS daemon of their own,
so that their kernels run side by side, and the GPU's memory, which sizes their pools. Run as
``python3 tests/_ranks_gpu.py mps-start|mps-stop FOLDER`` by device_run.sh, whose lanes share
one daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

MPS_ENV = "JAX_UB_TEST_RANKS_MPS"  # auto (default), 1 (required) or 0: an MPS daemon for the ranks
MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"  # where a daemon started without a pipe folder listens
GPU_MIB_ENV = "JAX_UB_TEST_RANKS_GPU_MIB"  # the shared GPU's memory, found once by the launcher


def start_mps(folder: str) -> dict[str, str]:
    """Start an MPS control daemon whose pipe and logs are in ``folder``, for the ranks of a
    launcher (or of every lane of ``device_run.sh ranks``); the environment its clients need.
    Nothing (``{}``, the folder removed) where ``JAX_UB_TEST_RANKS_MPS=0``, where a daemon runs
    already (the caller's ``CUDA_MPS_PIPE_DIRECTORY``, or one on the default pipe: its clients
    use it as they are), or, with ``auto``, where the machine has no MPS or no GPU."""
    want = os.environ.get(MPS_ENV, "auto")
    if want not in ("auto", "0", "1"):
        raise SystemExit(f"{MPS_ENV} must be auto, 0 or 1, got {want!r}")
    control = shutil.which(MPS_CONTROL)
    running = "CUDA_MPS_PIPE_DIRECTORY" in os.environ or os.path.exists(
        os.path.join(MPS_DEFAULT_PIPE, "control")
    )
    gpu = control is not None and has_gpu()
    if want == "0" or running or not gpu:
        shutil.rmtree(folder, ignore_errors=True)
        if want == "1" and not running:
            raise SystemExit(f"{MPS_ENV}=1, but this machine has no {MPS_CONTROL} or no GPU")
        return {}
    env = _mps_env(folder)
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    # -d: it daemonizes and returns; its server starts with the first client.
    try:
        subprocess.run([control, "-d"], env={**os.environ, **env}, check=True, timeout=30)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return env


def stop_mps(env: dict[str, str]) -> None:
    """Stop a daemon :func:`start_mps` started (its server ends once its clients have) and
    remove its folder; nothing for ``{}``."""
    if not env:
        return
    control = shutil.which(MPS_CONTROL)
    if control is not None and os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"]):
        subprocess.run(
            [control], input="quit\n", text=True, env={**os.environ, **env}, timeout=60, check=False
        )
    shutil.rmtree(os.path.dirname(env["CUDA_MPS_PIPE_DIRECTORY"]), ignore_errors=True)


def _mps_env(folder: str) -> dict[str, str]:
    return {
        "CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log"),
    }


def gpu_memory_mib(gpu: int) -> int | None:
    """GPU ``gpu``'s memory in MiB (``JAX_UB_TEST_RANKS_GPU_MIB``, else nvidia-smi's; None
    where neither says)."""
    if os.environ.get(GPU_MIB_ENV):
        return int(os.environ[GPU_MIB_ENV])
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        listed = subprocess.run(
            [*query, "-i", str(gpu)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = listed.stdout.strip().splitlines()[:1]
    return int(first[0]) if listed.returncode == 0 and first and first[0].isdigit() else None


def has_gpu() -> bool:
    """Whether nvidia-smi lists a GPU on this machine."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


if __name__ == "__main__":  # device_run.sh: one MPS daemon for every lane's ranks
    if len(sys.argv) == 3 and sys.argv[1] == "mps-start":
        os.makedirs(sys.argv[2], exist_ok=True)
        print(" ".join(f"{k}={v}" for k, v in start_mps(sys.argv[2]).items()))
    elif len(sys.argv) == 3 and sys.argv[1] == "mps-stop":
        stop_mps(_mps_env(sys.argv[2]))
    else:
        raise SystemExit("usage: python3 tests/_ranks_gpu.py mps-start|mps-stop FOLDER")
