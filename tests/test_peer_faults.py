"""Timeouts and peer faults in one process: a peer that never calls the op, calls it late,
calls it once too few times or runs a different call; what the error names (the op, the
ranks and group, the call numbers), how fast it comes, the broken communicator after it,
and recovery by finalize(). Also the raw custom call on a communicator of the extension.
Finalize after a fault, and leaks, are in test_teardown.py."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ag_fn as _ag
from conftest import comm_options, rel_err, smap, to_f32
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host
from jax_ub._src.runtime import extension

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter


pytestmark = pytest.mark.usefixtures("fresh_communicators")


def _expect_failure(fn, *args):
    """Runs fn(*args) to completion, which must fail; returns (message, seconds).

    Only the message leaves this function: the failed result must not stay referenced,
    since jax_ub.finalize() waits on every live array (see test_teardown.py's
    test_finalize_after_error_while_failed_result_is_referenced)."""
    t0 = time.monotonic()
    try:
        jax.block_until_ready(fn(*args))
    except jax.errors.JaxRuntimeError as e:
        return str(e), time.monotonic() - t0
    pytest.fail(f"{fn} was expected to fail but returned a result")


def _expect_failure_naming(fn, args, pattern: str, within_s: float) -> str:
    """Runs fn(*args), which must fail within ``within_s`` seconds with a message matching
    ``pattern``; returns the message."""
    msg, seconds = _expect_failure(fn, *args)
    assert re.search(pattern, msg), msg
    assert seconds < within_s, seconds
    return msg


def _two_branch(mesh, rank0, others):
    """Rank 0 runs `rank0(x, w)`, the other ranks `others(x, w)` (same output shape)."""
    body = lambda x, w: lax.cond(lax.axis_index("tp") == 0, rank0, others, x, w)  # noqa: E731
    return smap(body, mesh, (P("tp"), P()), P("tp"))


def _only_rank0_calls(mesh, n_out):
    """Rank 0 runs the op; the others skip it (a peer that never arrives)."""

    def body(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: AG(x, w, "tp", impl="ub"),
            lambda: jnp.zeros((n_out, w.shape[1]), x.dtype) + 0 * x[0, 0],
        )

    return smap(body, mesh, in_specs=(P("tp"), P()), out_specs=P("tp"))


def test_peer_timeout(mesh1d, rand):
    """A rank whose peer never calls the op fails after timeout_s with the rank named."""
    mesh = mesh1d(2)
    jax_ub.configure(timeout_s=0.5)
    x, w = rand(2 * 4, 8), rand(8, 4)
    f = _only_rank0_calls(mesh, 2 * 4)
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        # JAX 0.9 puts "Buffer Definition Event: " before the handler's message.
        match=r"DEADLINE_EXCEEDED: (Buffer Definition Event: )?jax_ub: "
        r"all_gather_matmul: rank 0 \(group 0\) timed out after 0\.5 s "
        r"waiting for rank 1 to deliver its chunk",
    ):
        jax.block_until_ready(f(x, w))
    # The communicator is now broken: later calls fail fast and say how to recover.
    g = _ag(mesh)
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"communicator is broken by an "
        r"earlier error .*timed out.*call jax_ub.finalize\(\)",
    ):
        jax.block_until_ready(g(x, rand(8, 2 * 4)))
    jax_ub.finalize()
    # ... and after finalize() the same program runs again (traced afresh).
    w2 = rand(8, 2 * 4)
    assert rel_err(_ag(mesh)(x, w2), to_f32(x) @ to_f32(w2)) < 1e-5


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
    _expect_failure_naming(
        f,
        (x, w),
        r"all_gather_matmul: rank 0 \(group 0\) timed out after 0\.5 s waiting for rank 1 to "
        r"deliver its chunk for call #1 \(flag holds #0\)",
        within_s=1.5 + 3.0,
    )
    # JAX keeps the failed program's runtime token (it has a host callback) and would raise
    # it again from jax.effects_barrier() and at exit; a good callback program replaces it.
    echo = lambda a: jax.pure_callback(lambda b: b, jax.ShapeDtypeStruct(a.shape, a.dtype), a)  # noqa: E731
    jax.block_until_ready(smap(echo, mesh, P("tp"), P("tp"))(x))
    jax.effects_barrier()
    jax_ub.finalize()
    w2 = rand(16, 2 * 4)
    assert rel_err(_ag(mesh)(x, w2), to_f32(x) @ to_f32(w2)) < 1e-5


@pytest.mark.parametrize("mismatch", ["op", "dtype", "k", "n"])
def test_ranks_disagree_name_both_calls(mesh1d, rand, mismatch):
    """Ranks that run different calls (another op, dtype, k or n) get an error naming both
    sides' calls (op, dtype, shape, call number) once the timeout passes, never a hang or a
    wrong result. The branches' calls have different sites: rank 1 holds its own while it
    waits for rank 0's, and rank 0's timeout names what rank 1 holds (or rank 1's, what rank 0
    ran)."""
    jax_ub.configure(timeout_s=2.0)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 6 if mismatch == "n" else 8)
    ag = lambda x, w: AG(x, w, "tp", impl="ub")  # noqa: E731  [8, n] per rank
    mine = "all_gather_matmul(float32, rows=4, k=16, n=8, call #1)"
    if mismatch == "op":
        # [8, 16] @ [16, 8], reduce-scattered to [4, 8], padded to AG's [8, 8].
        other = lambda x, w: jnp.pad(  # noqa: E731
            RS(jnp.concatenate([x, x]), w, "tp", impl="ub"), ((0, 4), (0, 0))
        )
        theirs = "matmul_reduce_scatter(float32, rows=4, k=16, n=8, call #1)"
    elif mismatch == "dtype":
        other = lambda x, w: AG(  # noqa: E731
            x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), "tp", impl="ub"
        ).astype(jnp.float32)
        theirs = "all_gather_matmul(bfloat16, rows=4, k=16, n=8, call #1)"
    elif mismatch == "k":
        other = lambda x, w: AG(x[:, :12], w[:12], "tp", impl="ub")  # noqa: E731
        theirs = "all_gather_matmul(float32, rows=4, k=12, n=8, call #1)"
    else:
        other = lambda x, w: jnp.pad(AG(x, w[:, :4], "tp", impl="ub"), ((0, 0), (0, 2)))  # noqa: E731
        mine = "all_gather_matmul(float32, rows=4, k=16, n=6, call #1)"
        theirs = "all_gather_matmul(float32, rows=4, k=16, n=4, call #1)"
    msg, seconds = _expect_failure(_two_branch(mesh, ag, other), x, w)
    leader = f"rank 1 holds {theirs} in place of this rank's {mine}"
    other_side = f"rank 0 of the group ran {mine}, and this device's program did not make "
    assert leader in msg or (other_side in msg and f"it made {theirs} in its place" in msg), msg
    assert "the ranks run different branches or programs" in msg, msg
    assert 2.0 * 0.9 < seconds < 2.0 + 3.0, seconds


def test_call_count_mismatch_names_expected_and_observed(mesh1d, rand):
    """Rank 0 runs the op twice, rank 1 once (a loop of rank-dependent length): rank 0's
    second call times out, reporting the call number it waited for (#2) and the one its
    peer's flag holds (#1)."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 8)

    def body(x, w):
        trips = jnp.where(lax.axis_index("tp") == 0, 2, 1)
        step = lambda i, y: y + AG(x + 0 * y[:4, :1], w, "tp", impl="ub")  # noqa: E731
        return lax.fori_loop(0, trips, step, jnp.zeros((8, 8), x.dtype) + 0 * x[:1, :1])

    _expect_failure_naming(
        smap(body, mesh, (P("tp"), P()), P("tp")),
        (x, w),
        r"DEADLINE_EXCEEDED: (Buffer Definition Event: )?jax_ub: all_gather_matmul: rank 0 "
        r"\(group 0\) timed out after 0\.5 s"
        r" waiting for rank 1 to deliver its chunk for call #2 \(flag holds #1\)",
        within_s=0.5 + 3.0,
    )


def test_equal_calls_from_different_places_never_pair(mesh1d, rand):
    """Rank 0 runs the op twice, rank 1 once, in the other branch of a cond: rank 1's call
    does what rank 0's first does but comes from another place in the program, which on
    CPU could be a copy XLA started in another order, so it never pairs (it could pair the
    wrong data). Both ranks fail within the timeout, naming the call."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 8)

    def twice(x, w):
        y = AG(x, w, "tp", impl="ub")
        return AG(x + 0 * y[:4, :1], w, "tp", impl="ub")

    once = lambda x, w: AG(x, w, "tp", impl="ub")  # noqa: E731
    _expect_failure_naming(
        _two_branch(mesh, twice, once),
        (x, w),
        r"rank 0 \(group 0\) timed out after 0\.5 s waiting for rank 1 to deliver its chunk for "
        r"call #1 \(flag holds #0\)|rank 0 of the group ran all_gather_matmul\(float32, rows=4, "
        r"k=16, n=8, call #1\), and this device's program did not make that call",
        within_s=0.5 + 3.0,
    )


def test_finalized_communicator_in_compiled_program(mesh1d, rand):
    """An AOT-compiled program outlives finalize(): it fails clearly instead of crashing."""
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 2 * 4)
    compiled = _ag(mesh).lower(x, w).compile()
    assert rel_err(compiled(x, w), to_f32(x) @ to_f32(w)) < 1e-5
    jax_ub.finalize()
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"communicator was finalized"):
        jax.block_until_ready(compiled(x, w))


# --------------------------------------------------------------------------- low-level extension


def _ffi_all_gather_matmul(cid, out_rows, n, dtype=jnp.float32):
    """The raw custom call on whatever device jit puts it, bypassing the Python checks."""
    extension.register_cpu_handlers()  # as lowering a jax_ub op does

    def call(x, w):
        no_bias, no_gelu_input = jnp.zeros((0,), dtype), jnp.zeros((0, n), dtype)
        return jax.ffi.ffi_call(
            "jax_ub_all_gather_matmul",
            (
                jax.ShapeDtypeStruct((out_rows, n), dtype),
                jax.ShapeDtypeStruct((0, x.shape[1]), dtype),  # no gathered copy
                jax.ShapeDtypeStruct((0, n), dtype),  # no kept GELU input
            ),
            has_side_effect=True,
        )(
            x,
            w,
            jnp.ones((8,), jnp.float32),
            no_bias,
            no_gelu_input,
            comm_id=np.int64(cid),
            transpose_w=False,
            gelu=False,
            dgelu=False,
            site=np.int64(1),  # the call's id from the lowering (CPU)
            lowering=np.int64(1),  # which lowering of this process (CPU)
        )

    return jax.jit(call)


@pytest.fixture
def host_comm():
    """host_comm(**kw) -> id of a raw host communicator, destroyed after the test."""
    ids = []

    def create(group_size=2, slot_devices=(0, 1), capacity_bytes=1 << 20, timeout_s=0.5):
        cid = _host.create_communicator(
            group_size=group_size,
            slot_devices=list(slot_devices),
            capacity_bytes=capacity_bytes,
            options=comm_options(timeout_s=timeout_s),
        )
        ids.append(cid)
        return cid

    yield create
    for cid in ids:
        _host.destroy_communicator(cid)


def test_low_level_peer_timeout(host_comm, rand):
    """Device 0 is rank 0 of a 2-rank group whose rank 1 (device 1) never runs."""
    cid = host_comm(timeout_s=0.5)
    f = _ffi_all_gather_matmul(cid, 2 * 4, 6)
    x, w = rand(4, 8), rand(8, 6)
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"DEADLINE_EXCEEDED.*rank 0 \(group 0\) "
        r"timed out after 0\.5 s waiting for rank 1 .*call #1 \(flag holds #0\)",
    ):
        jax.block_until_ready(f(x, w))


def test_low_level_device_not_in_communicator(host_comm, rand):
    cid = host_comm(slot_devices=(4, 5))
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"device ordinal 0 is not part of this communicator's mesh",
    ):
        jax.block_until_ready(_ffi_all_gather_matmul(cid, 2 * 4, 6)(rand(4, 8), rand(8, 6)))


def test_low_level_buffer_too_small_at_runtime(host_comm, rand):
    cid = host_comm(group_size=1, slot_devices=(0,), capacity_bytes=64)
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"INVALID_ARGUMENT.*userbuffer too small"
        r": the op needs 128 bytes per device",
    ):
        jax.block_until_ready(_ffi_all_gather_matmul(cid, 4, 6)(rand(4, 8), rand(8, 6)))


def test_low_level_destroyed_communicator(host_comm, rand):
    cid = host_comm(group_size=1, slot_devices=(0,))
    f = _ffi_all_gather_matmul(cid, 4, 6)
    x, w = rand(4, 8), rand(8, 6)
    assert rel_err(f(x, w)[0], to_f32(x) @ to_f32(w)) < 1e-5  # a 1-rank group runs alone
    assert _host.destroy_communicator(cid) is True
    assert _host.destroy_communicator(cid) is False
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"FAILED_PRECONDITION.*finalized"):
        jax.block_until_ready(f(x, w))
