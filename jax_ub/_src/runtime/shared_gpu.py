"""Several processes on one GPU, each a rank of one group: tp > 1 developed and tested on a
machine of one GPU."""

from __future__ import annotations

import os

from jax_ub._src.jax_compat import backend_registry

# NVLink multicast stays off in every library that could use it (NCCL, PyTorch, NVSHMEM).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def share_gpu(process_id: int, *, gpu: int = 0) -> dict[str, str]:
    """Make this process one of several ranks that all drive GPU ``gpu``.

    Call it in every process before JAX first uses a device, then join the processes with
    ``jax.distributed.initialize`` as usual: each process sees one GPU, the group one
    device per process, and jax_ub's ops run at tp = the number of processes, their
    userbuffers shared through CUDA IPC as between GPUs. For development and tests: the
    ranks take turns on one GPU, so timings say nothing of speed.

    What it sets (and returns), in this process's environment:

    - ``CUDA_VISIBLE_DEVICES=gpu`` and ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so that the
      processes fit on the GPU together;
    - ``NCCL_HOSTID``, one per process, and ``NCCL_SOCKET_IFNAME=lo`` (unless set): NCCL
      refuses two ranks of one GPU on one host ("Duplicate GPU detected"), so XLA's own
      collectives (a loss's ``psum``, dp's gradient sums) take each process for a host of
      its own and join them over loopback;
    - NVLink multicast off (``NCCL_NVLS_ENABLE=0`` and its PyTorch and NVSHMEM switches).

    >>> import jax_ub
    >>> env = jax_ub.share_gpu(process_id=3)  # then jax.distributed.initialize(...)
    >>> env["CUDA_VISIBLE_DEVICES"], env["NCCL_HOSTID"]
    ('0', 'jax_ub_rank_3')
    """
    if not isinstance(process_id, int) or isinstance(process_id, bool) or process_id < 0:
        raise ValueError(f"share_gpu: process_id must be an int >= 0, got {process_id!r}")
    if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
        raise ValueError(f"share_gpu: gpu must be an int >= 0, got {gpu!r}")
    if {"cuda", "gpu"} & set(backend_registry()[0]):
        raise RuntimeError(
            "share_gpu must run before JAX first uses a device: this process's GPU backend "
            "exists already, with the GPUs it saw then"
        )
    env = {
        "CUDA_VISIBLE_DEVICES": str(gpu),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "NCCL_HOSTID": f"jax_ub_rank_{process_id}",
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        **NO_MULTICAST,
    }
    os.environ.update(env)
    return env
