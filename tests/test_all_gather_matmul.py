"""all_gather_matmul(impl="ub") against the lax reference (impl="xla")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices, rel_err, smap, to_f32, tol
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub

AG = jax_ub.all_gather_matmul


def _ag_1d(mesh, impl, **kw):
    """x row-sharded, w column-sharded over tp: the global result is x @ w."""
    return smap(
        lambda x, w: AG(x, w, "tp", impl=impl, **kw),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )


def _check(mesh, x, w, dtype):
    out = _ag_1d(mesh, "ub")(x, w)
    ref = _ag_1d(mesh, "xla")(x, w)
    assert out.shape == ref.shape == (x.shape[0], w.shape[1])
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert rel_err(out, ref) < tol(dtype)
    # And against the plain product, so a wrong reference cannot hide a wrong result.
    assert rel_err(out, to_f32(x) @ to_f32(w)) < tol(dtype)


# (rows per rank m, k, columns per rank n)
SHAPES = [(8, 16, 8), (4, 48, 16), (3, 20, 7)]


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}k{}n{}".format(*s))
def test_f32(mesh1d, rand, n_dev, shape):
    m, k, n = shape
    x = rand(n_dev * m, k)
    w = rand(k, n_dev * n)
    _check(mesh1d(n_dev), x, w, jnp.float32)


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
def test_bf16(mesh1d, rand, n_dev):
    x = rand(n_dev * 8, 32, dtype=jnp.bfloat16)
    w = rand(32, n_dev * 12, dtype=jnp.bfloat16)
    _check(mesh1d(n_dev), x, w, jnp.bfloat16)


@pytest.mark.parametrize("n_dev", [2, 4])
def test_f16(mesh1d, rand, n_dev):
    x = rand(n_dev * 8, 32, dtype=jnp.float16, scale=0.5)
    w = rand(32, n_dev * 8, dtype=jnp.float16, scale=0.5)
    _check(mesh1d(n_dev), x, w, jnp.float16)


@pytest.mark.parametrize("n_dev", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=["b3", "b2x3"])
def test_leading_batch_dims(mesh1d, rand, n_dev, dtype, batch):
    """x is [m, *batch, k]: rows gathered along axis 0, batch dims carried through."""
    m, k, n = 4, 16, 8
    mesh = mesh1d(n_dev)
    x = rand(n_dev * m, *batch, k, dtype=dtype)
    w = rand(k, n_dev * n, dtype=dtype)
    bnone = (None,) * len(batch)

    def f(impl):
        return smap(
            lambda x, w: AG(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P("tp", *bnone, None), P(None, "tp")),
            out_specs=P(None, *bnone, "tp"),
        )(x, w)

    out, ref = f("ub"), f("xla")
    assert out.shape == ref.shape == (n_dev * m, *batch, n_dev * n)
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("n_dev", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_return_gathered(mesh1d, rand, n_dev, dtype):
    m, k, n = 4, 16, 8
    mesh = mesh1d(n_dev)
    x = rand(n_dev * m, 2, k, dtype=dtype)
    w = rand(k, n_dev * n, dtype=dtype)

    def f(impl):
        # Every rank's copy of the gathered x is returned (stacked along a new axis 0) so
        # that each one is checked, not just rank 0's.
        def body(x, w):
            out, g = AG(x, w, "tp", impl=impl, return_gathered=True)
            return out, g[None]

        return smap(
            body,
            mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=(P(None, None, "tp"), P("tp")),
        )(x, w)

    (out, gathered), (ref, _) = f("ub"), f("xla")
    assert gathered.shape == (n_dev, n_dev * m, 2, k)
    assert gathered.dtype == x.dtype
    for r in range(n_dev):
        np.testing.assert_array_equal(np.asarray(gathered[r]), np.asarray(x), err_msg=f"rank {r}")
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize(
    "dp,tp,order",
    [(2, 4, ("dp", "tp")), (4, 2, ("dp", "tp")), (2, 4, ("tp", "dp")), (4, 2, ("tp", "dp"))],
    ids=["dp2xtp4", "dp4xtp2", "tp4xdp2", "tp2xdp4"],
)
def test_2d_mesh(mesh2d, rand, dp, tp, order):
    """dp x tp mesh: every dp group gathers its own rows over tp, independently."""
    mesh = mesh2d(dp, tp, order)
    m, k, n = 4, 16, 8
    x = rand(dp * tp * m, k)
    w = rand(k, tp * n)

    def f(impl):
        return smap(
            lambda x, w: AG(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P(("dp", "tp")), P(None, "tp")),
            out_specs=P("dp", "tp"),
        )(x, w)

    out, ref = f("ub"), f("xla")
    assert out.shape == (dp * tp * m, tp * n)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, to_f32(x) @ to_f32(w)) < 1e-5


def test_permuted_devices(mesh2d, rand):
    """Mesh devices in a scrambled order: ranks follow mesh positions, not device ids."""
    devs = cpu_devices()
    mesh = mesh2d(2, 4, devices=[devs[i] for i in [5, 2, 7, 0, 3, 6, 1, 4]])
    x = rand(8 * 4, 16)
    w = rand(16, 4 * 6)

    def f(impl):
        return smap(
            lambda x, w: AG(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P(("dp", "tp")), P(None, "tp")),
            out_specs=P("dp", "tp"),
        )(x, w)

    assert rel_err(f("ub"), f("xla")) < 1e-5


def test_without_jit(mesh1d, rand):
    """shard_map called eagerly (no outer jit) takes the same path."""
    mesh = mesh1d(4)
    x = rand(4 * 8, 16)
    w = rand(16, 4 * 8)
    f = smap(
        lambda x, w: AG(x, w, "tp", impl="ub"),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
        jit=False,
    )
    assert rel_err(f(x, w), _ag_1d(mesh, "xla")(x, w)) < 1e-5


def test_auto_is_ub_on_cpu(mesh1d, rand):
    """impl="auto" takes the userbuffer path for float32 on CPU (custom call in the HLO)."""
    mesh = mesh1d(2)
    x = rand(2 * 8, 16)
    w = rand(16, 2 * 8)
    f = _ag_1d(mesh, "auto")
    assert "jax_ub_all_gather_matmul" in f.lower(x, w).as_text()
    assert rel_err(f(x, w), _ag_1d(mesh, "xla")(x, w)) < 1e-5


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (1, 0)], ids=["x", "w", "both"])
@pytest.mark.parametrize("impl", ["auto", "ub"])
def test_vmap_over_shard_map(mesh1d, rand, impl, in_axes):
    """jax.vmap of a shard_mapped op (e.g. over micro-batches) computes what the reference does.

    impl="auto" is the default, so vmap must work on the userbuffer path too.
    """
    mesh = mesh1d(4)
    b = 3
    x_shape, w_shape = (4 * 4, 16), (16, 4 * 8)
    if in_axes[0] is not None:  # the batch dim where vmap takes it from
        x_shape = x_shape[: in_axes[0]] + (b,) + x_shape[in_axes[0] :]
    x = rand(*x_shape)
    w = rand(*(w_shape if in_axes[1] is None else (b,) + w_shape))
    out = jax.jit(jax.vmap(_ag_1d(mesh, impl), in_axes=in_axes))(x, w)
    ref = jax.jit(jax.vmap(_ag_1d(mesh, "xla"), in_axes=in_axes))(x, w)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


def _grads(mesh, in_specs, out_specs, x, w, impl, check_vma=True, **kw):
    def loss(x, w):
        out = smap(
            lambda x, w: AG(x, w, "tp", impl=impl, **kw),
            mesh,
            in_specs,
            out_specs,
            jit=False,
            check_vma=check_vma,
        )(x, w)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
def test_grad_f32(mesh1d, rand, n_dev):
    mesh = mesh1d(n_dev)
    x = rand(n_dev * 4, 2, 16)  # with a leading batch dim, flattened by the op
    w = rand(16, n_dev * 8)
    specs = ((P("tp"), P(None, "tp")), P(None, None, "tp"))
    (l_ub, (dx_ub, dw_ub)) = _grads(mesh, *specs, x, w, "ub")
    (l_ref, (dx_ref, dw_ref)) = _grads(mesh, *specs, x, w, "xla")
    assert rel_err(l_ub, l_ref) < 1e-5
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


def test_grad_bf16(mesh1d, rand):
    mesh = mesh1d(4)
    x = rand(4 * 8, 32, dtype=jnp.bfloat16, scale=0.3)
    w = rand(32, 4 * 8, dtype=jnp.bfloat16, scale=0.3)
    specs = ((P("tp"), P(None, "tp")), P(None, "tp"))
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub")
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla")
    assert dx_ub.dtype == dw_ub.dtype == jnp.bfloat16
    assert rel_err(dx_ub, dx_ref) < 2e-2
    assert rel_err(dw_ub, dw_ref) < 2e-2


def test_grad_return_gathered(mesh1d, rand):
    """Both outputs carry cotangents: dx = RS(dy @ w.T) + psum_scatter(d gathered)."""
    mesh = mesh1d(4)
    x = rand(4 * 4, 16)
    w = rand(16, 4 * 8)

    def loss(x, w, impl):
        def body(x, w):
            out, g = AG(x, w, "tp", impl=impl, return_gathered=True)
            return out, g[None]

        out, g = smap(body, mesh, (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp")), jit=False)(
            x, w
        )
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(g) * jnp.arange(g.shape[0])[:, None, None])

    g_ub = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "ub")
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "xla")
    assert rel_err(g_ub[0], g_ref[0]) < 1e-5
    assert rel_err(g_ub[1], g_ref[1]) < 1e-5


@pytest.mark.parametrize("n_dev", [2, 4])
def test_grad_check_vma_false(mesh1d, rand, n_dev):
    """The same gradient under shard_map(check_vma=False), where avals carry no vma."""
    mesh = mesh1d(n_dev)
    x = rand(n_dev * 4, 16)
    w = rand(16, n_dev * 8)
    specs = ((P("tp"), P(None, "tp")), P(None, "tp"))
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla", check_vma=False)
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub", check_vma=False)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("case", ["2d_dp2xtp4", "1d_replicated_w"])
def test_grad_weight_not_varying_like_x(mesh1d, mesh2d, rand, case, check_vma):
    """dw when w does not vary over every axis x varies over.

    Data parallelism (x sharded over dp, w replicated over dp) and a replicated weight are
    the common cases: the xla reference sums dw over those axes (the transpose of the
    implicit pvary), the ub custom_vjp must do the same.
    """
    if case == "2d_dp2xtp4":
        mesh = mesh2d(2, 4)
        x = rand(2 * 4 * 4, 16)
        w = rand(16, 4 * 8)
        specs = ((P(("dp", "tp")), P(None, "tp")), P("dp", "tp"))
    else:
        mesh = mesh1d(4)
        x = rand(4 * 4, 16)
        w = rand(16, 8)
        # The output is replicated in value but varying in type: stack every rank's copy.
        specs = ((P("tp"), P()), P("tp"))
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla", check_vma=check_vma)
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub", check_vma=check_vma)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


N_ITERS = 20


def test_repeated_calls_scan(mesh2d, rand):
    """20 back-to-back calls in one program, each on new data, both ops sharing one buffer.

    A rank that reads a peer's chunk before it is rewritten (stale flag) or overwrites a
    chunk still being read shows up as a mismatch in some iteration.
    """
    mesh = mesh2d(2, 4)
    m, k, n = 4, 16, 12
    xs = rand(N_ITERS, 2 * 4 * m, k)
    w1 = rand(k, 4 * n)
    w2 = rand(4 * n, k, scale=0.2)

    def f(impl):
        def body(xs, w1, w2):
            def step(carry, x):
                y = AG(x + carry, w1, "tp", impl=impl)  # [4m, n]
                z = jax_ub.matmul_reduce_scatter(y, w2, "tp", impl=impl)  # [m, k]
                return 0.1 * jnp.tanh(z), (y, z)

            _, (ys, zs) = lax.scan(step, jnp.zeros_like(xs[0]), xs)
            return ys, zs

        return smap(
            body,
            mesh,
            in_specs=(P(None, ("dp", "tp")), P(None, "tp"), P("tp")),
            out_specs=(P(None, "dp", "tp"), P(None, ("dp", "tp"))),
        )(xs, w1, w2)

    (ys, zs), (ys_ref, zs_ref) = f("ub"), f("xla")
    for i in range(N_ITERS):
        assert rel_err(ys[i], ys_ref[i]) < 1e-5, f"iteration {i}"
        assert rel_err(zs[i], zs_ref[i]) < 1e-5, f"iteration {i}"


def test_repeated_calls_python_loop(mesh1d, rand):
    """20 dispatches of one compiled program with changing data, no sync in between."""
    mesh = mesh1d(8)
    f_ub, f_ref = _ag_1d(mesh, "ub"), _ag_1d(mesh, "xla")
    w = rand(16, 8 * 4)
    xs = [rand(8 * 4, 16) for _ in range(N_ITERS)]
    outs = [f_ub(x, w) for x in xs]  # all dispatched before any is read
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert rel_err(out, f_ref(x, w)) < 1e-5, f"iteration {i}"


def _make_late(x, m):
    """x, after a few milliseconds of busy work that x's value does not depend on."""
    y = lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ m), m)
    return x + (0.0 * y[0, 0]).astype(x.dtype)


@pytest.mark.parametrize("late", ["first", "last"])
def test_skewed_arrival(mesh1d, rand, late):
    """One rank reaches the op late: the others must wait for its data, not use stale data.

    Three rounds with new inputs, so a rank that reads before the late rank's data lands
    would see either nothing (round 1) or the previous round's values.
    """
    n_dev = 4
    late_rank = 0 if late == "first" else n_dev - 1
    mesh = mesh1d(n_dev)
    m = rand(64, 64, scale=0.1)

    def f(impl):
        def body(x, w, m):
            x = lax.cond(lax.axis_index("tp") == late_rank, _make_late, lambda x, m: x, x, m)
            return AG(x, w, "tp", impl=impl)

        return smap(body, mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp"))

    f_ub, f_ref = f("ub"), f("xla")
    w = rand(16, n_dev * 8)
    for i in range(3):
        x = rand(n_dev * 8, 16)
        assert rel_err(f_ub(x, w, m), f_ref(x, w, m)) < 1e-5, f"round {i}"


def test_back_to_back_independent_calls(mesh1d, rand):
    """30 calls in one program whose inputs do not depend on each other, on 8 ranks.

    Nothing orders a fast rank's next call after a slow rank's current one except the
    protocol's flags: a rank that frees its buffer too early gets it overwritten by the
    next call's data while it still reads it (caught here as a wrong iteration).
    """
    mesh = mesh1d(8)
    xs, w = rand(30, 8 * 16, 16), rand(16, 8 * 32)

    def f(impl):
        def body(xs, w):
            return lax.scan(lambda c, x: (c, AG(x, w, "tp", impl=impl)), 0.0, xs)[1]

        return smap(
            body, mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp")
        )

    f_ub = f("ub")
    ref = np.asarray(f("xla")(xs, w))
    for run in range(2):
        out = np.asarray(f_ub(xs, w))
        bad = [i for i in range(xs.shape[0]) if rel_err(out[i], ref[i]) > 1e-5]
        assert not bad, f"run {run}: wrong iterations {bad}"


def test_independent_ops_in_one_program(mesh1d, rand):
    """Several ub ops with no data dependency between them in one program, repeated: the
    CPU runtime may schedule them freely, yet every device must pair its calls with its
    peers' in the same order (else the descriptor check fails the run)."""
    mesh = mesh1d(8)

    def body(x, w, v):
        def ops(impl):
            return [
                AG(x, w, "tp", impl=impl),
                AG(x * 2, w, "tp", impl=impl),
                jax_ub.matmul_reduce_scatter(jnp.tile(x, (8, 1)), v, "tp", impl=impl),
                AG(x + 1, w, "tp", impl=impl),
            ]

        pairs = zip(ops("ub"), ops("xla"))
        err = sum(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)) for a, b in pairs)
        return lax.pmax(err, "tp")

    f = smap(body, mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(), check_vma=False)
    w, v = rand(16, 8 * 4), rand(16, 16)
    for _ in range(10):
        assert float(f(rand(8 * 4, 16), w, v)) < 1e-5


def test_grad_keeps_gathered_x_not_x(mesh1d, rand):
    """The forward saves for the backward only w and the gathered x (which dw needs); the
    local x is kept as an empty slice for its type, not as an activation."""
    saved_residuals = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals
    mesh = mesh1d(4)
    x, w = rand(4 * 8, 16), rand(16, 4 * 8)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    sizes = sorted(
        int(np.prod(aval.shape)) for aval, _ in saved_residuals(lambda x, w: f(x, w).sum(), x, w)
    )
    # w (16 x 32), the gathered x of each of the 4 devices (4 x 32 x 16), an empty slice.
    assert sizes == [0, 16 * 32, 4 * 32 * 16], sizes
