"""How each process of a multi-process test (tests/_mp_worker.py, tests/_mp_fault_worker.py)
starts: its devices in the environment, then the jax.distributed group. Imported before
jax, which reads that environment when it is first imported."""

import os

ON_GPU = os.environ.get("JAX_UB_TEST_GPU") == "1"
# Every process drives GPU 0 (jax_ub.share_gpu says how XLA's collectives then work).
SHARE_GPU = os.environ.get("JAX_UB_TEST_SHARE_GPU") == "1"
# The reduce-scatter schedules the "protocol" and "fp8" scenarios run each dtype under, by
# the key their results are filed by: (reduce_scatter_fold_rows, reduce_scatter_ring).
RS_SCHEDULES = {"fold_rows=-1": (-1, False), "fold_rows=0": (0, False), "ring": (0, True)}


def rs_schedules(nproc: int) -> list[str]:
    """The keys of RS_SCHEDULES whose step lists differ in a group of ``nproc``: at 2 the
    fold is the ring's case of two ranks, above 2 only the ring folds (Schedule::
    ReduceScatterFolds), so the third setting would run a list already run."""
    return [name for name in RS_SCHEDULES if name != ("ring" if nproc == 2 else "fold_rows=0")]


def join(pid: int, nproc: int, port: int, *, gpus: str, cpu_devices: int, timeout_s: str):
    """Set this process's devices (with JAX_UB_TEST_GPU=1 the GPUs ``gpus``, as
    CUDA_VISIBLE_DEVICES lists them, or GPU 0 with JAX_UB_TEST_SHARE_GPU=1; else
    ``cpu_devices`` host devices) and jax_ub's default
    timeout ``timeout_s`` (unless the environment gives one), then join the group of
    ``nproc`` processes coordinated on ``port`` as process ``pid``."""
    if ON_GPU and SHARE_GPU:
        import jax_ub

        jax_ub.share_gpu(pid)
    elif ON_GPU:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("JAX_UB_TIMEOUT_S", timeout_s)

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )
