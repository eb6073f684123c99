"""Batch-major activations: the ops and gelu_mlp with ``seq_axis`` other than 0.

``x [batch, seq, ..., k]`` with the sequence split over tp, inside shard_map (full and
partial-auto) and on global arrays, forward and gradients, against the same math on whole
arrays in float32; with the epilogues, ``return_gathered`` and fp8; and the bad values.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, op_call
from conftest import make_mesh, rel_err, smap, tol
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
import jax_ub.flax.linen as ubl

TP = 4
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)")
B, S, K, N = 3, 16, 16, 8  # per-rank n (AG) or k (RS) below: K and N divide by TP


def _spec(ndim: int, seq_axis: int, axis="tp") -> P:
    return P(*([None] * seq_axis), axis, *([None] * (ndim - seq_axis - 1)))


def _product(x, w, bias=None, gelu=False):
    y = jnp.matmul(x, w, precision="highest")
    y = y if bias is None else y + bias
    return jax.nn.gelu(y) if gelu else y


def _global_operands(rand, op, shape_before_k, dtype=jnp.float32, n=N):
    if op == "ag":
        return rand(*shape_before_k, K, dtype=dtype), rand(K, n * TP, dtype=dtype, scale=0.3)
    return rand(*shape_before_k, K * TP, dtype=dtype), rand(K * TP, n, dtype=dtype, scale=0.3)


def _local_fn(op, mesh, ndim, seq_axis, impl="ub", **kw):
    """jit(shard_map(op)) over tp for activations of ``ndim`` dims split on ``seq_axis``."""
    seq, feat = _spec(ndim, seq_axis), P(*([None] * (ndim - 1)), "tp")
    if op == "ag":
        in_specs, out_specs = (seq, P(None, "tp")), feat
    else:
        in_specs, out_specs = (feat, P("tp", None)), seq
    fn = op_call(op)
    return smap(
        lambda x, w: fn(x, w, "tp", impl=impl, seq_axis=seq_axis, **kw),
        mesh,
        in_specs,
        out_specs,
    )


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "lead, seq_axis",
    [((B, S), 1), ((B, S, 2), 1), ((2, B, S), 2), ((B, S, 2), -3), ((S, B), 0)],
    ids=["bsk", "bs2k", "2bsk", "negative", "seq_major"],
)
def test_forward_and_grads_match_whole_array_math(rand, op, lead, seq_axis):
    mesh = make_mesh((TP, "tp"))
    x, w = _global_operands(rand, op, lead)
    index = seq_axis % len(lead + (K,))
    f = _local_fn(op, mesh, x.ndim, index)
    y = f(x, w)
    want = _product(x, w)
    assert y.shape == want.shape
    assert rel_err(y, want) < 1e-5

    def loss(g):
        return lambda x, w: jnp.sum(jnp.sin(g(x, w)))

    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    grads_ref = jax.jit(jax.grad(loss(_product), argnums=(0, 1)))(x, w)
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_gather_matmul_epilogue_and_gathered(rand, dtype):
    mesh = make_mesh((TP, "tp"))
    x, w = _global_operands(rand, "ag", (B, S), dtype)
    bias = rand(N * TP, dtype=dtype)

    def body(x, w, bias):
        return jax_ub.all_gather_matmul(
            x, w, "tp", bias=bias, activation="gelu", impl="ub", return_gathered=True, seq_axis=1
        )

    # Every rank holds the whole gathered x: laid side by side along the sequence.
    out_specs = (P(None, None, "tp"), P(None, "tp"))
    f = smap(body, mesh, (P(None, "tp"), P(None, "tp"), P("tp")), out_specs)
    y, gathered = f(x, w, bias)
    f32 = [a.astype(jnp.float32) for a in (x, w, bias)]
    assert rel_err(y, _product(*f32, gelu=True)) < tol(dtype)
    np.testing.assert_array_equal(np.asarray(gathered), np.concatenate([x] * TP, axis=1))


def test_gelu_mlp_batch_major(rand):
    mesh = make_mesh((TP, "tp"))
    x = rand(B, S, K)
    w1, w2 = rand(K, 2 * K, scale=0.3), rand(2 * K, K, scale=0.3)
    b1, b2 = rand(2 * K), rand(K)
    seq = P(None, "tp")

    def body(x, w1, w2, b1, b2):
        return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2, impl="ub", seq_axis=1)

    f = smap(body, mesh, (seq, P(None, "tp"), P("tp", None), P("tp"), P()), seq)

    def reference(x, w1, w2, b1, b2):
        return _product(_product(x, w1, b1, gelu=True), w2, b2)

    assert rel_err(f(x, w1, w2, b1, b2), reference(x, w1, w2, b1, b2)) < 1e-5
    args = (x, w1, w2, b1, b2)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3)))(*args)
    grads_ref = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a))), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("op", OPS)
def test_fp8_batch_major_equals_seq_major(rand, op):
    """fp8 (current scaling) on batch-major activations computes the seq-major call's
    numbers, moved: the same quantized product, whatever the dim order."""
    mesh = make_mesh((TP, "tp"))
    # n = 16 per rank: fp8 GEMMs need k and n divisible by 16 (on CPU devices as on GPUs).
    x, w = _global_operands(rand, op, (B, S), n=16)
    fp8 = jax_ub.Fp8Scales()
    batch_major = _local_fn(op, mesh, 3, 1, fp8=fp8)(x, w)
    seq_major = _local_fn(op, mesh, 3, 0, fp8=fp8)(jnp.swapaxes(x, 0, 1), w)
    np.testing.assert_array_equal(
        np.asarray(batch_major), np.asarray(jnp.swapaxes(seq_major, 0, 1))
    )
    assert rel_err(batch_major, _product(x, w)) < 0.1  # fp8's own error


@pytest.mark.parametrize("op", OPS)
def test_global_arrays_batch_split_over_dp(rand, op):
    """Plain jit under jax.set_mesh: batch over dp, sequence over tp (the op's), forward and
    grads; the result comes back with the sequence (RS) or features (AG) split over tp."""
    mesh = make_mesh((2, "dp"), (TP, "tp"))
    x, w = _global_operands(rand, op, (2 * B, S))
    x_spec = P("dp", "tp") if op == "ag" else P("dp", None, "tp")
    w_spec = P(None, "tp") if op == "ag" else P("tp", None)
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    w = jax.device_put(w, NamedSharding(mesh, w_spec))
    fn = op_call(op)
    with jax.set_mesh(mesh):
        forward = jax.jit(lambda x, w: fn(x, w, "tp", impl="ub", seq_axis=1))
        y = forward(x, w)
        hlo = forward.lower(x, w).compile().as_text()
        grads = jax.jit(
            jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w, "tp", seq_axis=1))), argnums=(0, 1))
        )(x, w)
    assert rel_err(y, _product(x, w)) < 1e-5
    # The batch stays split over dp: no collective but the op's own custom call.
    assert not COLLECTIVE.search(hlo), COLLECTIVE.search(hlo)
    want_split = (None, None, "tp") if op == "ag" else (None, "tp", None)
    spec = tuple(y.sharding.spec) + (None,) * (3 - len(y.sharding.spec))
    assert (
        tuple("tp" if e == "tp" or (isinstance(e, tuple) and "tp" in e) else None for e in spec)
        == want_split
    )
    grads_ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(_product(x, w))), argnums=(0, 1))(x, w)
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "seq_axis, message",
    [
        (2, "seq_axis=2 is not a dim of x before its features"),
        (-1, "seq_axis=-1 is not"),
        (3, r"one of 0\.\.1 \(or -3\.\.-2\)"),
        (1.0, "seq_axis must be an int"),
        (True, "seq_axis must be an int"),
    ],
)
def test_bad_seq_axis_is_refused(rand, op, seq_axis, message):
    x, w = _global_operands(rand, op, (B, S))
    with pytest.raises(ValueError, match=message):
        op_call(op)(x, w, "tp", seq_axis=seq_axis)
    with pytest.raises(ValueError, match=message):
        jax_ub.gelu_mlp(x, w, w.T, "tp", seq_axis=seq_axis)


def test_reduce_scatter_names_the_sequence_dim_not_divisible(rand):
    mesh = make_mesh((TP, "tp"))
    x, w = rand(B, S + 2, K * TP), rand(K * TP, N)
    f = smap(
        lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", impl="ub", seq_axis=1),
        mesh,
        (P(None, None, "tp"), P("tp", None)),
        P(None, "tp"),
    )
    with pytest.raises(ValueError, match=r"rows of x \(dim 1\) \(18\) are not divisible"):
        f(x, w)


def _transposes(f, *args) -> int:
    """The transposes in the jaxpr of ``f``'s value and gradients, nested ones included."""
    grad = jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=tuple(range(len(args))))
    return str(jax.make_jaxpr(grad)(*args)).count("transpose[")


@pytest.mark.parametrize("op, moves", [("ag", 2), ("rs", 2), ("gelu_mlp", 0), ("gated_mlp", 0)])
def test_batch_major_moves_rows_at_most_once(rand, op, moves):
    """A batch-major shard is one block to the custom calls, so the ops move its rows once
    (into sequence order after a gather, into rank order before a reduce-scatter) and once
    more in the gradient; the MLPs, whose gathered rows meet only row-wise math before the
    scatter, not at all. Counted against the same op seq-major."""
    mesh = make_mesh((TP, "tp"))
    if op in ("ag", "rs"):
        x, w = _global_operands(rand, op, (B, S))
        ws = (w,)
        fns = {s: _local_fn(op, mesh, 3, s) for s in (0, 1)}
    else:
        x = rand(B, S, K)
        up = rand(K, 2, K, scale=0.3) if op == "gated_mlp" else rand(K, 2 * K, scale=0.3)
        ws = (up, rand(2 * K if op == "gelu_mlp" else K, K, scale=0.3))
        up_spec = P(None, None, "tp") if op == "gated_mlp" else P(None, "tp")
        call = getattr(jax_ub, op)
        fns = {
            s: smap(
                lambda x, up, down, s=s: call(x, up, down, "tp", impl="ub", seq_axis=s),
                mesh,
                (_spec(3, s), up_spec, P("tp", None)),
                _spec(3, s),
            )
            for s in (0, 1)
        }
    batch_major = _transposes(fns[1], x, *ws)
    seq_major = _transposes(fns[0], jnp.swapaxes(x, 0, 1), *ws)
    assert batch_major - seq_major == moves, (batch_major, seq_major)


# --- Flax layers -------------------------------------------------------------------------

D, HEADS = 16, 4


def _nnx_models(kind: str, mesh, seq_axis: int):
    kw = dict(mesh=mesh, impl="ub", seq_axis=seq_axis, rngs=nnx.Rngs(0))
    if kind == "column":
        return ubf.ColumnParallelLinear(D, 2 * D, **kw)
    if kind == "row":
        return ubf.RowParallelLinear(2 * D, D, **kw)
    if kind == "mlp":
        return ubf.ParallelMLP(D, 2 * D, **kw)
    return ubf.ParallelSelfAttention(D, HEADS, **kw)


@pytest.mark.parametrize("kind", ["column", "row", "mlp", "attention"])
def test_nnx_layers_batch_major_equal_seq_major(kind):
    """A layer with seq_axis=1 on [batch, seq, d] computes what the same layer (same
    params) computes on [seq, batch, d], moved; gradients too. The seq-major layers are
    checked against dense math in test_flax_nnx.py."""
    mesh = make_mesh((2, "dp"), (TP, "tp"))
    width = 2 * D if kind == "row" else D
    x_bm = jax.random.normal(jax.random.key(1), (2 * B, S, width))
    with jax.set_mesh(mesh):
        batch_major, seq_major = _nnx_models(kind, None, 1), _nnx_models(kind, None, 0)
        call = (lambda m, x: m(x, is_causal=True)) if kind == "attention" else (lambda m, x: m(x))

        @nnx.jit
        def loss_and_grads(model, x):
            def loss(model, x):
                return jnp.sum(jnp.sin(call(model, x)))

            return nnx.value_and_grad(loss, argnums=(0, 1))(model, x)

        y_bm = nnx.jit(call)(batch_major, x_bm)
        y_sm = nnx.jit(call)(seq_major, jnp.swapaxes(x_bm, 0, 1))
        (l_bm, (g_bm, gx_bm)) = loss_and_grads(batch_major, x_bm)
        (l_sm, (g_sm, gx_sm)) = loss_and_grads(seq_major, jnp.swapaxes(x_bm, 0, 1))
    assert y_bm.shape[:2] == (2 * B, S)
    assert rel_err(y_bm, jnp.swapaxes(y_sm, 0, 1)) < 1e-6
    assert rel_err(l_bm, l_sm) < 1e-6
    assert rel_err(gx_bm, jnp.swapaxes(gx_sm, 0, 1)) < 1e-6
    for a, b in zip(jax.tree.leaves(nnx.state(g_bm)), jax.tree.leaves(nnx.state(g_sm))):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_linen_blocks_batch_major_equal_seq_major(kind):
    mesh = make_mesh((TP, "tp"))
    x_bm = jax.random.normal(jax.random.key(2), (B, S, D))
    mask = jnp.tril(jnp.ones((S, S), bool))
    make = {
        "mlp": lambda s: ubl.ParallelMLP(2 * D, mesh=mesh, impl="ub", seq_axis=s),
        "attention": lambda s: ubl.ParallelSelfAttention(HEADS, mesh=mesh, impl="ub", seq_axis=s),
    }[kind]
    extra = (mask,) if kind == "attention" else ()
    seq_major, batch_major = make(0), make(1)
    variables = seq_major.init(jax.random.key(0), jnp.swapaxes(x_bm, 0, 1), *extra)
    y_sm = jax.jit(seq_major.apply)(variables, jnp.swapaxes(x_bm, 0, 1), *extra)
    y_bm = jax.jit(batch_major.apply)(variables, x_bm, *extra)
    assert rel_err(y_bm, jnp.swapaxes(y_sm, 0, 1)) < 1e-6


def test_flax_bad_seq_axis():
    mesh = make_mesh((TP, "tp"))
    with pytest.raises(ValueError, match="seq_axis must be an int"):
        ubf.ColumnParallelLinear(D, D, mesh=mesh, seq_axis="1", rngs=nnx.Rngs(0))
    layer = ubf.ColumnParallelLinear(D, D, mesh=mesh, seq_axis=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="seq_axis=2 is not a dim of x before its features"):
        layer(jnp.ones((B, S, D)))
    # The message names the shape passed, its contracted dims as they are (not flattened).
    layer = ubf.RowParallelLinear((4, 4), D, axis=(-2, -1), mesh=mesh, seq_axis=2, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=re.escape(f"for x.shape={(B, S, 4, 4)} it is one of 0..1")
    ):
        layer(jnp.ones((B, S, 4, 4)))
    layer = ubf.ColumnParallelLinear(D, D, mesh=mesh, seq_axis=1, rngs=nnx.Rngs(0))
    y = layer(jnp.ones((S, 6, D)))  # 6 rows over tp: replicated activations instead
    assert y.shape == (S, 6, D)
