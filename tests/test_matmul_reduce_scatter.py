"""matmul_reduce_scatter(impl="ub") against the lax reference (impl="xla")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices, rel_err, smap, to_f32, tol
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import options

RS = jax_ub.matmul_reduce_scatter


def _rs_1d(mesh, impl):
    """x column-sharded (k over tp), w row-sharded: the global result is x @ w, row-sharded."""
    return smap(
        lambda x, w: RS(x, w, "tp", impl=impl),
        mesh,
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=P("tp"),
    )


def _check(mesh, x, w, dtype):
    out = _rs_1d(mesh, "ub")(x, w)
    ref = _rs_1d(mesh, "xla")(x, w)
    assert out.shape == ref.shape == (x.shape[0], w.shape[1])
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert rel_err(out, ref) < tol(dtype)
    # And against the plain product, so a wrong reference cannot hide a wrong result.
    assert rel_err(out, to_f32(x) @ to_f32(w)) < tol(dtype)


# (rows of the output per rank m, k per rank, n)
# m = 3 and 1: at 2 devices a block goes in two row pieces (Schedule), here uneven or empty.
SHAPES = [(8, 16, 8), (4, 40, 16), (3, 5, 7), (1, 6, 5)]


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}k{}n{}".format(*s))
def test_f32(mesh1d, rand, n_dev, shape):
    m, k, n = shape
    x = rand(n_dev * m, n_dev * k)
    w = rand(n_dev * k, n)
    _check(mesh1d(n_dev), x, w, jnp.float32)


@pytest.mark.parametrize(
    "fold_rows,m",
    [(0, 1), (0, 3), (0, 8), (-1, 3), (-1, 8), (4, 7), (4, 8)],
    ids=lambda v: str(v),
)
def test_fold_on_and_off(mesh1d, rand, fold_rows, m):
    """At 2 devices a block of m rows goes in two row pieces and the peer's is added to our
    own piece by piece when each piece has at least `fold_rows` rows (0: always, -1:
    never), else in one piece and a sum pass. m = 1 and 3 make empty and uneven pieces;
    (4, 7) and (4, 8) sit either side of the threshold. Every case must give the
    reference's result."""
    jax_ub.finalize()  # communicators take the setting when they are created
    try:
        with options.experimental_tuning(reduce_scatter_fold_rows=fold_rows):
            x = rand(2 * m, 2 * 6, dtype=jnp.bfloat16)
            w = rand(2 * 6, 10, dtype=jnp.bfloat16)
            _check(mesh1d(2), x, w, jnp.bfloat16)
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
def test_bf16(mesh1d, rand, n_dev):
    x = rand(n_dev * 8, n_dev * 16, dtype=jnp.bfloat16)
    w = rand(n_dev * 16, 12, dtype=jnp.bfloat16)
    _check(mesh1d(n_dev), x, w, jnp.bfloat16)


@pytest.mark.parametrize("n_dev", [2, 4])
def test_f16(mesh1d, rand, n_dev):
    x = rand(n_dev * 8, n_dev * 16, dtype=jnp.float16, scale=0.5)
    w = rand(n_dev * 16, 8, dtype=jnp.float16, scale=0.5)
    _check(mesh1d(n_dev), x, w, jnp.float16)


@pytest.mark.parametrize("n_dev", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=["b3", "b2x3"])
def test_leading_batch_dims(mesh1d, rand, n_dev, dtype, batch):
    """x is [M, *batch, k]: rows scattered along axis 0, batch dims carried through."""
    m, k, n = 4, 8, 8
    mesh = mesh1d(n_dev)
    x = rand(n_dev * m, *batch, n_dev * k, dtype=dtype)
    w = rand(n_dev * k, n, dtype=dtype)
    bnone = (None,) * len(batch)

    def f(impl):
        return smap(
            lambda x, w: RS(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P(None, *bnone, "tp"), P("tp")),
            out_specs=P("tp"),
        )(x, w)

    out, ref = f("ub"), f("xla")
    assert out.shape == ref.shape == (n_dev * m, *batch, n)
    assert rel_err(out, ref) < tol(dtype)
    assert rel_err(out, np.einsum("m...k,kn->m...n", to_f32(x), to_f32(w))) < tol(dtype)


def test_local_partials_differ_per_rank(mesh1d, rand):
    """Each rank's output block is the sum over ranks of *its* rows: check block by block."""
    n_dev, m, k, n = 4, 2, 8, 4
    x = rand(n_dev * m, n_dev * k)
    w = rand(n_dev * k, n)
    out = np.asarray(_rs_1d(mesh1d(n_dev), "ub")(x, w))
    xs, ws = to_f32(x), to_f32(w)
    for r in range(n_dev):
        want = sum(
            xs[r * m : (r + 1) * m, j * k : (j + 1) * k] @ ws[j * k : (j + 1) * k]
            for j in range(n_dev)
        )
        np.testing.assert_allclose(out[r * m : (r + 1) * m], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dp,tp,order",
    [(2, 4, ("dp", "tp")), (4, 2, ("dp", "tp")), (2, 4, ("tp", "dp")), (4, 2, ("tp", "dp"))],
    ids=["dp2xtp4", "dp4xtp2", "tp4xdp2", "tp2xdp4"],
)
def test_2d_mesh(mesh2d, rand, dp, tp, order):
    mesh = mesh2d(dp, tp, order)
    m, k, n = 4, 8, 8
    x = rand(dp * tp * m, tp * k)
    w = rand(tp * k, n)

    def f(impl):
        return smap(
            lambda x, w: RS(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P("dp", "tp"), P("tp")),
            out_specs=P(("dp", "tp")),
        )(x, w)

    out, ref = f("ub"), f("xla")
    assert out.shape == (dp * tp * m, n)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, to_f32(x) @ to_f32(w)) < 1e-5


def test_permuted_devices(mesh2d, rand):
    devs = cpu_devices()
    mesh = mesh2d(2, 4, devices=[devs[i] for i in [5, 2, 7, 0, 3, 6, 1, 4]])
    x = rand(8 * 4, 4 * 8)
    w = rand(4 * 8, 6)

    def f(impl):
        return smap(
            lambda x, w: RS(x, w, "tp", impl=impl),
            mesh,
            in_specs=(P("dp", "tp"), P("tp")),
            out_specs=P(("dp", "tp")),
        )(x, w)

    assert rel_err(f("ub"), f("xla")) < 1e-5


def test_without_jit(mesh1d, rand):
    mesh = mesh1d(4)
    x = rand(4 * 4, 4 * 8)
    w = rand(4 * 8, 8)
    f = smap(
        lambda x, w: RS(x, w, "tp", impl="ub"),
        mesh,
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=P("tp"),
        jit=False,
    )
    assert rel_err(f(x, w), _rs_1d(mesh, "xla")(x, w)) < 1e-5


def test_auto_is_ub_on_cpu(mesh1d, rand):
    mesh = mesh1d(2)
    x = rand(2 * 8, 2 * 8)
    w = rand(2 * 8, 8)
    f = _rs_1d(mesh, "auto")
    assert "jax_ub_matmul_reduce_scatter" in f.lower(x, w).as_text()
    assert rel_err(f(x, w), _rs_1d(mesh, "xla")(x, w)) < 1e-5


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (1, 0)], ids=["x", "w", "both"])
@pytest.mark.parametrize("impl", ["auto", "ub"])
def test_vmap_over_shard_map(mesh1d, rand, impl, in_axes):
    """jax.vmap of a shard_mapped op (e.g. over micro-batches) computes what the reference does.

    impl="auto" is the default, so vmap must work on the userbuffer path too.
    """
    mesh = mesh1d(4)
    b = 3
    x_shape, w_shape = (4 * 4, 4 * 8), (4 * 8, 8)
    if in_axes[0] is not None:  # the batch dim where vmap takes it from
        x_shape = x_shape[: in_axes[0]] + (b,) + x_shape[in_axes[0] :]
    x = rand(*x_shape)
    w = rand(*(w_shape if in_axes[1] is None else (b,) + w_shape))
    out = jax.jit(jax.vmap(_rs_1d(mesh, impl), in_axes=in_axes))(x, w)
    ref = jax.jit(jax.vmap(_rs_1d(mesh, "xla"), in_axes=in_axes))(x, w)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


def _grads(mesh, in_specs, out_specs, x, w, impl, check_vma=True):
    def loss(x, w):
        out = smap(
            lambda x, w: RS(x, w, "tp", impl=impl),
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
    x = rand(n_dev * 4, 2, n_dev * 8)  # with a leading batch dim, flattened by the op
    w = rand(n_dev * 8, 8)
    specs = ((P(None, None, "tp"), P("tp")), P("tp"))
    l_ub, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub")
    l_ref, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla")
    assert rel_err(l_ub, l_ref) < 1e-5
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


def test_grad_bf16(mesh1d, rand):
    mesh = mesh1d(4)
    x = rand(4 * 8, 4 * 8, dtype=jnp.bfloat16, scale=0.3)
    w = rand(4 * 8, 8, dtype=jnp.bfloat16, scale=0.3)
    specs = ((P(None, "tp"), P("tp")), P("tp"))
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub")
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla")
    assert dx_ub.dtype == dw_ub.dtype == jnp.bfloat16
    assert rel_err(dx_ub, dx_ref) < 2e-2
    assert rel_err(dw_ub, dw_ref) < 2e-2


@pytest.mark.parametrize("n_dev", [2, 4])
def test_grad_check_vma_false(mesh1d, rand, n_dev):
    """The same gradient under shard_map(check_vma=False), where avals carry no vma."""
    mesh = mesh1d(n_dev)
    x = rand(n_dev * 4, n_dev * 8)
    w = rand(n_dev * 8, 8)
    specs = ((P(None, "tp"), P("tp")), P("tp"))
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla", check_vma=False)
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub", check_vma=False)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_grad_2d_mesh(mesh2d, rand, check_vma):
    """dp x tp: x sharded over both axes, w over tp only, so dw must be summed over dp.

    The xla reference sums it (the transpose of the implicit pvary of w over dp); the ub
    custom_vjp must agree.
    """
    mesh = mesh2d(2, 4)
    x = rand(2 * 4 * 4, 4 * 8)
    w = rand(4 * 8, 8)
    specs = ((P("dp", "tp"), P("tp")), P(("dp", "tp")))
    _, (dx_ref, dw_ref) = _grads(mesh, *specs, x, w, "xla", check_vma=check_vma)
    _, (dx_ub, dw_ub) = _grads(mesh, *specs, x, w, "ub", check_vma=check_vma)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


N_ITERS = 20


def test_repeated_calls_fori_loop(mesh1d, rand):
    """20 dependent calls in one program; each iteration's input depends on the last output."""
    n_dev, m, k = 4, 4, 8
    mesh = mesh1d(n_dev)
    x0 = rand(n_dev * m, n_dev * k)
    w = rand(n_dev * k, n_dev * k, scale=0.3)

    def f(impl):
        def body(x, w):
            def step(i, x):
                y = RS(x, w, "tp", impl=impl)  # [m, n_dev*k], row block of x @ w
                # back to the column-sharded layout with new, iteration-dependent values
                y = lax.all_to_all(y, "tp", 1, 0, tiled=True)
                return jnp.tanh(y + 0.01 * i.astype(y.dtype))

            return lax.fori_loop(0, N_ITERS, step, x)

        return smap(body, mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P(None, "tp"))(x0, w)

    out, ref = f("ub"), f("xla")
    # Check the loop ran: 20 tanh-steps of a random map do not return the input.
    assert rel_err(out, x0) > 0.1
    assert rel_err(out, ref) < 1e-4


def test_repeated_calls_python_loop(mesh1d, rand):
    """20 dispatches of one compiled program with changing data, no sync in between."""
    mesh = mesh1d(8)
    f_ub, f_ref = _rs_1d(mesh, "ub"), _rs_1d(mesh, "xla")
    w = rand(8 * 4, 8)
    xs = [rand(8 * 2, 8 * 4) for _ in range(N_ITERS)]
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
            return RS(x, w, "tp", impl=impl)

        return smap(body, mesh, in_specs=(P(None, "tp"), P("tp"), P()), out_specs=P("tp"))

    f_ub, f_ref = f("ub"), f("xla")
    w = rand(n_dev * 16, 8)
    for i in range(3):
        x = rand(n_dev * 8, n_dev * 16)
        assert rel_err(f_ub(x, w, m), f_ref(x, w, m)) < 1e-5, f"round {i}"


def test_back_to_back_independent_calls(mesh1d, rand):
    """30 calls in one program whose inputs do not depend on each other, on 8 ranks.

    Nothing orders a fast rank's next call after a slow rank's current one except the
    protocol's flags: a rank that frees its buffer too early gets it overwritten by the
    next call's data while it still reads it (caught here as a wrong iteration).
    """
    mesh = mesh1d(8)
    xs, w = rand(30, 8 * 32, 8 * 16), rand(8 * 16, 32)

    def f(impl):
        def body(xs, w):
            return lax.scan(lambda c, x: (c, RS(x, w, "tp", impl=impl)), 0.0, xs)[1]

        return smap(body, mesh, in_specs=(P(None, None, "tp"), P("tp")), out_specs=P(None, "tp"))

    f_ub = f("ub")
    ref = np.asarray(f("xla")(xs, w))
    for run in range(2):
        out = np.asarray(f_ub(xs, w))
        bad = [i for i in range(xs.shape[0]) if rel_err(out[i], ref[i]) > 1e-5]
        assert not bad, f"run {run}: wrong iterations {bad}"
