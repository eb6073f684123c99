"""jax_ub.share_gpu: the environment that makes a process one of several ranks on one GPU
(what the N-ranks mode, ``pytest --ranks N``, and README's one-GPU recipe rely on), and its
refusals. Run in fresh processes: it changes the process's environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import jax_ub
from jax_ub._src import jax_compat


def _in_fresh_process(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_environment_of_a_rank():
    code = (
        "import json, os, jax_ub\n"
        "os.environ['NCCL_SOCKET_IFNAME'] = 'eth7'\n"
        "ret = jax_ub.share_gpu(5, gpu=1)\n"
        "names = ['CUDA_VISIBLE_DEVICES', 'XLA_PYTHON_CLIENT_PREALLOCATE', 'NCCL_HOSTID',\n"
        "         'NCCL_SOCKET_IFNAME', 'NCCL_NVLS_ENABLE', 'NVSHMEM_DISABLE_NVLS',\n"
        "         'TORCH_SYMM_MEM_DISABLE_MULTICAST']\n"
        "print(json.dumps([ret, {n: os.environ[n] for n in names}]))\n"
    )
    done = _in_fresh_process(code)
    assert done.returncode == 0, done.stderr[-2000:]
    ret, env = json.loads(done.stdout.splitlines()[-1])
    assert ret == env
    assert env == {
        "CUDA_VISIBLE_DEVICES": "1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "NCCL_HOSTID": "jax_ub_rank_5",
        "NCCL_SOCKET_IFNAME": "eth7",  # the user's choice is kept
        "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(process_id=-1), r"process_id must be an int >= 0, got -1"),
        (dict(process_id=1.0), r"process_id must be an int >= 0, got 1.0"),
        (dict(process_id=0, gpu=-2), r"gpu must be an int >= 0, got -2"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jax_ub.share_gpu(**kwargs)


def test_too_late_once_the_gpu_backend_exists(monkeypatch):
    monkeypatch.setitem(jax_compat.backend_registry()[0], "cuda", object())
    with pytest.raises(RuntimeError, match="before JAX first uses a device"):
        jax_ub.share_gpu(0)
