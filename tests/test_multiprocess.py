"""Multi-process tier on CPU: processes joined by jax.distributed, one TP group spanning
them, the host protocol running over POSIX shared memory bootstrapped through the
key-value store. Each test starts real processes (tests/_mp_worker.py). Faults across
processes are in test_multiprocess_faults.py."""

from __future__ import annotations

import re

import pytest
from _mp_join import rs_schedules
from _mp_launch import results, run


@pytest.mark.parametrize("nproc,ndev", [(4, 1), (2, 2)])
def test_tp_group_across_processes(nproc, ndev):
    """One tp group over every device of nproc processes of ndev devices each: more than
    two processes, and processes of several devices (two processes of one device each are
    the protocol tests' groups)."""
    for r in results(run("tp_across_processes", nproc, ndev)):
        assert len(r["errs"]) == 7
        assert all(e < 1e-5 for e in r["errs"]), r["errs"]


def check_protocol(res: dict, nproc: int) -> None:
    """The "protocol" scenario's errors in a group of ``nproc``: per fold setting that
    differs there and dtype, with the AG's epilogue per dtype, and above 2 with the AG in turn
    through its flag GEMM and the RS through its signal GEMM per dtype: the gathered x
    (exact), both ops and the grads (three,
    or four with the bias; bf16's from x gathered again in the backward's reduce-scatter)
    against XLA's path."""
    dtypes = ("float32", "bfloat16")
    flag = ["flag_gemm", "signal_gemm"] if nproc > 2 else []
    want = [f"{name},{d}" for name in rs_schedules(nproc) + flag for d in dtypes]
    assert sorted(res) == sorted(want + [f"epilogue,{d}" for d in dtypes]), res
    for key, errs in res.items():
        assert len(errs) == (7 if key.startswith("epilogue") else 6), (key, errs)
        assert errs[0] == 0.0, (key, errs)  # the gathered copy moves bytes
        tol = 1e-5 if key.endswith("float32") else 2e-2
        assert all(0 <= e < tol for e in errs), (key, errs)


@pytest.mark.parametrize("nproc", [2, 3])
def test_protocol_across_processes(nproc):
    """Every branch of the step lists across processes: folded (uneven pieces; at 3 in a
    ring) and unfolded reduce-scatters, with and without an all-gather beside them, the
    gathered copy, the AG's epilogue, at 3 the AG in turn through its flag GEMM (each remote
    chunk awaited inside the GEMM step), f32 and bf16."""
    for r in results(run("protocol", nproc, 1)):
        check_protocol(r["errs"], nproc)


def check_fp8(res: dict, f32_tol: float = 1e-5) -> None:
    """The "fp8" scenario's errors (2 processes): per fold setting that differs there and
    output dtype, both ops in fp8 and their VJPs against a float32 reference from the
    dequantized operands (float32 outputs within `f32_tol`)."""
    assert sorted(res) == sorted(
        f"{name},{d}" for name in rs_schedules(2) for d in ("float32", "bfloat16")
    ), res
    for key, errs in res.items():
        tol = f32_tol if key.endswith("float32") else 1e-2
        assert len(errs) == 6 and all(0 <= e < tol for e in errs), (key, errs)


def test_fp8_across_processes():
    for r in results(run("fp8", 2, 1)):
        check_fp8(r["errs"])


def test_a_program_compiled_again_in_one_process_alone_still_pairs():
    """Process 0 alone clears JAX's caches before the second and third runs of a program
    (it lowers and compiles the program anew; its peer keeps its first executable): the
    new executable numbers its calls as the peer's first does, so every run pairs, with
    the right numbers, instead of timing out."""
    for r in results(run("recompiled_alone", 2, 1)):
        assert len(r["errs"]) == 3 and all(0 <= e < 1e-5 for e in r["errs"]), r["errs"]


def test_dp_across_processes_tp_inside():
    for r in results(run("dp_across_tp_inside", 2, 2)):
        assert all(e < 1e-5 for e in r["errs"]), r["errs"]


def test_group_across_hosts_falls_back_or_fails_clearly():
    """Each process claims its own host (JAX_UB_HOST_ID), so the tp group cannot share
    memory: impl="auto" gives XLA's results with exactly one warning naming the hosts,
    impl="ub" raises naming the devices and hosts. No process hangs."""
    for r in results(run("different_hosts", 2, 2)):
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
