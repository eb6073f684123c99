"""GPU tier, reliability: bitwise determinism, NaN/Inf passing through, a missing peer and
ranks that disagree (the call's outputs NaN, check_health() and the next call naming the
fault, recovery by finalize()), and 100 initialize/finalize rounds leaking nothing. The CPU
versions are in test_ops_forward.py, test_repeated_calls.py, test_peer_faults.py and
test_teardown.py; results on GPUs are recorded in tests/RELIABILITY.md. Skipped without at
least 2 GPUs."""

from __future__ import annotations

import os
import re
import time

import _ranks
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import assert_same_specials, bits, open_fds, special_inputs
from conftest import (
    RANKS,
    ag_fn,
    gpu_mesh,
    group_sizes,
    need_gpus,
    rel_err,
    rs_fn,
    to_f32,
    use_tuning,
)
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_communicators")]

GPUS = need_gpus(2)

GPU_TPS = group_sizes(GPUS)
AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter


def _gpu_mesh(tp: int) -> Mesh:
    return gpu_mesh(GPUS, (tp,), ("tp",))


@pytest.mark.parametrize("trials", [0, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tp", GPU_TPS)
def test_gpu_bitwise_deterministic(tp, dtype, trials):
    """Five runs of both ops on GPUs (copy-engine pushes, flag waits, cuBLASLt, rank-order
    reduction): identical bits every time. With in-op kernel trials (gemm_trials=3) that
    holds once they are over, after a shape's first 15 calls (Tuning.gemm_trials); without,
    from the first call."""
    jax_ub.finalize()  # communicators take the setting when they are created
    use_tuning(gemm_trials=trials)
    mesh = _gpu_mesh(tp)
    M, K, N = 1024 * tp, 1024, 512 * tp
    keys = jax.random.split(jax.random.key(17), 4)
    x, w, h, v = (
        jax.random.normal(k, s, jnp.float32).astype(dtype) / np.sqrt(K)
        for k, s in zip(keys, [(M, K), (K, N), (M, K * tp), (K * tp, N // tp)])
    )

    def body(x, w, h, v):
        return AG(x, w, "tp", impl="ub"), RS(h, v, "tp", impl="ub")

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp"), P(None, "tp"), P("tp")),
            out_specs=(P(None, "tp"), P("tp")),
        )
    )
    if trials:
        for _ in range(20):  # past the trials
            jax.block_until_ready(f(x, w, h, v))
    first = [bits(o) for o in f(x, w, h, v)]
    for run in range(4):
        for i, o in enumerate(f(x, w, h, v)):
            np.testing.assert_array_equal(bits(o), first[i], err_msg=f"run {run}, output {i}")
    jax_ub.finalize()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_nan_inf_pass_through(op, dtype):
    """The CPU test's NaN/Inf placement on GPUs, against XLA's collectives at full precision."""
    tp = len(GPUS)
    mesh = _gpu_mesh(tp)
    fn = ag_fn if op == "ag" else rs_fn
    x, w = special_inputs(op, tp, dtype, m=64, k=128, n=64)
    with jax.default_matmul_precision("highest"):
        want = fn(mesh, "xla")(x, w)
    assert_same_specials(fn(mesh, "ub")(x, w), want, dtype)


@pytest.mark.single_controller(
    "rank 1 skips the call inside one program; across processes: test_gpu_multiprocess.py"
)
def test_gpu_missing_peer_is_reported():
    """Rank 1 never calls the op. The GPUs of one process meet on the host once each has
    enqueued a call (CudaCommunicator::AwaitLocalPeers), so rank 0's call fails with an
    error naming rank 1 after timeout_s; rank 0's stream wait is released by the watchdog,
    check_health() and the next call raise, and finalize() then a fresh run work."""
    timeout_s = 2.0
    jax_ub.configure(timeout_s=timeout_s)
    mesh = _gpu_mesh(2)
    x = jnp.ones((2 * 256, 256), jnp.bfloat16)
    w = jnp.ones((256, 2 * 256), jnp.bfloat16) / 256

    def rank0_only(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: AG(x, w, "tp", impl="ub"),
            lambda: jnp.zeros((2 * 256, w.shape[1]), x.dtype) + 0 * x[0, 0] + 0 * w[0, 0],
        )

    bad = jax.jit(
        jax.shard_map(
            rank0_only, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")
        )
    )
    good = ag_fn(mesh)
    t0 = time.monotonic()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"rank 0 .*timed out.*rank 1"):
        jax.block_until_ready(bad(x, w))
    seconds = time.monotonic() - t0
    assert seconds < timeout_s + 30, seconds
    with pytest.raises(RuntimeError, match=r"all_gather_matmul: rank 0 .*timed out.*rank 1"):
        jax_ub.check_health()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"broken.*rank 1"):
        jax.block_until_ready(good(x, w))
    jax_ub.finalize()
    np.testing.assert_allclose(to_f32(good(x, w)), 1.0, rtol=1e-2)
    jax_ub.check_health()


@pytest.mark.single_controller(
    "one program whose ranks disagree; across processes: test_gpu_multiprocess.py"
)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_ranks_disagree_are_detected(op):
    """Rank 1 runs the op with a smaller k than rank 0. Every chunk carries a call
    descriptor that the receiver checks on the device: the call fails or its outputs are NaN
    on both ranks, and check_health() and the next call name both sides of the disagreement."""
    jax_ub.configure(timeout_s=5.0)
    mesh = _gpu_mesh(2)
    x = jax.random.normal(jax.random.key(3), (2 * 64, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (64, 128), jnp.float32).astype(jnp.bfloat16)
    call = AG if op == "ag" else RS
    in_specs = (P("tp"), P()) if op == "ag" else (P(None, "tp"), P("tp"))

    cut = 48 if op == "ag" else 24  # rank 1's k: local k is 64 (ag) or 32 (rs)

    def body(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: call(x, w, "tp", impl="ub"),
            lambda: call(x[:, :cut], w[:cut], "tp", impl="ub"),
        )

    def program(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P("tp")))

    pattern = (
        r"ranks disagree on the call: rank (0|1) runs \w+\(bfloat16, rows=\d+, k=(64|48|32|24)"
        r".* but rank (1|0) sent \w+\(bfloat16, rows=\d+, k=(48|64|24|32)"
    )
    # Two outcomes are right, and which one comes is a race: a GPU's check finds the
    # mismatch and marks the communicator broken, and a handler thread still waiting for
    # the process's other GPU to enqueue (AwaitLocalPeers) then fails the call itself.
    # Otherwise the call returns, its outputs NaN on both ranks. Numbers never pass.
    try:
        out = np.asarray(to_f32(program(body)(x, w)))
    except jax.errors.JaxRuntimeError as e:
        assert re.search(pattern, str(e)), f"the call failed without naming both sides: {e}"
    else:
        assert np.isnan(out).all(), "ranks that disagree got numbers instead of NaN"
    with pytest.raises(RuntimeError, match=pattern):
        jax_ub.check_health()
    good = program(lambda x, w: call(x, w, "tp", impl="ub"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="ranks disagree on the call"):
        jax.block_until_ready(good(x, w))
    jax_ub.finalize()
    want = program(lambda x, w: call(x, w, "tp", impl="xla"))(x, w)
    assert rel_err(good(x, w), want) < 2e-2


def test_gpu_hundred_initialize_finalize_rounds_leak_nothing():
    """The CPU lifecycle test on 2 GPUs: 100 rounds of initialize (64 MiB userbuffer per
    GPU, flags, streams, a cuBLASLt handle and workspace, a watchdog thread) / both ops /
    finalize. After 10 warm-up rounds: free GPU memory (cudaMemGetInfo; one leaked round is
    over 96 MiB per GPU), open file descriptors and threads must not grow, no communicator
    may stay registered, and every round gives the same bits. The GPU's free memory is
    checked where only this test's processes use the GPU: in the N-ranks mode with other
    groups of ranks beside them (device_run.sh's lanes) their use moves it by GiBs."""
    from jax_ub._src import _cuda

    mesh = _gpu_mesh(2)
    ordinals = [d.local_hardware_id for d in mesh.local_devices]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2 * 256, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 2 * 128)) / 23, jnp.bfloat16)
    ag, rs = ag_fn(mesh), rs_fn(mesh)

    def snapshot():
        free = [_cuda.memory_info(o)[0] >> 20 for o in ordinals]
        return free, open_fds(), len(os.listdir("/proc/self/task"))

    first, samples = None, {}
    for i in range(100):
        jax_ub.initialize(mesh, "tp", buffer_bytes=64 << 20)
        out = [bits(ag(x, w)), bits(rs(ag(x, w), w.T))]
        if first is None:
            first = out
        for a, b in zip(out, first):
            np.testing.assert_array_equal(a, b, err_msg=f"round {i}")
        jax_ub.finalize()
        assert _cuda.num_communicators() == 0
        if i in (9, 99):
            samples[i] = snapshot()
    (free0, fd0, th0), (free1, fd1, th1) = samples.values()
    if _ranks.ranks_on_gpu() <= max(RANKS, 1):
        assert all(a - b < 48 for a, b in zip(free0, free1)), f"free MiB {free0} -> {free1}"
    assert fd1 - fd0 <= 2, f"open file descriptors grew {fd0} -> {fd1}"
    assert th1 - th0 <= 1, f"threads grew {th0} -> {th1}"
