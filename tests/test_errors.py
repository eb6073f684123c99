"""Wrong calls fail early with a clear message; peer failures surface as runtime errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ag_fn as _ag
from conftest import comm_options, rel_err, smap, to_f32
from conftest import rs_fn as _rs
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host, options

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("impl", ["ub", "xla", "auto"])
def test_rows_not_divisible(mesh1d, rand, impl):
    x, w = rand(6, 2 * 8), rand(2 * 8, 4)  # 6 rows over 4 ranks
    with pytest.raises(ValueError, match=r"rows of x \(6\) are not divisible .*'tp' \(4\)"):
        _rs(mesh1d(4), impl)(x, w)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_mismatched_k(mesh1d, rand, op):
    mesh = mesh1d(2)
    if op == "ag":
        f, x, w = _ag(mesh), rand(2 * 4, 16), rand(12, 2 * 4)
    else:
        f, x, w = _rs(mesh), rand(2 * 4, 2 * 8), rand(2 * 6, 4)
    with pytest.raises(ValueError, match=r"contracting dims differ"):
        f(x, w)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bad_ranks(mesh1d, rand, op):
    mesh = mesh1d(2)
    with pytest.raises(ValueError, match=r"x must have at least 2 dims"):
        smap(
            lambda x, w: (AG if op == "ag" else RS)(x, w, "tp", impl="ub"),
            mesh,
            (P("tp"), P()),
            P("tp"),
        )(rand(16), rand(8, 4))
    with pytest.raises(ValueError, match=r"w must be 2-D"):
        smap(
            lambda x, w: (AG if op == "ag" else RS)(x, w, "tp", impl="ub"),
            mesh,
            (P("tp"), P()),
            P("tp"),
        )(rand(4, 8), rand(8, 4, 1))


@pytest.mark.parametrize("impl", ["ub", "xla", "auto"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_unknown_axis_inside_shard_map(mesh1d, rand, impl, op):
    mesh = mesh1d(2)
    f = _ag(mesh, impl, axis="dp") if op == "ag" else _rs(mesh, impl, axis="dp")
    with pytest.raises(ValueError, match=r"axis 'dp' is not in the mesh"):
        f(rand(2 * 4, 2 * 4), rand(2 * 4, 2 * 4))


@pytest.mark.parametrize("axis", [0, ("tp",), None])
def test_axis_name_not_a_string(mesh1d, rand, axis):
    with pytest.raises(ValueError, match=r"axis_name must be one mesh axis name \(str\)"):
        _ag(mesh1d(2), axis=axis)(rand(2 * 4, 8), rand(8, 2 * 4))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_outside_shard_map(rand, jit, op):
    fn = AG if op == "ag" else RS
    f = lambda x, w: fn(x, w, "tp", impl="ub")  # noqa: E731
    if jit:
        f = jax.jit(f)
    with pytest.raises(ValueError, match=r"axis 'tp' is not bound; call .* inside jax.shard_map"):
        f(rand(8, 8), rand(8, 8))


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_unsupported_dtype_with_ub(mesh1d, op):
    x = jnp.asarray(np.arange(2 * 4 * 8, dtype=np.int32).reshape(2 * 4, 8) + 1)
    w = jnp.asarray(np.arange(8 * 8, dtype=np.int32).reshape(8, 8) + 1)
    f = _ag(mesh1d(2)) if op == "ag" else _rs(mesh1d(2))
    with pytest.raises(ValueError, match=r"impl='ub' cannot run this call: dtype int32 is not"):
        f(x, w)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_mixed_dtypes_with_ub(mesh1d, rand, op):
    x, w = rand(2 * 4, 8), rand(8, 8, dtype=jnp.bfloat16)
    f = _ag(mesh1d(2)) if op == "ag" else _rs(mesh1d(2))
    with pytest.raises(ValueError, match=r"impl='ub' cannot run this call: x and w have different"):
        f(x, w)


@pytest.mark.parametrize("impl", ["UB", "cuda", "", None])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bad_impl(mesh1d, rand, impl, op):
    f = _ag(mesh1d(2), impl) if op == "ag" else _rs(mesh1d(2), impl)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'ub', 'xla'\)"):
        f(rand(2 * 4, 8), rand(8, 8))


def test_auto_falls_back_to_xla_for_int32(mesh1d):
    mesh = mesh1d(4)
    x = jnp.asarray((np.arange(4 * 2 * 8, dtype=np.int32).reshape(4 * 2, 8) % 7) - 3)
    w = jnp.asarray((np.arange(8 * 4 * 4, dtype=np.int32).reshape(8, 4 * 4) % 5) - 2)
    f = _ag(mesh, "auto")
    text = f.lower(x, w).as_text()
    assert "jax_ub_all_gather_matmul" not in text
    out = f(x, w)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) @ np.asarray(w))

    xr = jnp.asarray((np.arange(4 * 4 * 4 * 2, dtype=np.int32).reshape(4 * 4, 4 * 2) % 5) - 2)
    wr = jnp.asarray((np.arange(4 * 2 * 4, dtype=np.int32).reshape(4 * 2, 4) % 3) - 1)
    g = _rs(mesh, "auto")
    assert "jax_ub_matmul_reduce_scatter" not in g.lower(xr, wr).as_text()
    np.testing.assert_array_equal(np.asarray(g(xr, wr)), np.asarray(xr) @ np.asarray(wr))


def _no_peer_access(monkeypatch):
    """Every group of this process looks like GPUs without peer access."""
    from jax_ub._src import communicator

    def refuse(module, key, devices, ordinals):
        raise communicator.PeersUnreachable(
            f"devices {[d.id for d in devices[: key.group_size]]} cannot share memory (test)"
        )

    jax_ub.finalize()
    monkeypatch.setattr(communicator, "_check_peer_access", refuse)
    # What this test learns about unreachable groups goes with it, even if it fails.
    monkeypatch.setattr(communicator, "_unreachable", {})
    monkeypatch.setattr(communicator, "_warned", set())


def test_auto_falls_back_to_xla_where_peers_cannot_share_memory(mesh1d, rand, monkeypatch):
    """Forward and gradient of both ops under impl="auto" lower to XLA's collectives, with
    one warning, and equal the reference."""
    _no_peer_access(monkeypatch)
    mesh = mesh1d(4)
    x, w1, w2 = rand(4 * 8, 16), rand(16, 4 * 8), rand(4 * 8, 16)

    def loss(impl):
        def body(x, w1, w2):
            h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
            y = jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", impl=impl)
            return lax.psum(jnp.sum(jnp.sin(y)), "tp")

        f = smap(body, mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P())
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    with pytest.warns(UserWarning, match=r"impl='auto' uses XLA's collectives on axis 'tp'"):
        text = loss("auto").lower(x, w1, w2).as_text()
    assert "jax_ub_" not in text
    (l_auto, g_auto), (l_ref, g_ref) = loss("auto")(x, w1, w2), loss("xla")(x, w1, w2)
    assert rel_err(l_auto, l_ref) < 1e-6
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(g_auto, g_ref))
    jax_ub.finalize()


def test_ub_raises_where_peers_cannot_share_memory(mesh1d, rand, monkeypatch):
    _no_peer_access(monkeypatch)
    with pytest.raises(ValueError, match=r"impl='ub' cannot run on this mesh: devices \["):
        _ag(mesh1d(4), "ub")(rand(4 * 2, 8), rand(8, 4 * 4))
    jax_ub.finalize()


def test_auto_falls_back_to_xla_for_mixed_dtypes(mesh1d, rand):
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 2 * 4, dtype=jnp.bfloat16)
    f = _ag(mesh, "auto")
    assert "jax_ub_all_gather_matmul" not in f.lower(x, w).as_text()
    assert rel_err(f(x, w), to_f32(x) @ to_f32(w)) < 1e-5


# --------------------------------------------------------------------------- configuration


def test_buffer_too_small_without_growth(mesh1d, rand):
    """An op needing more than the existing communicator holds fails at trace time."""
    mesh = mesh1d(2)
    jax_ub.finalize()
    jax_ub.configure(buffer_bytes=4096, allow_grow=False)
    try:
        # Fits: 2 ranks x (4 x 16 float32) = 512 bytes; creates the 4096-byte communicator.
        x_s, w = rand(2 * 4, 16), rand(16, 2 * 4)
        assert rel_err(_ag(mesh)(x_s, w), to_f32(x_s) @ to_f32(w)) < 1e-5
        (comm,) = jax_ub.live_communicators()
        assert comm.capacity_bytes == 4096
        # Needs 2 ranks x (64 x 16 float32) = 8192 bytes.
        with pytest.raises(
            ValueError,
            match=r"userbuffer too small for this op: it needs 8192 "
            r"bytes.*has 4096.*allow_grow=True",
        ):
            _ag(mesh)(rand(2 * 64, 16), w)
        with pytest.raises(ValueError, match=r"userbuffer too small"):
            _rs(mesh)(rand(2 * 64, 2 * 8), rand(2 * 8, 16))
        assert [c.id for c in jax_ub.live_communicators()] == [comm.id]
        assert comm.capacity_bytes == 4096
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(buffer_size=1), r"unknown jax_ub setting 'buffer_size'"),
        (dict(timeout_s=0), r"timeout_s must be positive"),
        (dict(buffer_bytes=-1), r"buffer_bytes must be >= 0"),
        (dict(allow_grow=1), r"allow_grow must be True or False, got 1 \(jax_ub.configure"),
        # Tuning choices are internal, not user settings.
        (dict(gemm_order="row"), r"unknown jax_ub setting 'gemm_order'"),
    ],
)
def test_configure_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_ub.configure(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduce_scatter_fold_rows=True), r"reduce_scatter_fold_rows must be an integer"),
        (dict(gemm_trials=-1), r"gemm_trials must be an integer >= 0, got -1"),
        (dict(gemm_trials=2.5), r"gemm_trials must be an integer >= 0, got 2.5"),
        (
            dict(gemm_order="rows"),
            r"gemm_order must be one of \('auto', 'column', 'row'\), got 'rows'",
        ),
        (dict(timeout_s=1.0), r"unknown tuning choice \['timeout_s'\]"),
    ],
)
def test_experimental_tuning_rejects_bad_values(kwargs, match):
    before = options.tuning()
    with pytest.raises(ValueError, match=match):
        with options.experimental_tuning(**kwargs):
            pass
    assert options.tuning() == before


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("JAX_UB_TIMEOUT_S", "-3", r"timeout_s must be positive .*JAX_UB_TIMEOUT_S='-3'"),
        (
            "JAX_UB_BUFFER_BYTES",
            "lots",
            r"buffer_bytes: environment variable "
            r"JAX_UB_BUFFER_BYTES='lots' is not a valid value",
        ),
    ],
)
def test_env_var_errors_name_the_variable(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        jax_ub.Config()  # what `import jax_ub` builds from the environment


def test_configure_error_leaves_config_unchanged():
    """A rejected configure() must not leave the rejected value (or part of it) behind.

    Otherwise the bad value sticks: every later configure() call fails on it, and the next
    communicator is created with it, failing far from the call that caused it.
    """
    before = dataclasses.asdict(jax_ub.config)
    with pytest.raises(ValueError):
        jax_ub.configure(timeout_s=-1.0)
    assert dataclasses.asdict(jax_ub.config) == before
    jax_ub.configure(buffer_bytes=1 << 20)  # a valid change still goes through
    with pytest.raises(ValueError):
        jax_ub.configure(buffer_bytes=1 << 21, no_such_setting=1)
    assert jax_ub.config.buffer_bytes == 1 << 20


def test_initialize_rejects_bad_arguments(mesh1d):
    with pytest.raises(ValueError, match=r"axis 'dp' is not in the mesh"):
        jax_ub.initialize(mesh1d(2), "dp")
    with pytest.raises(ValueError, match=r"buffer_bytes must be positive"):
        jax_ub.initialize(mesh1d(2), "tp", buffer_bytes=0)


# --------------------------------------------------------------------------- runtime failures


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
    jax_ub.finalize()
    jax_ub.configure(timeout_s=0.5)
    x, w = rand(2 * 4, 8), rand(8, 4)
    f = _only_rank0_calls(mesh, 2 * 4)
    try:
        with pytest.raises(
            jax.errors.JaxRuntimeError,
            match=r"DEADLINE_EXCEEDED: jax_ub: "
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
    finally:
        jax_ub.finalize()
    # ... and after finalize() the same program runs again (traced afresh).
    w2 = rand(8, 2 * 4)
    assert rel_err(_ag(mesh)(x, w2), to_f32(x) @ to_f32(w2)) < 1e-5


def test_ranks_disagree_on_the_call(mesh1d, rand):
    """Ranks that run the op with different shapes get an error naming both calls."""
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 6)

    def body(x, w):
        return lax.cond(
            lax.axis_index("tp") == 0,
            lambda: AG(x, w, "tp", impl="ub"),
            lambda: jnp.pad(AG(x, w[:, :4], "tp", impl="ub"), ((0, 0), (0, 2))),
        )

    f = smap(body, mesh, in_specs=(P("tp"), P()), out_specs=P("tp"))
    try:
        with pytest.raises(
            jax.errors.JaxRuntimeError,
            match=r"ranks disagree on the call: rank "
            r"\d runs all_gather_matmul\(float32, rows=4, k=16, n=\d.*but rank \d "
            r"sent all_gather_matmul\(float32, rows=4, k=16, n=\d",
        ):
            jax.block_until_ready(f(x, w))
    finally:
        jax_ub.finalize()


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

    def call(x, w):
        return jax.ffi.ffi_call(
            "jax_ub_all_gather_matmul",
            (
                jax.ShapeDtypeStruct((out_rows, n), dtype),
                jax.ShapeDtypeStruct((0, x.shape[1]), dtype),
            ),
            has_side_effect=True,
        )(x, w, comm_id=np.int64(cid), transpose_w=False)

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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=0, slot_devices=[0]), r"group size 0 is not in \[1, 64\]"),
        (dict(group_size=65, slot_devices=list(range(65))), r"group size 65 is not in"),
        (dict(group_size=2, slot_devices=[0, 1, 2]), r"number of slots 3 is not a positive"),
        (dict(group_size=2, slot_devices=[]), r"number of slots 0"),
        (dict(group_size=2, slot_devices=[0, 0]), r"device 0 appears twice"),
        (
            dict(group_size=2, slot_devices=[0, 1], options=comm_options(timeout_s=0.0)),
            r"timeout must be positive",
        ),
        (
            dict(group_size=1, slot_devices=[0], options={"timeout_s": 1.0}),
            r"missing communicator option allow_tf32",
        ),
        (
            dict(group_size=1, slot_devices=[0], options=comm_options(fold=1)),
            r"unknown communicator option fold",
        ),
    ],
)
def test_low_level_create_rejects(kwargs, match):
    before = _host.num_communicators()
    kw = dict(capacity_bytes=1024, options=comm_options(timeout_s=1.0))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _host.create_communicator(**kw)
    assert _host.num_communicators() == before
