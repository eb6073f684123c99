"""Forward results of both ops, impl="ub" against the lax reference (impl="xla") and the plain
product: dtypes, shapes, leading batch dims, 1-D and 2-D meshes, permuted devices, eager
shard_map, vmap, and NaN/Inf passing through. Each scenario runs for all_gather_matmul
("ag") and matmul_reduce_scatter ("rs"); what only one op has is in test_return_gathered.py
and test_reduce_scatter_blocks.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, assert_same_specials, op_fn, op_operands, special_inputs
from conftest import cpu_devices, rel_err, to_f32, tol
from jax.sharding import PartitionSpec as P

import jax_ub


def _check(mesh, op, x, w, dtype):
    out = op_fn(op, mesh, "ub")(x, w)
    ref = op_fn(op, mesh, "xla")(x, w)
    assert out.shape == ref.shape == (x.shape[0], w.shape[1])
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    assert rel_err(out, ref) < tol(dtype)
    # And against the plain product, so a wrong reference cannot hide a wrong result.
    assert rel_err(out, to_f32(x) @ to_f32(w)) < tol(dtype)


# (rows per rank m, k, n) as op_operands takes them: for "ag" k is the whole contraction and
# n the columns per rank, for "rs" k is the contraction per rank and n all the columns.
# "rs" with m = 3 and 1: at 2 devices a block goes in two row pieces (Schedule), here uneven
# or empty.
SHAPES = {
    "ag": [(8, 16, 8), (4, 48, 16), (3, 20, 7)],
    "rs": [(8, 16, 8), (4, 40, 16), (3, 5, 7), (1, 6, 5)],
}
OP_SHAPES = [(op, s) for op in OPS for s in SHAPES[op]]


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "op,shape", OP_SHAPES, ids=["{}-m{}k{}n{}".format(op, *s) for op, s in OP_SHAPES]
)
def test_f32(mesh1d, rand, op, shape, n_dev):
    x, w = op_operands(rand, op, n_dev, *shape)
    _check(mesh1d(n_dev), op, x, w, jnp.float32)


# The other dtypes' (m, k, n) per op.
BF16_SHAPE = {"ag": (8, 32, 12), "rs": (8, 16, 12)}
F16_SHAPE = {"ag": (8, 32, 8), "rs": (8, 16, 8)}


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("op", OPS)
def test_bf16(mesh1d, rand, op, n_dev):
    x, w = op_operands(rand, op, n_dev, *BF16_SHAPE[op], dtype=jnp.bfloat16)
    _check(mesh1d(n_dev), op, x, w, jnp.bfloat16)


@pytest.mark.parametrize("n_dev", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_f16(mesh1d, rand, op, n_dev):
    x, w = op_operands(rand, op, n_dev, *F16_SHAPE[op], dtype=jnp.float16, scale=0.5)
    _check(mesh1d(n_dev), op, x, w, jnp.float16)


@pytest.mark.parametrize("n_dev", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [(3,), (2, 3)], ids=["b3", "b2x3"])
@pytest.mark.parametrize("op", OPS)
def test_leading_batch_dims(mesh1d, rand, op, batch, dtype, n_dev):
    """x is [rows, *batch, k]: rows gathered (ag) or scattered (rs) along axis 0, batch dims
    carried through."""
    m, k, n = (4, 16, 8) if op == "ag" else (4, 8, 8)
    mesh = mesh1d(n_dev)
    x, w = op_operands(rand, op, n_dev, m, k, n, batch=batch, dtype=dtype)
    out = op_fn(op, mesh, "ub", nbatch=len(batch))(x, w)
    ref = op_fn(op, mesh, "xla", nbatch=len(batch))(x, w)
    assert out.shape == ref.shape == (x.shape[0], *batch, w.shape[1])
    assert rel_err(out, ref) < tol(dtype)
    assert rel_err(out, np.einsum("m...k,kn->m...n", to_f32(x), to_f32(w))) < tol(dtype)


@pytest.mark.parametrize(
    "dp,tp,order",
    [(2, 4, ("dp", "tp")), (4, 2, ("dp", "tp")), (2, 4, ("tp", "dp")), (4, 2, ("tp", "dp"))],
    ids=["dp2xtp4", "dp4xtp2", "tp4xdp2", "tp2xdp4"],
)
@pytest.mark.parametrize("op", OPS)
def test_2d_mesh(mesh2d, rand, op, dp, tp, order):
    """dp x tp mesh: every dp group runs the op over tp on its own rows, independently."""
    mesh = mesh2d(dp, tp, order)
    m, k, n = (4, 16, 8) if op == "ag" else (4, 8, 8)
    x, w = op_operands(rand, op, tp, m, k, n, dp=dp)
    out, ref = op_fn(op, mesh, "ub", dp=True)(x, w), op_fn(op, mesh, "xla", dp=True)(x, w)
    assert out.shape == (dp * tp * m, tp * n if op == "ag" else n)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, to_f32(x) @ to_f32(w)) < 1e-5


@pytest.mark.parametrize("op", OPS)
def test_permuted_devices(mesh2d, rand, op):
    """Mesh devices in a scrambled order: ranks follow mesh positions, not device ids."""
    devs = cpu_devices()
    mesh = mesh2d(2, 4, devices=[devs[i] for i in [5, 2, 7, 0, 3, 6, 1, 4]])
    x, w = op_operands(rand, op, 4, 4, 16 if op == "ag" else 8, 6, dp=2)
    out, ref = op_fn(op, mesh, "ub", dp=True)(x, w), op_fn(op, mesh, "xla", dp=True)(x, w)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("op", OPS)
def test_without_jit(mesh1d, rand, op):
    """shard_map called eagerly (no outer jit) takes the same path."""
    mesh = mesh1d(4)
    x, w = op_operands(rand, op, 4, *((8, 16, 8) if op == "ag" else (4, 8, 8)))
    f = op_fn(op, mesh, "ub", jit=False)
    assert rel_err(f(x, w), op_fn(op, mesh, "xla")(x, w)) < 1e-5


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (1, 0)], ids=["x", "w", "both"])
@pytest.mark.parametrize("impl", ["auto", "ub"])
@pytest.mark.parametrize("op", OPS)
def test_vmap_over_shard_map(mesh1d, rand, op, impl, in_axes):
    """jax.vmap of a shard_mapped op (e.g. over micro-batches) computes what the reference does.

    impl="auto" is the default, so vmap must work on the userbuffer path too.
    """
    mesh = mesh1d(4)
    b = 3
    x_shape, w_shape = ((4 * 4, 16), (16, 4 * 8)) if op == "ag" else ((4 * 4, 4 * 8), (4 * 8, 8))
    if in_axes[0] is not None:  # the batch dim where vmap takes it from
        x_shape = x_shape[: in_axes[0]] + (b,) + x_shape[in_axes[0] :]
    x = rand(*x_shape)
    w = rand(*(w_shape if in_axes[1] is None else (b,) + w_shape))
    out = jax.jit(jax.vmap(op_fn(op, mesh, impl), in_axes=in_axes))(x, w)
    ref = jax.jit(jax.vmap(op_fn(op, mesh, "xla"), in_axes=in_axes))(x, w)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_nan_inf_pass_through(mesh1d, op, dtype):
    """NaN, +-Inf, Inf - Inf and 0 * Inf in every rank's block (and, for reduce-scatter,
    meeting in partial sums from different ranks): NaN exactly where the XLA reference has
    NaN, Inf of the same sign where it has Inf, finite values within tolerance."""
    tp = 4
    mesh = mesh1d(tp)
    x, w = special_inputs(op, tp, dtype)
    assert_same_specials(op_fn(op, mesh, "ub")(x, w), op_fn(op, mesh, "xla")(x, w), dtype)


# Each op over tp with x a constant of the program (closed over, the same on every rank)
# and its weights traced: (op, x's shape, the weights' shapes and in_specs, out_specs).
_CONST_X_CASES = {
    "all_gather_matmul": ((2, 8), [((8, 12), P(None, "tp"))], P(None, "tp")),
    "matmul_reduce_scatter": ((8, 8), [((8, 12), P())], P("tp")),
    "matmul_all_reduce": ((3, 8), [((8, 12), P())], P()),
    "gelu_mlp": ((2, 8), [((8, 16), P(None, "tp")), ((16, 8), P("tp"))], P("tp")),
    "gated_mlp": ((2, 8), [((8, 2, 16), P(None, None, "tp")), ((16, 8), P("tp"))], P("tp")),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("numpy_x", [False, True])
@pytest.mark.parametrize("op", list(_CONST_X_CASES))
def test_x_a_constant_of_the_program(mesh1d, rand, op, numpy_x, check_vma):
    """x closed over (a jax.Array or a NumPy array) inside jit(shard_map), the weights traced:
    the values and the weights' gradients of impl="xla". A constant is typed on no mesh; the
    ops' results are typed on the traced one (a bare AssertionError of JAX's before)."""
    mesh = mesh1d(4)
    x_shape, weights, out_spec = _CONST_X_CASES[op]
    x = rand(*x_shape)
    x = np.asarray(x) if numpy_x else x
    ws = [rand(*shape, scale=0.4) for shape, _ in weights]
    fn = getattr(jax_ub, op)

    def run(impl):
        f = jax.shard_map(
            lambda *w: fn(x, *w, "tp", impl=impl),
            mesh=mesh,
            in_specs=tuple(spec for _, spec in weights),
            out_specs=out_spec,
            check_vma=check_vma,
        )
        loss = lambda *w: jnp.sum(jnp.sin(f(*w)))  # noqa: E731
        return jax.jit(f)(*ws), jax.jit(jax.grad(loss, argnums=tuple(range(len(ws)))))(*ws)

    (y, grads), (y_ref, grads_ref) = run("ub"), run("xla")
    assert rel_err(y, y_ref) < 1e-5
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("op", OPS)
def test_an_axis_of_jax_vmap(rand, op):
    """The axis bound by jax.vmap(axis_name=), no mesh: "auto" runs lax's collectives, as
    "xla" does (it raised a missing-rule error, or named no remedy under jit); "ub",
    which runs over a mesh's devices, says so."""
    tp = 4
    if op == "ag":
        x, w = rand(tp, 2, 8), rand(tp, 8, 3)
        want = jnp.stack([jnp.concatenate(list(x)) @ w[r] for r in range(tp)])
    else:
        x, w = rand(tp, 8, 5), rand(tp, 5, 6)
        want = sum(x[r] @ w[r] for r in range(tp)).reshape(tp, 2, 6)
    fn = {"ag": jax_ub.all_gather_matmul, "rs": jax_ub.matmul_reduce_scatter}[op]
    for impl in ("auto", "xla"):
        f = jax.vmap(lambda a, b, impl=impl: fn(a, b, "tp", impl=impl), axis_name="tp")
        assert rel_err(f(x, w), want) < 1e-5 and rel_err(jax.jit(f)(x, w), want) < 1e-5
    f = jax.vmap(lambda a, b: fn(a, b, "tp", impl="ub"), axis_name="tp")
    with pytest.raises(ValueError, match="bound by jax.vmap or jax.pmap.*impl='xla' or 'auto'"):
        f(x, w)
