"""Reliability and fault tests (issue #7): peers that never come, come late or run another
call; a process killed in the middle of a run; NaN/Inf pass-through; bitwise determinism;
lifecycle leaks; a table of bad inputs with their errors. CPU here; a GPU section at the end
is skipped without at least 2 GPUs.

What each part covers and what ran where is recorded in tests/RELIABILITY.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ag_fn as _ag
from conftest import comm_options, gpus, make_mesh, rel_err, smap, to_f32, tol, use_tuning
from conftest import rs_fn as _rs
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_multiprocess import _free_port, _gpu_count

import jax_ub
from jax_ub._src import _host

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter
HERE = os.path.dirname(os.path.abspath(__file__))
FAULT_WORKER = os.path.join(HERE, "_mp_fault_worker.py")


@pytest.fixture(autouse=True)
def _fresh():
    """Every test starts and ends without communicators (a fault test leaves one broken)."""
    jax_ub.finalize()
    yield
    jax_ub.finalize()


def _put(mesh, spec, array):
    """Place a host array with its final sharding up front: an uncommitted input makes the
    first call compile a resharding program, which finalize()'s cache clearing throws away."""
    return jax.device_put(np.asarray(array), NamedSharding(mesh, spec))


def _expect_failure(fn, *args):
    """Runs fn(*args) to completion, which must fail; returns (message, seconds).

    Only the message leaves this function: the failed result must not stay referenced,
    since jax_ub.finalize() waits on every live array (see
    test_finalize_after_error_while_failed_result_is_referenced)."""
    t0 = time.monotonic()
    try:
        jax.block_until_ready(fn(*args))
    except jax.errors.JaxRuntimeError as e:
        return str(e), time.monotonic() - t0
    pytest.fail(f"{fn} was expected to fail but returned a result")


# =========================================================================================
# 1. Peers that never come, come late, or run a different call (one process)
# =========================================================================================


def test_missing_peer_in_second_group(mesh2d, rand):
    """matmul_reduce_scatter on a 2x4 mesh; rank 3 of group 1 never calls the op.

    The waiting ranks of group 1 fail within the deadline, naming the op, their own rank
    and group, the missing rank, and the call number expected vs the one observed. The next
    call on the (now broken) communicator fails at once; finalize() and a fresh run work.
    """
    timeout_s = 1.5
    jax_ub.configure(timeout_s=timeout_s)
    mesh = mesh2d(2, 4)
    both = ("dp", "tp")
    h, v = rand(4 * 8, 4 * 16), rand(4 * 16, 8)

    def healthy(h, v):
        return RS(h, v, "tp", impl="ub")

    def missing(h, v):
        absent = (lax.axis_index("dp") == 1) & (lax.axis_index("tp") == 3)
        return lax.cond(
            absent,
            lambda: jnp.zeros((8, v.shape[1]), h.dtype) + 0 * h[0, 0] + 0 * v[0, 0],
            lambda: RS(h, v, "tp", impl="ub"),
        )

    specs = dict(in_specs=(P(None, "tp"), P("tp")), out_specs=P(both))
    ok = smap(healthy, mesh, **specs).lower(h, v).compile()
    bad = smap(missing, mesh, **specs).lower(h, v).compile()
    expected = np.asarray(ok(h, v))  # both groups, one stacked under the other
    assert rel_err(expected[:32], to_f32(h) @ to_f32(v)) < 1e-5
    np.testing.assert_array_equal(expected[:32], expected[32:])

    msg, seconds = _expect_failure(bad, h, v)
    assert re.search(
        r"matmul_reduce_scatter: rank [0-2] \(group 1\) (timed out after 1\.5 s waiting for "
        r"rank 3 to deliver its partial sum for call #2 \(flag holds #1\)|stopped waiting for "
        r"rank 3)",
        msg,
    ), msg
    assert "DEADLINE_EXCEEDED" in msg or "timed out" in msg, msg
    assert 0.9 * timeout_s <= seconds < timeout_s + 3.0, seconds

    # Broken: the next call (the healthy program, already compiled) fails at once.
    msg, seconds = _expect_failure(ok, h, v)
    assert re.search(
        r"communicator is broken by an earlier error \(matmul_reduce_scatter: rank \d \(group 1\)"
        r".*rank 3.*\); call jax_ub.finalize\(\)",
        msg,
    ), msg
    assert seconds < timeout_s / 3, f"a broken communicator took {seconds:.2f} s to fail"
    with pytest.raises(RuntimeError, match=r"group 1\).*rank 3"):
        jax_ub.check_health()

    # Re-initialize after the error: a fresh communicator, the same answer bit for bit.
    jax_ub.finalize()
    again = smap(healthy, mesh, **specs)(h, v)
    jax_ub.check_health()  # healthy again: no error
    np.testing.assert_array_equal(np.asarray(again), expected)


def test_late_peer_does_not_hang(mesh1d, rand):
    """Rank 1 arrives 1.5 s late with a 0.5 s deadline: rank 0 times out naming it, and the
    late rank then fails too (the communicator is broken) instead of waiting for a peer that
    has given up. The whole call ends within the delay plus a margin."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 8)

    def stall(a):
        time.sleep(1.5)
        return np.zeros((), np.float32)

    def body(x, w):
        def late():
            delay = jax.pure_callback(stall, jax.ShapeDtypeStruct((), x.dtype), x[0, 0])
            return AG(x + 0 * delay, w, "tp", impl="ub")

        return lax.cond(lax.axis_index("tp") == 1, late, lambda: AG(x, w, "tp", impl="ub"))

    f = smap(body, mesh, (P("tp"), P()), P("tp")).lower(x, w).compile()
    msg, seconds = _expect_failure(f, x, w)
    assert re.search(
        r"all_gather_matmul: rank 0 \(group 0\) timed out after 0\.5 s waiting for rank 1 to "
        r"deliver its chunk for call #1 \(flag holds #0\)",
        msg,
    ), msg
    assert seconds < 1.5 + 3.0, seconds
    # JAX keeps the failed program's runtime token (it has a host callback) and would raise
    # it again from jax.effects_barrier() and at exit; a good callback program replaces it.
    echo = lambda a: jax.pure_callback(lambda b: b, jax.ShapeDtypeStruct(a.shape, a.dtype), a)  # noqa: E731
    jax.block_until_ready(smap(echo, mesh, P("tp"), P("tp"))(x))
    jax.effects_barrier()
    jax_ub.finalize()
    w2 = rand(16, 2 * 4)
    assert rel_err(_ag(mesh)(x, w2), to_f32(x) @ to_f32(w2)) < 1e-5


def _two_branch(mesh, rank0, others):
    """Rank 0 runs `rank0(x, w)`, the other ranks `others(x, w)` (same output shape)."""
    body = lambda x, w: lax.cond(lax.axis_index("tp") == 0, rank0, others, x, w)  # noqa: E731
    return smap(body, mesh, (P("tp"), P()), P("tp"))


@pytest.mark.parametrize("mismatch", ["op", "dtype", "k"])
def test_ranks_disagree_name_both_calls(mesh1d, rand, mismatch):
    """A descriptor mismatch between ranks is an error naming both sides' calls (op, dtype,
    shape, call number), never a hang or a wrong result. (A mismatch in n is covered by
    test_errors.test_ranks_disagree_on_the_call.)"""
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 8)
    ag = lambda x, w: AG(x, w, "tp", impl="ub")  # noqa: E731  [8, 8] per rank
    if mismatch == "op":
        # [8, 16] @ [16, 8], reduce-scattered to [4, 8], padded to AG's [8, 8].
        other = lambda x, w: jnp.pad(  # noqa: E731
            RS(jnp.concatenate([x, x]), w, "tp", impl="ub"), ((0, 4), (0, 0))
        )
        sides = (
            "all_gather_matmul(float32, rows=4, k=16, n=8, call #1)",
            "matmul_reduce_scatter(float32, rows=4, k=16, n=8, call #1)",
        )
    elif mismatch == "dtype":
        other = lambda x, w: AG(  # noqa: E731
            x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), "tp", impl="ub"
        ).astype(jnp.float32)
        sides = (
            "all_gather_matmul(float32, rows=4, k=16, n=8, call #1)",
            "all_gather_matmul(bfloat16, rows=4, k=16, n=8, call #1)",
        )
    else:
        other = lambda x, w: AG(x[:, :12], w[:12], "tp", impl="ub")  # noqa: E731
        sides = (
            "all_gather_matmul(float32, rows=4, k=16, n=8, call #1)",
            "all_gather_matmul(float32, rows=4, k=12, n=8, call #1)",
        )
    msg, _ = _expect_failure(_two_branch(mesh, ag, other), x, w)
    m = re.search(
        r"ranks disagree on the call: rank (\d) runs (.*\)) but rank (\d) sent (.*\))", msg
    )
    assert m, msg
    assert {m.group(1), m.group(3)} == {"0", "1"}, msg
    assert {m.group(2), m.group(4)} == set(sides), msg


def test_call_count_mismatch_names_expected_and_observed(mesh1d, rand):
    """Rank 0 runs the op twice, rank 1 once: rank 0's second call times out, reporting the
    call number it waited for (#2) and the one its peer's flag holds (#1)."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 8)

    def twice(x, w):
        y = AG(x, w, "tp", impl="ub")
        return AG(x + 0 * y[:4, :1], w, "tp", impl="ub")

    once = lambda x, w: AG(x, w, "tp", impl="ub")  # noqa: E731
    msg, seconds = _expect_failure(_two_branch(mesh, twice, once), x, w)
    assert re.search(
        r"DEADLINE_EXCEEDED: jax_ub: all_gather_matmul: rank 0 \(group 0\) timed out after 0\.5 s"
        r" waiting for rank 1 to deliver its chunk for call #2 \(flag holds #1\)",
        msg,
    ), msg
    assert seconds < 0.5 + 3.0, seconds


def test_finalize_after_a_timeout_is_prompt_and_quiet(mesh1d, rand):
    """finalize() after a timeout neither waits for the rank that never called (its call
    count will never catch up) nor warns about calls in flight: a broken communicator makes
    no more progress. (It spent timeout_s and warned before commit 826e05a.)"""
    timeout_s = 1.0
    jax_ub.configure(timeout_s=timeout_s)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 4)

    def rank0_only(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: AG(x, w, "tp", impl="ub"),
            lambda: jnp.zeros((2 * 4, w.shape[1]), x.dtype) + 0 * x[0, 0] + 0 * w[0, 0],
        )

    msg, _ = _expect_failure(smap(rank0_only, mesh, (P("tp"), P()), P("tp")), x, w)
    assert "timed out" in msg, msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        jax_ub.finalize()
        seconds = time.monotonic() - t0
    assert _host.num_communicators() == 0
    assert seconds < timeout_s / 4, f"finalize() took {seconds:.2f} s after a timeout"
    assert not caught, [str(c.message) for c in caught]


# =========================================================================================
# 2. NaN and Inf pass through unchanged
# =========================================================================================


def _special_ag_inputs(tp, dtype, m=8, k=16, n=8):
    """x [tp*m, k] and w [k, tp*n] with NaN/Inf placed so that every row block (rank) holds
    some, and the products exercise NaN propagation, +-Inf, Inf - Inf = NaN and 0 * Inf = NaN."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((tp * m, k)).astype(np.float32) + 0.1
    w = rng.standard_normal((k, tp * n)).astype(np.float32) + 0.1
    r = [b * m for b in range(tp)]  # first row of each rank's block
    x[r[0] + 1, 3] = np.nan
    x[r[1 % tp] + 2, 0] = np.inf
    x[r[-1] + 1, 5], x[r[-1] + 1, 6] = -np.inf, np.inf  # Inf - Inf where signs of w agree
    w[4, 1] = np.inf
    x[r[-1] + 3, 4] = 0.0  # 0 * Inf
    w[7, tp * n - 2] = np.nan  # a NaN column
    return x.astype(dtype), w.astype(dtype)


def _special_rs_inputs(tp, dtype, m=8, k=16, n=8):
    """x [tp*m, tp*k] and w [tp*k, n] for a reduce-scatter whose partial sums from different
    ranks meet NaN, +-Inf, Inf - Inf and 0 * Inf."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((tp * m, tp * k)).astype(np.float32) + 0.1
    w = rng.standard_normal((tp * k, n)).astype(np.float32) + 0.1
    x[2, 5] = np.nan  # rank 0's columns
    x[m + 4, k + 1] = np.inf  # rank 1's columns ...
    x[m + 4, (tp - 1) * k + 2] = np.inf  # ... and the last rank's: partials of either sign meet
    w[(tp - 1) * k + 9, 3] = -np.inf
    x[tp * m - 1, (tp - 1) * k + 9] = 0.0  # 0 * -Inf
    w[k + 7, n - 1] = np.nan
    return x.astype(dtype), w.astype(dtype)


def _assert_same_specials(got, want, dtype):
    """NaN exactly where `want` has NaN, Inf of the same sign where it has Inf, and the finite
    values equal up to the dtype's tolerance."""
    got, want = to_f32(got), to_f32(want)
    assert got.shape == want.shape
    nan_w, inf_w = np.isnan(want), np.isinf(want)
    # The test must prove something: the reference has NaN, Inf and finite entries.
    assert nan_w.any() and inf_w.any() and (~nan_w & ~inf_w).any()
    np.testing.assert_array_equal(np.isnan(got), nan_w, err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isinf(got), inf_w, err_msg="Inf positions differ")
    np.testing.assert_array_equal(got[inf_w], want[inf_w], err_msg="Inf signs differ")
    fin = ~nan_w & ~inf_w
    assert rel_err(got[fin], want[fin]) < tol(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_nan_inf_pass_through(mesh1d, op, dtype):
    tp = 4
    mesh = mesh1d(tp)
    if op == "ag":
        x, w = _special_ag_inputs(tp, dtype)
        f_ub, f_ref = _ag(mesh, "ub"), _ag(mesh, "xla")
    else:
        x, w = _special_rs_inputs(tp, dtype)
        f_ub, f_ref = _rs(mesh, "ub"), _rs(mesh, "xla")
    _assert_same_specials(f_ub(x, w), f_ref(x, w), dtype)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_input_is_bit_exact(mesh1d, rand, dtype):
    """return_gathered hands back x bit for bit on every rank: NaN payloads and signs, +-Inf,
    -0.0 and subnormals included."""
    tp, m, k = 4, 4, 8
    mesh = mesh1d(tp)
    x = np.asarray(rand(tp * m, k, dtype=dtype))
    if dtype == jnp.float32:
        specials = np.array(
            [
                0x7FC00ABC,
                0xFFC00001,
                0x7F800001,
                0x7F800000,
                0xFF800000,
                0x80000000,
                0x00000001,
                0x807FFFFF,
            ],
            np.uint32,
        )
    else:
        specials = np.array(
            [0x7FC5, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F], np.uint16
        )
    flat = _bits(x).copy().reshape(-1)
    flat[:: (tp * m * k) // len(specials)][: len(specials)] = specials  # spread over ranks
    x = flat.view(x.dtype).reshape(tp * m, k)
    w = np.asarray(rand(k, tp * 4, dtype=dtype))
    f = smap(
        lambda x, w: AG(x, w, "tp", impl="ub", return_gathered=True),
        mesh,
        (P("tp"), P(None, "tp")),
        (P(None, "tp"), P("tp")),  # every rank's gathered copy, stacked
    )
    _, gathered = f(x, w)
    copies = _bits(gathered).reshape(tp, tp * m, k)
    for rank in range(tp):
        np.testing.assert_array_equal(copies[rank], _bits(x), err_msg=f"rank {rank}")


# =========================================================================================
# 3. Determinism: the same inputs give bitwise-identical outputs
# =========================================================================================


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_bitwise_deterministic(mesh1d, rand, tp, dtype):
    """Both ops, five runs of one compiled program: identical bits every time (partials are
    summed in rank order, not arrival order, and 8 device threads on 2 cores arrive in a
    different order every run)."""
    mesh = mesh1d(tp)
    m, k, n = 16, 64, 32

    def body(x, w, h, v):
        return AG(x, w, "tp", impl="ub"), RS(h, v, "tp", impl="ub")

    f = smap(body, mesh, (P("tp"), P(None, "tp"), P(None, "tp"), P("tp")), (P(None, "tp"), P("tp")))
    args = (
        _put(mesh, P("tp"), rand(tp * m, k, dtype=dtype)),
        _put(mesh, P(None, "tp"), rand(k, tp * n, dtype=dtype)),
        _put(mesh, P(None, "tp"), rand(tp * m, tp * k, dtype=dtype)),
        _put(mesh, P("tp"), rand(tp * k, n, dtype=dtype)),
    )
    first = [_bits(o) for o in f(*args)]
    for run in range(4):
        for i, o in enumerate(f(*args)):
            np.testing.assert_array_equal(_bits(o), first[i], err_msg=f"run {run}, output {i}")


def test_bitwise_deterministic_across_groups_and_reinitialization(mesh2d, rand):
    """On a 2x4 mesh both tp groups get the same inputs: their outputs agree bit for bit, and
    so do the outputs after finalize() (a new communicator and a new compile)."""
    mesh = mesh2d(2, 4)
    both = ("dp", "tp")

    def body(x, w, h, v):
        return AG(x, w, "tp", impl="ub"), RS(h, v, "tp", impl="ub")

    f = smap(body, mesh, (P("tp"), P(None, "tp"), P(None, "tp"), P("tp")), (P("dp", "tp"), P(both)))
    x, w = rand(4 * 16, 64), rand(64, 4 * 32)
    h, v = rand(4 * 16, 4 * 64), rand(4 * 64, 32)
    ag1, rs1 = (_bits(o) for o in f(x, w, h, v))
    for out in (ag1, rs1):
        half = out.shape[0] // 2
        np.testing.assert_array_equal(out[:half], out[half:])  # group 0 == group 1
    jax_ub.finalize()
    ag2, rs2 = (_bits(o) for o in f(x, w, h, v))
    np.testing.assert_array_equal(ag2, ag1)
    np.testing.assert_array_equal(rs2, rs1)


# =========================================================================================
# 4. Lifecycle: no leaks over 100 rounds, finalize at exit, finalize after an error
# =========================================================================================


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for _ in fh)


def _shm_names(prefix: str = "jax_ub_") -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def test_hundred_initialize_finalize_rounds_leak_nothing(mesh1d):
    """100 rounds of initialize / one op that fills the whole buffer / finalize.

    Checked: host communicators, open file descriptors, memory mappings and resident memory
    (after 10 warm-up rounds). Each round's buffers are 4 x 512 KiB, every byte written by
    the op, so a leaked round would add 2 MiB of RSS: 90 leaked rounds are 180 MiB, against a
    tolerance of 24 MiB. finalize() clears JAX's caches, so every round traces and compiles
    the program again (about 0.1 s here); the inputs are placed with their final sharding
    once, so no resharding program is compiled with it. The outputs of all rounds are
    compared bit for bit (a fresh communicator every round, the same answer).
    """
    tp, buffer_bytes = 4, 512 << 10
    mesh = mesh1d(tp)
    k = 256
    m = buffer_bytes // tp // (k * 4)  # one chunk per rank: the op needs the whole buffer
    rng = np.random.default_rng(3)
    x = _put(mesh, P("tp"), rng.standard_normal((tp * m, k), np.float32))
    w = _put(mesh, P(None, "tp"), rng.standard_normal((k, tp * 8), np.float32))
    f = _ag(mesh)
    first = None
    samples = {}
    for i in range(100):
        comm = jax_ub.initialize(mesh, "tp", buffer_bytes=buffer_bytes)
        assert comm.capacity_bytes == buffer_bytes
        out = _bits(f(x, w))
        if first is None:
            first = out
            assert rel_err(out.view(np.float32), np.asarray(x) @ np.asarray(w)) < 1e-5
        np.testing.assert_array_equal(out, first, err_msg=f"round {i}")
        assert [c.id for c in jax_ub.live_communicators()] == [comm.id]  # used, not replaced
        jax_ub.finalize()
        assert _host.num_communicators() == 0
        if i in (9, 54, 99):
            samples[i] = (_open_fds(), _mappings(), _rss_mib())
    (fd0, maps0, rss0), (fd1, maps1, rss1), (fd2, maps2, rss2) = samples.values()
    assert fd2 - fd0 <= 2, f"open file descriptors grew {fd0} -> {fd1} -> {fd2}"
    assert maps2 - maps0 <= 8, f"memory mappings grew {maps0} -> {maps1} -> {maps2}"
    assert rss2 - rss0 < 24, f"RSS grew {rss0:.0f} -> {rss1:.0f} -> {rss2:.0f} MiB"


def test_shared_memory_communicators_leak_nothing():
    """100 shared-memory host communicators (what a multi-process run creates), created,
    connected, unlinked (even rounds) or not (odd rounds: destroy must unlink), destroyed:
    no name left in /dev/shm, no mapping and no file descriptor left open."""
    prefix = f"/jax_ub_reltest_{os.getpid()}"
    before = (_open_fds(), _mappings(), _shm_names(prefix[1:]))
    for i in range(100):
        cid = _host.create_communicator(
            2, [0, 1], 256 << 10, comm_options(timeout_s=1.0), shm_prefix=f"{prefix}_{i}"
        )
        names = list(_host.region_names(cid))
        assert names == [f"{prefix}_{i}_0", f"{prefix}_{i}_1"]
        assert _shm_names(f"jax_ub_reltest_{os.getpid()}_{i}_") == [n[1:] for n in names]
        _host.connect(cid, names)
        if i % 2 == 0:
            _host.unlink(cid)
            assert _shm_names(f"jax_ub_reltest_{os.getpid()}_{i}_") == []
        assert _host.destroy_communicator(cid)
    after = (_open_fds(), _mappings(), _shm_names(prefix[1:]))
    assert after == before, f"(fds, mappings, /dev/shm names) {before} -> {after}"


def test_finalize_at_interpreter_exit_with_work_in_flight():
    """A program that exits with a live communicator and an op still running exits cleanly:
    the atexit hook finalizes (no warning, no traceback, exit status 0)."""
    script = textwrap.dedent(
        """
        import numpy as np, jax, jax_ub
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"), mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
        x, w = np.ones((4 * 64, 64), np.float32), np.ones((64, 4 * 64), np.float32)
        print(float(f(x, w)[0, 0]), flush=True)
        f(x, w)  # dispatched, not waited for
        print("exiting", len(jax_ub.live_communicators()), flush=True)
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["64.0", "exiting", "1"], res.stdout
    assert "Traceback" not in res.stderr and "finalize at exit failed" not in res.stderr, (
        res.stderr[-3000:]
    )


def test_finalize_after_error_while_failed_result_is_referenced(mesh1d, rand):
    """Re-initialize after an error, when the program still holds the failed result (as a
    training loop holds its last loss): finalize() must not raise, must free the broken
    communicator, and the next call must run on a fresh one."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 2 * 4)
    good = _ag(mesh)
    assert rel_err(good(x, w), to_f32(x) @ to_f32(w)) < 1e-5  # compiled on the communicator

    def rank0_only(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: AG(x, w, "tp", impl="ub"),
            lambda: jnp.zeros((2 * 4, w.shape[1]), x.dtype) + 0 * x[0, 0] + 0 * w[0, 0],
        )

    (comm,) = jax_ub.live_communicators()
    failed = smap(rank0_only, mesh, (P("tp"), P(None, "tp")), P(None, "tp"))(x, w)
    with pytest.raises(jax.errors.JaxRuntimeError, match="timed out"):
        failed.block_until_ready()
    try:
        jax_ub.finalize()
        finalize_error = None
    except jax.errors.JaxRuntimeError as e:
        finalize_error = str(e)
    leaked = comm.id if _host.destroy_communicator(comm.id) else None  # clean up either way
    if finalize_error is not None:
        try:
            out, rerun_error = np.asarray(good(x, w)), None
        except jax.errors.JaxRuntimeError as e:
            out, rerun_error = None, str(e)
        del failed
        jax.clear_caches()
    else:
        del failed
        out, rerun_error = np.asarray(good(x, w)), None
    assert finalize_error is None, f"finalize() raised: {finalize_error}"
    assert leaked is None, f"communicator {leaked} was left alive by finalize()"
    assert rerun_error is None, rerun_error
    assert rel_err(out, to_f32(x) @ to_f32(w)) < 1e-5


# =========================================================================================
# 5. Bad inputs, each with its expected error
# =========================================================================================
# Cases already in test_errors.py (2-D k mismatch, 2-D rows not divisible, 1-D x and 3-D w
# with impl="ub", impl "UB"/"cuda"/""/None, axis_name 0/("tp",)/None on AG, int32 and mixed
# dtypes, configure buffer_size/timeout_s=0/buffer_bytes=-1, initialize buffer_bytes=0) are
# not repeated.


def _np(*shape, dtype=np.float32):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 7 - 3).astype(dtype)


def _call(op, x, w, *, impl="ub", axis="tp", tp=2):
    """A zero-argument callable running `op` under shard_map over a tp-device mesh, x and w
    replicated (so the shapes in the messages are the global ones)."""

    def run():
        mesh = make_mesh((tp, "tp"))
        fn = AG if op == "ag" else RS
        f = smap(lambda x, w: fn(x, w, axis, impl=impl), mesh, (P(), P()), P("tp"))
        return jax.block_until_ready(f(x, w))

    return run


def _x64(make):
    """Run `make()` (which builds its float64 arrays) and its call with jax_enable_x64 on."""

    def run():
        with jax.enable_x64(True):
            return make()()

    return run


def _low_level_create(**kw):
    def run():
        args = dict(group_size=2, slot_devices=[0, 1], capacity_bytes=1024)
        args["options"] = comm_options(timeout_s=kw.pop("timeout_s", 1.0))
        args.update(kw)
        _host.destroy_communicator(_host.create_communicator(**args))

    return run


BAD_INPUTS = [
    # (description, callable, expected exception type(s), regex)
    (
        "ag 1-D w, impl=xla",
        _call("ag", _np(8, 4), _np(4), impl="xla"),
        ValueError,
        r"all_gather_matmul: w must be 2-D \[k, n\], got w.shape=\(4,\)",
    ),
    (
        "rs 1-D x, impl=auto",
        _call("rs", _np(8), _np(8, 4), impl="auto"),
        ValueError,
        r"matmul_reduce_scatter: x must have at least 2 dims \[rows, ..., k\], got x.shape=\(8,\)",
    ),
    (
        "rs 3-D w, impl=xla",
        _call("rs", _np(8, 4), _np(4, 4, 2), impl="xla"),
        ValueError,
        r"matmul_reduce_scatter: w must be 2-D",
    ),
    (
        "ag k mismatch with batch dims",
        _call("ag", _np(8, 3, 16), _np(12, 4)),
        ValueError,
        r"all_gather_matmul: contracting dims differ: x.shape\[-1\]=16 but w.shape\[0\]=12; "
        r"x.shape=\(8, 3, 16\) w.shape=\(12, 4\)",
    ),
    (
        "rs k mismatch with batch dims, impl=xla",
        _call("rs", _np(8, 2, 16), _np(8, 4), impl="xla"),
        ValueError,
        r"matmul_reduce_scatter: contracting dims differ: x.shape\[-1\]=16 but w.shape\[0\]=8",
    ),
    (
        "rs rows not divisible with batch dims",
        _call("rs", _np(6, 2, 8), _np(8, 4), tp=4),
        ValueError,
        r"rows of x \(6\) are not divisible by the size of axis 'tp' \(4\); x.shape=\(6, 2, 8\)",
    ),
    (
        "ag impl 'ub ' (trailing space)",
        _call("ag", _np(8, 4), _np(4, 4), impl="ub "),
        ValueError,
        r"all_gather_matmul: impl must be one of \('auto', 'ub', 'xla'\), got impl='ub '",
    ),
    (
        "rs impl 'XLA'",
        _call("rs", _np(8, 4), _np(4, 4), impl="XLA"),
        ValueError,
        r"matmul_reduce_scatter: impl must be one of .*got impl='XLA'",
    ),
    (
        "rs axis_name tuple",
        _call("rs", _np(8, 4), _np(4, 4), axis=("tp",)),
        ValueError,
        r"matmul_reduce_scatter: axis_name must be one mesh axis name \(str\), got "
        r"axis_name=\('tp',\)",
    ),
    (
        "ag axis_name list",
        _call("ag", _np(8, 4), _np(4, 4), axis=["tp"]),
        ValueError,
        r"all_gather_matmul: axis_name must be one mesh axis name \(str\)",
    ),
    (
        "ag float64 with impl=ub (x64 on)",
        _x64(lambda: _call("ag", jnp.ones((8, 4), jnp.float64), jnp.ones((4, 4), jnp.float64))),
        ValueError,
        r"all_gather_matmul: impl='ub' cannot run this call: dtype float64 is not "
        r"supported \(supported: float32, bfloat16, float16\)",
    ),
    (
        "rs float64 with impl=ub (x64 on)",
        _x64(lambda: _call("rs", jnp.ones((8, 4), jnp.float64), jnp.ones((4, 4), jnp.float64))),
        ValueError,
        r"matmul_reduce_scatter: impl='ub' cannot run this call: dtype float64",
    ),
    (
        "ag complex64 with impl=ub",
        _call("ag", _np(8, 4, dtype=np.complex64), _np(4, 4, dtype=np.complex64)),
        ValueError,
        r"impl='ub' cannot run this call: dtype complex64 is not supported",
    ),
    (
        "rs float16 x, float32 w, impl=ub",
        _call("rs", _np(8, 4, dtype=np.float16), _np(4, 4)),
        ValueError,
        r"matmul_reduce_scatter: impl='ub' cannot run this call: x and w have different dtypes",
    ),
    (
        "initialize buffer_bytes=-1",
        lambda: jax_ub.initialize(make_mesh((2, "tp")), "tp", buffer_bytes=-1),
        ValueError,
        r"buffer_bytes must be positive, got buffer_bytes=-1",
    ),
    (
        "initialize on an axis the mesh lacks (2-D mesh)",
        lambda: jax_ub.initialize(make_mesh((2, "dp"), (2, "tp")), "pp"),
        ValueError,
        r"axis 'pp' is not in the mesh; mesh.axis_names=\('dp', 'tp'\)",
    ),
    (
        "configure unknown key 'timeout'",
        lambda: jax_ub.configure(timeout=5.0),
        ValueError,
        r"unknown jax_ub setting 'timeout'; known: \['buffer_bytes', 'timeout_s', 'allow_grow', "
        r"'allow_tf32'\]",
    ),
    (
        "configure two unknown keys",
        lambda: jax_ub.configure(buffers=1, grow=True),
        ValueError,
        r"unknown jax_ub setting 'buffers', 'grow'",
    ),
    (
        "configure timeout_s=-0.5",
        lambda: jax_ub.configure(timeout_s=-0.5),
        ValueError,
        r"timeout_s must be positive and finite, got -0.5",
    ),
    (
        "configure buffer_bytes=-4096",
        lambda: jax_ub.configure(buffer_bytes=-4096),
        ValueError,
        r"buffer_bytes must be >= 0",
    ),
    (
        "low-level create, timeout -1 s",
        _low_level_create(timeout_s=-1.0),
        ValueError,
        r"timeout must be positive and finite, got -1 s",
    ),
    (
        "low-level create, group of 3 over 4 slots",
        _low_level_create(group_size=3, slot_devices=[0, 1, 2, 3]),
        ValueError,
        r"number of slots 4 is not a positive multiple of the group size 3",
    ),
    pytest.param(
        "configure timeout_s=nan",
        lambda: jax_ub.configure(timeout_s=math.nan),
        ValueError,
        r"timeout_s",
        id="configure timeout_s=nan",
    ),
    pytest.param(
        "configure timeout_s=inf",
        lambda: jax_ub.configure(timeout_s=math.inf),
        ValueError,
        r"timeout_s",
        id="configure timeout_s=inf",
    ),
    pytest.param(
        "low-level create, timeout nan",
        _low_level_create(timeout_s=math.nan),
        ValueError,
        r"timeout",
        id="low-level create, timeout nan",
    ),
    pytest.param(
        "configure timeout_s='5'",
        lambda: jax_ub.configure(timeout_s="5"),
        (TypeError, ValueError),
        r"timeout_s",
        id="configure timeout_s='5'",
    ),
    pytest.param(
        "configure buffer_bytes=1.5",
        lambda: jax_ub.configure(buffer_bytes=1.5),
        (TypeError, ValueError),
        r"buffer_bytes",
        id="configure buffer_bytes=1.5",
    ),
]


def _case_id(case):
    return case[0] if isinstance(case, tuple) else None


@pytest.mark.parametrize(
    "description,call,error,match",
    BAD_INPUTS,
    ids=[_case_id(c) for c in BAD_INPUTS],
)
def test_bad_input(description, call, error, match):
    before = _host.num_communicators()
    with pytest.raises(error, match=match):
        call()
    assert _host.num_communicators() == before, f"{description}: a communicator was left behind"


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_timeout_env_var_is_validated(monkeypatch, value):
    monkeypatch.setenv("JAX_UB_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=r"JAX_UB_TIMEOUT_S"):
        jax_ub.Config()  # what `import jax_ub` builds from the environment


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_empty_contraction(op):
    x, w = np.ones((8, 0), np.float32), np.ones((0, 4), np.float32)
    try:
        out = _call(op, x, w)()
    except ValueError as e:
        assert re.search(r"\bk\b", str(e)), str(e)
        return
    np.testing.assert_array_equal(np.asarray(out), 0)


# =========================================================================================
# 6. A process killed in the middle of a multi-process run
# =========================================================================================


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_killed_process_fails_peers_within_deadline_then_recovers(platform):
    """Three processes, one device each, one tp group across them (shared memory). After 3
    good ops the last process SIGKILLs itself (tests/_mp_fault_worker.py). The two survivors
    must fail their next op within JAX_UB_TIMEOUT_S=5 with an error naming the op and rank 2
    (and the call numbers: expected #4, observed #3), fail the op after that at once (broken),
    and after finalize() run both ops correctly on a mesh of the two survivors. Nothing may
    be left in /dev/shm by any of the three."""
    timeout_s, nproc = 5, 3
    if platform == "gpu":  # one GPU per process; on GPUs step 1 gives NaN + check_health()
        if _gpu_count() < 2:
            pytest.skip("needs at least 2 GPUs")
        nproc = min(3, _gpu_count())
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_UB_TIMEOUT_S"] = str(timeout_s)
    env["JAX_UB_TEST_GPU"] = "1" if platform == "gpu" else "0"
    procs = [
        subprocess.Popen(
            [sys.executable, FAULT_WORKER, "killed_peer", str(i), str(nproc), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(nproc)
    ]
    deadline = time.monotonic() + 120
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the processes hung (not ended 120 s after start)")
        out.append((p.returncode, text))

    victim_code, victim_text = out[-1]
    assert victim_code == -signal.SIGKILL, victim_text[-2000:]
    assert "KILLING myself" in victim_text, victim_text[-2000:]
    for rank, (code, text) in enumerate(out[:-1]):
        assert code == 0, f"process {rank}:\n{text[-3000:]}"
        (line,) = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[len("RESULT ") :])
        op = r["failed_op"]
        dead = nproc - 1
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
        assert r["finalize_seconds"] < timeout_s + 5, r["finalize_seconds"]
        assert len(r["rerun_errs"]) == 4 and max(r["rerun_errs"]) < 1e-5, r["rerun_errs"]
        assert r["comms"] == [nproc - 1], r  # the re-run's communicator: the survivors
    for p in procs:
        assert _shm_names(f"jax_ub_{p.pid}_") == [], f"process {p.pid} left /dev/shm entries"


# =========================================================================================
# 7. GPU variants (skipped without at least 2 GPUs; results in tests/RELIABILITY.md)
# =========================================================================================

GPUS = gpus()
GPU_TPS = sorted({2, len(GPUS)}) if len(GPUS) >= 2 else [2]
needs_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs at least 2 GPUs")


def _gpu_mesh(tp: int) -> Mesh:
    return Mesh(np.array(GPUS[:tp]), ("tp",))


@pytest.mark.gpu
@needs_gpus
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
    first = [_bits(o) for o in f(x, w, h, v)]
    for run in range(4):
        for i, o in enumerate(f(x, w, h, v)):
            np.testing.assert_array_equal(_bits(o), first[i], err_msg=f"run {run}, output {i}")
    jax_ub.finalize()


@pytest.mark.gpu
@needs_gpus
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_nan_inf_pass_through(op, dtype):
    """The CPU test's NaN/Inf placement on GPUs, against XLA's collectives at full precision."""
    tp = len(GPUS)
    mesh = _gpu_mesh(tp)
    make, fn = (_special_ag_inputs, _ag) if op == "ag" else (_special_rs_inputs, _rs)
    x, w = make(tp, dtype, m=64, k=128, n=64)
    with jax.default_matmul_precision("highest"):
        want = fn(mesh, "xla")(x, w)
    _assert_same_specials(fn(mesh, "ub")(x, w), want, dtype)


@pytest.mark.gpu
@needs_gpus
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
    good = _ag(mesh)
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


@pytest.mark.gpu
@needs_gpus
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


@pytest.mark.gpu
@needs_gpus
def test_gpu_hundred_initialize_finalize_rounds_leak_nothing():
    """The CPU lifecycle test on 2 GPUs: 100 rounds of initialize (64 MiB userbuffer per
    GPU, flags, streams, a cuBLASLt handle and workspace, a watchdog thread) / both ops /
    finalize. After 10 warm-up rounds: free GPU memory (cudaMemGetInfo; one leaked round is
    over 96 MiB per GPU), open file descriptors and threads must not grow, no communicator
    may stay registered, and every round gives the same bits."""
    from jax_ub._src import _cuda

    mesh = _gpu_mesh(2)
    ordinals = [d.local_hardware_id for d in mesh.devices.flat]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2 * 256, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 2 * 128)) / 23, jnp.bfloat16)
    ag, rs = _ag(mesh), _rs(mesh)

    def snapshot():
        free = [_cuda.memory_info(o)[0] >> 20 for o in ordinals]
        return free, _open_fds(), len(os.listdir("/proc/self/task"))

    first, samples = None, {}
    for i in range(100):
        jax_ub.initialize(mesh, "tp", buffer_bytes=64 << 20)
        out = [_bits(ag(x, w)), _bits(rs(ag(x, w), w.T))]
        if first is None:
            first = out
        for a, b in zip(out, first):
            np.testing.assert_array_equal(a, b, err_msg=f"round {i}")
        jax_ub.finalize()
        assert _cuda.num_communicators() == 0
        if i in (9, 99):
            samples[i] = snapshot()
    (free0, fd0, th0), (free1, fd1, th1) = samples.values()
    assert all(a - b < 48 for a, b in zip(free0, free1)), f"free MiB {free0} -> {free1}"
    assert fd1 - fd0 <= 2, f"open file descriptors grew {fd0} -> {fd1}"
    assert th1 - th0 <= 1, f"threads grew {th0} -> {th1}"
