"""GPU tier, several processes: TP groups spanning processes on one host, their userbuffers
shared through CUDA IPC handles bootstrapped over jax.distributed. Same workers and checks
as the CPU multi-process tests, a killed process included. Skipped without enough GPUs
(counted with nvidia-smi: this process must not initialize CUDA)."""

from __future__ import annotations

import pytest
from _mp_launch import check_killed_peer, gpu_count, results, run
from test_multiprocess import check_fp8, check_protocol
from test_multiprocess_faults import (
    check_absent_peer,
    check_mismatched_setting,
    check_mismatched_shape,
)

pytestmark = [pytest.mark.gpu, pytest.mark.own_processes]


GPUS = gpu_count()


@pytest.mark.parametrize(
    "nproc,ndev,shared",
    [(2, 1, False), (4, 1, False), (2, 2, False), (2, 1, True), (4, 1, True), (8, 1, True)],
    ids=["2x1", "4x1", "2x2", "2_on_one_gpu", "4_on_one_gpu", "8_on_one_gpu"],
)
def test_tp_group_across_processes_on_gpus(nproc, ndev, shared):
    """Both ops, two calls of one inner jitted function and the gradients against XLA's
    collectives; nproc processes of ndev GPUs each, or all on GPU 0 (``shared``: NCCL
    takes each process for a host of its own, ``jax_ub.share_gpu``)."""
    if GPUS < (1 if shared else nproc * ndev):
        pytest.skip(f"needs {1 if shared else nproc * ndev} GPUs, found {GPUS}")
    out = run("tp_across_processes", nproc, ndev, timeout=300, gpu=True, share_gpu=shared)
    for r in results(out):
        # f32 on both sides (the worker asks XLA for full-precision dots, not TF32).
        assert all(e < 1e-4 for e in r["errs"]), r["errs"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_protocol_on_one_shared_gpu(nproc):
    """The CPU test's every branch of the step lists, run by the CUDA communicator in nproc
    processes that all drive GPU 0 (CUDA IPC between processes of one GPU): groups of
    several ranks on a machine of one GPU."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    for r in results(run("protocol", nproc, 1, timeout=400, gpu=True, share_gpu=True)):
        check_protocol(r["errs"], nproc)


def test_fp8_on_one_shared_gpu():
    """Both ops in fp8 through cuBLASLt's fp8 GEMMs at tp=2 (2 processes on GPU 0). Hopper's
    fp8 tensor cores accumulate with less than float32's precision (about 1e-4 relative
    seen at k = 48..64), hence the float32 outputs' tolerance."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    for r in results(run("fp8", 2, 1, timeout=300, gpu=True, share_gpu=True)):
        check_fp8(r["errs"], f32_tol=1e-3)


def test_dp_across_processes_tp_inside_on_gpus():
    if GPUS < 4:
        pytest.skip("needs 4 GPUs")
    for r in results(run("dp_across_tp_inside", 2, 2, timeout=300, gpu=True)):
        assert all(e < 1e-4 for e in r["errs"]), r["errs"]


def test_killed_process_fails_peers_within_deadline_then_recovers_on_gpus():
    """The CPU test's killed process with one GPU per process (CUDA IPC), up to 3 processes:
    the survivors' next op returns NaN within the deadline and check_health() names the
    dead rank, the op after fails at once, and after finalize() both ops are correct on the
    survivors."""
    if GPUS < 2:
        pytest.skip("needs at least 2 GPUs")
    check_killed_peer(nproc=min(3, GPUS), gpu=True)


@pytest.mark.parametrize("nproc", [2, 4])
def test_killed_process_on_one_shared_gpu(nproc):
    """The killed process above, every process on GPU 0: the survivors' next op returns NaN
    within the deadline, check_health() names the dead rank, and after finalize() both ops
    are right on the survivors."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    check_killed_peer(nproc=nproc, gpu=True, share_gpu=True)


def test_killed_process_then_a_new_program_on_one_shared_gpu():
    """The killed process above, 2 processes on GPU 0, with a program never run before
    dispatched right behind the survivor's stuck call: loading its kernels must not keep the
    watchdog from releasing the call (the same NaN and error within the deadline), and the
    program's numbers come out right after."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    check_killed_peer(nproc=2, gpu=True, share_gpu=True, new_kernel=True)


@pytest.mark.parametrize(
    "check",
    [check_absent_peer, check_mismatched_setting, check_mismatched_shape],
    ids=["absent_peer", "mismatched_setting", "mismatched_shape"],
)
def test_faults_on_one_shared_gpu(check):
    """The CPU tier's faults with every process on GPU 0 (the checks:
    test_multiprocess_faults.py): a process that never calls the op, one configured
    otherwise, one calling with another shape. Each fails every other process clearly
    within the deadline, naming it, and nothing hangs."""
    if GPUS < 1:
        pytest.skip("needs a GPU")
    check(gpu=True, share_gpu=True)
