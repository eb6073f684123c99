"""Gradients of both ops, impl="ub" against the lax reference (impl="xla"): float32 with a
leading batch dim, bfloat16, shard_map(check_vma=False), and weights that do not vary over
every axis x varies over. Each scenario runs for all_gather_matmul ("ag") and
matmul_reduce_scatter ("rs"); the gradient through return_gathered is in
test_return_gathered.py."""

import jax
import jax.numpy as jnp
import pytest
from _op_cases import OPS, op_call, op_operands, op_specs
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P

import jax_ub


def _grads(op, mesh, in_specs, out_specs, x, w, impl, check_vma=True):
    def loss(x, w):
        out = smap(
            lambda x, w: op_call(op)(x, w, "tp", impl=impl),
            mesh,
            in_specs,
            out_specs,
            jit=False,
            check_vma=check_vma,
        )(x, w)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("op", OPS)
def test_grad_f32(mesh1d, rand, op, n_dev):
    mesh = mesh1d(n_dev)
    # With a leading batch dim, flattened by the op.
    x, w = op_operands(rand, op, n_dev, 4, 16 if op == "ag" else 8, 8, batch=(2,))
    specs = op_specs(op, nbatch=1)
    l_ub, (dx_ub, dw_ub) = _grads(op, mesh, *specs, x, w, "ub")
    l_ref, (dx_ref, dw_ref) = _grads(op, mesh, *specs, x, w, "xla")
    assert rel_err(l_ub, l_ref) < 1e-5
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


@pytest.mark.parametrize("op", OPS)
def test_grad_bf16(mesh1d, rand, op):
    mesh = mesh1d(4)
    m, k, n = (8, 32, 8) if op == "ag" else (8, 8, 8)
    x, w = op_operands(rand, op, 4, m, k, n, dtype=jnp.bfloat16, scale=0.3)
    specs = op_specs(op)
    _, (dx_ub, dw_ub) = _grads(op, mesh, *specs, x, w, "ub")
    _, (dx_ref, dw_ref) = _grads(op, mesh, *specs, x, w, "xla")
    assert dx_ub.dtype == dw_ub.dtype == jnp.bfloat16
    assert rel_err(dx_ub, dx_ref) < 2e-2
    assert rel_err(dw_ub, dw_ref) < 2e-2


@pytest.mark.parametrize("n_dev", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_grad_check_vma_false(mesh1d, rand, op, n_dev):
    """The same gradient under shard_map(check_vma=False), where avals carry no vma."""
    mesh = mesh1d(n_dev)
    x, w = op_operands(rand, op, n_dev, 4, 16 if op == "ag" else 8, 8)
    specs = op_specs(op)
    _, (dx_ref, dw_ref) = _grads(op, mesh, *specs, x, w, "xla", check_vma=False)
    _, (dx_ub, dw_ub) = _grads(op, mesh, *specs, x, w, "ub", check_vma=False)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("case", ["ag-2d_dp2xtp4", "ag-1d_replicated_w", "rs-2d_dp2xtp4"])
def test_grad_weight_not_varying_like_x(mesh1d, mesh2d, rand, case, check_vma):
    """dw when w does not vary over every axis x varies over.

    Data parallelism (x sharded over dp, w replicated over dp, so dw must be summed over dp)
    and a replicated weight are the common cases: the xla reference sums dw over those axes
    (the transpose of the implicit pvary), the ub custom_vjp must do the same.
    """
    op, layout = case.split("-")
    if layout == "2d_dp2xtp4":
        mesh = mesh2d(2, 4)
        x, w = op_operands(rand, op, 4, 4, 16 if op == "ag" else 8, 8, dp=2)
        specs = op_specs(op, dp=True)
    else:
        mesh = mesh1d(4)
        x, w = rand(4 * 4, 16), rand(16, 8)
        # The output is replicated in value but varying in type: stack every rank's copy.
        specs = ((P("tp"), P()), P("tp"))
    _, (dx_ref, dw_ref) = _grads(op, mesh, *specs, x, w, "xla", check_vma=check_vma)
    _, (dx_ub, dw_ub) = _grads(op, mesh, *specs, x, w, "ub", check_vma=check_vma)
    assert rel_err(dx_ub, dx_ref) < 1e-5
    assert rel_err(dw_ub, dw_ref) < 1e-5


def _tile_rows(a, tp):
    return jnp.concatenate([a] * tp, axis=0)


# Every operand the same on every rank (in_specs P()), as a whole-array function of the
# global operands: (op, operand shapes, out_specs, that function with tp).
_REPLICATED_CASES = {
    # each rank gathers tp copies of x; out_specs concatenates the ranks' products by column
    "all_gather_matmul": (
        [(2, 8), (8, 6)],
        P(None, "tp"),
        lambda tp, x, w: jnp.concatenate([_tile_rows(x, tp) @ w] * tp, axis=1),
    ),
    # each rank's block of the sum of tp equal products
    "matmul_reduce_scatter": ([(8, 8), (8, 6)], P("tp"), lambda tp, x, w: tp * (x @ w)),
    # psum of tp equal products
    "matmul_all_reduce": ([(3, 8), (8, 6)], P(), lambda tp, x, w: tp * (x @ w)),
    "gelu_mlp": (
        [(2, 8), (8, 16), (16, 8)],
        P("tp"),
        lambda tp, x, w1, w2: tp * (jax.nn.gelu(_tile_rows(x, tp) @ w1) @ w2),
    ),
    "gated_mlp": (
        [(2, 8), (8, 2, 16), (16, 8)],
        P("tp"),
        lambda tp, x, wgu, wd: (
            tp
            * ((jax.nn.silu(_tile_rows(x, tp) @ wgu[:, 0]) * (_tile_rows(x, tp) @ wgu[:, 1])) @ wd)
        ),
    ),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", list(_REPLICATED_CASES))
def test_operands_the_same_on_every_rank(mesh1d, rand, op, check_vma):
    """Every operand replicated over tp: values and gradients of the whole-array function the
    op then computes (lax's collectives cast such operands to varying first). Under
    check_vma the all-gather's output was typed the same on every rank, so its VJP summed tp
    copies of one cotangent (gradients tp times too large), and the all-reduce's VJP missed
    the tp equal terms of its sum (1/tp)."""
    tp = 4
    mesh = mesh1d(tp)
    shapes, out_spec, whole = _REPLICATED_CASES[op]
    args = [rand(*s, scale=0.4) for s in shapes]
    argnums = tuple(range(len(args)))
    f = smap(
        lambda *a: getattr(jax_ub, op)(*a, "tp", impl="ub"),
        mesh,
        (P(),) * len(args),
        out_spec,
        check_vma=check_vma,
    )
    want = whole(tp, *args)
    assert rel_err(f(*args), want) < 1e-5
    got = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums))(*args)
    truth = jax.grad(lambda *a: jnp.sum(jnp.sin(whole(tp, *a))), argnums)(*args)
    for i, (g, t) in enumerate(zip(got, truth)):
        assert rel_err(g, t) < 1e-5, (op, i)


def test_a_second_derivative_names_the_remedy(mesh1d, rand):
    """grad of grad through an op with impl='ub' fails naming what is unsupported and
    impl='xla', which differentiates twice."""
    mesh = mesh1d(2)
    x, w = rand(4, 8), rand(8, 6)

    def hvp(impl):
        f = smap(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl),
            mesh,
            (P("tp"), P(None, "tp")),
            P(None, "tp"),
            jit=False,
        )
        loss = lambda w: jnp.sum(f(x, w) ** 2)  # noqa: E731
        return jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(loss)(w) * w)))(w)

    assert (
        rel_err(hvp("xla"), 4 * jnp.concatenate([x.T @ x @ w[:, :3], x.T @ x @ w[:, 3:]], 1)) < 1e-5
    )
    with pytest.raises(NotImplementedError, match="second derivative.*impl='xla'"):
        hvp("ub")
