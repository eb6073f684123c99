"""Dropout in the Flax blocks: of the attention weights (ParallelSelfAttention) and of the
hidden activations before the row-parallel projection (ParallelMLP, ParallelGatedMLP).
Off, the blocks compute what they did without it, bit for bit; on, userbuffers (impl="ub")
and lax collectives (impl="xla") draw the same masks from the same rng, forward and
backward. CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx

import jax_ub.flax as ubf
from jax_ub.flax import _attention

D, F, HEADS, SEQ, BATCH, TP = 16, 32, 4, 8, 2, 2
RATE = 0.3


def nnx_block(kind, mesh, impl, **kw):
    rngs = nnx.Rngs(0)
    if kind == "attention":
        return ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, impl=impl, rngs=rngs, **kw)
    if kind == "mlp":
        return ubf.ParallelMLP(D, F, mesh=mesh, impl=impl, rngs=rngs, **kw)
    return ubf.ParallelGatedMLP(D, F, mesh=mesh, impl=impl, rngs=rngs, **kw)


def linen_block(kind, mesh, impl, **kw):
    if kind == "attention":
        return ubf.linen.ParallelSelfAttention(num_heads=HEADS, mesh=mesh, impl=impl, **kw)
    if kind == "mlp":
        return ubf.linen.ParallelMLP(F, mesh=mesh, impl=impl, **kw)
    return ubf.linen.ParallelGatedMLP(F, mesh=mesh, impl=impl, **kw)


KINDS = ["attention", "mlp", "gated"]
CALL = {"attention": dict(is_causal=True), "mlp": {}, "gated": {}}


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_off_is_the_block_without_it(rand, kind):
    mesh = make_mesh((TP, "tp"))
    x = rand(SEQ, BATCH, D)
    plain = nnx_block(kind, mesh, "ub")
    y = plain(x, **CALL[kind])
    for kw in (dict(dropout_rate=0.0), dict(dropout_rate=RATE, deterministic=True)):
        assert jnp.array_equal(nnx_block(kind, mesh, "ub", **kw)(x, **CALL[kind]), y)
    dropping = nnx_block(kind, mesh, "ub", dropout_rate=RATE)
    assert jnp.array_equal(dropping(x, deterministic=True, **CALL[kind]), y)
    assert jnp.array_equal(nnx.view(dropping, deterministic=True)(x, **CALL[kind]), y)

    model = linen_block(kind, mesh, "ub")
    variables = model.init(jax.random.key(0), x)
    y = model.apply(variables, x, **CALL[kind])
    for kw in (dict(dropout_rate=0.0), dict(dropout_rate=RATE, deterministic=True)):
        same = linen_block(kind, mesh, "ub", **kw).apply(variables, x, **CALL[kind])
        assert jnp.array_equal(same, y)
    on = linen_block(kind, mesh, "ub", dropout_rate=RATE)
    assert jnp.array_equal(on.apply(variables, x, deterministic=True, **CALL[kind]), y)


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_dropout_ub_equals_xla_with_the_same_rng(rand, kind):
    mesh = make_mesh((TP, "tp"))
    x = rand(SEQ, BATCH, D)
    out, grads = {}, {}
    for impl in ("ub", "xla"):
        block = nnx_block(kind, mesh, impl, dropout_rate=RATE)

        def loss(m, x, key):
            return jnp.sum(jnp.sin(m(x, deterministic=False, rngs=key, **CALL[kind])))

        key = jax.random.key(7)
        out[impl] = nnx.jit(lambda m, x, key: m(x, rngs=key, deterministic=False, **CALL[kind]))(
            block, x, key
        )
        grads[impl] = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(block, x, key)
    determ = nnx_block(kind, mesh, "ub")(x, **CALL[kind])
    assert not jnp.allclose(out["ub"], determ)  # something was dropped
    assert rel_err(out["ub"], out["xla"]) < 1e-5
    for g, r in zip(jax.tree.leaves(grads["ub"]), jax.tree.leaves(grads["xla"]), strict=True):
        assert rel_err(g, r) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_linen_dropout_ub_equals_xla_with_the_same_rng(rand, kind):
    mesh = make_mesh((TP, "tp"))
    x = rand(SEQ, BATCH, D)
    variables = linen_block(kind, mesh, "xla").init(jax.random.key(0), x)
    out, grads = {}, {}
    for impl in ("ub", "xla"):
        model = linen_block(kind, mesh, impl, dropout_rate=RATE, deterministic=False)
        rngs = {"dropout": jax.random.key(7)}

        def loss(v, x, model=model, rngs=rngs):
            return jnp.sum(jnp.sin(model.apply(v, x, rngs=rngs, **CALL[kind])))

        out[impl] = jax.jit(functools.partial(model.apply, rngs=rngs, **CALL[kind]))(variables, x)
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, x)
    assert not jnp.allclose(out["ub"], linen_block(kind, mesh, "ub").apply(variables, x))
    assert rel_err(out["ub"], out["xla"]) < 1e-5
    for g, r in zip(jax.tree.leaves(grads["ub"]), jax.tree.leaves(grads["xla"]), strict=True):
        assert rel_err(g, r) < 1e-4
    # The "dropout" rng decides the mask.
    other = model.apply(variables, x, rngs={"dropout": jax.random.key(8)}, **CALL[kind])
    assert not jnp.allclose(other, out["xla"])


def test_dropout_needs_deterministic_and_a_rate_in_range(rand):
    mesh = make_mesh((TP, "tp"))
    x = rand(SEQ, BATCH, D)
    with pytest.raises(ValueError, match="dropout_rate=0.3 needs `deterministic`"):
        nnx_block("mlp", mesh, "ub", dropout_rate=RATE)(x)
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\), got 1.0"):
        nnx_block("mlp", mesh, "ub", dropout_rate=1.0)
    model = linen_block("mlp", mesh, "ub", dropout_rate=RATE)
    with pytest.raises(ValueError, match="deterministic"):
        model.init(jax.random.key(0), x)
    # With the stored stream, successive calls draw new masks.
    block = nnx_block("mlp", mesh, "ub", dropout_rate=RATE, deterministic=False)
    assert not jnp.allclose(block(x), block(x))


@pytest.mark.parametrize("q_per_kv", [1, 2])
def test_explicit_attention_is_jax_nn_without_dropout(rand, q_per_kv):
    """The softmax path dropout runs on is jax.nn.dot_product_attention (XLA's), mask,
    causal and grouped heads included."""
    q = rand(2, SEQ, HEADS, 8)
    k, v = rand(2, SEQ, HEADS // q_per_kv, 8), rand(2, SEQ, HEADS // q_per_kv, 8)
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, SEQ, SEQ)) > 0.3)
    mask = mask | jnp.eye(SEQ, dtype=bool)
    ours = _attention._explicit_attention(q, k, v, mask, True, lambda w: w)
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    assert rel_err(ours, ref) < 1e-5


def test_attention_dropout_masks_as_flax(rand):
    """Broadcast dropout (flax's default): one [seq, seq] keep mask for every batch entry
    and head, kept weights scaled by 1 / (1 - rate); per head (broadcast_dropout=False): a
    head's mask is the same whichever device holds it (tp 1, 2 or 4)."""
    w = jnp.ones((2, HEADS, SEQ, SEQ))
    key = jax.random.key(3)
    dropped = _attention._drop_weights(w, rate=0.5, key=key, broadcast=True, first_head=0)
    assert jnp.all(dropped == dropped[:1, :1]) and set(np.unique(dropped)) == {0.0, 2.0}
    whole = _attention._drop_weights(w, rate=0.5, key=key, broadcast=False, first_head=0)
    half = _attention._drop_weights(w[:, 2:], rate=0.5, key=key, broadcast=False, first_head=2)
    assert jnp.array_equal(whole[:, 2:], half)
    x = rand(SEQ, BATCH, D)
    out = {}
    for tp in (1, 2, 4):
        mesh = make_mesh((tp, "tp"))
        attn = nnx_block("attention", mesh, "ub", dropout_rate=RATE, broadcast_dropout=False)
        out[tp] = attn(x, is_causal=True, deterministic=False, rngs=jax.random.key(5))
    assert rel_err(out[2], out[1]) < 1e-5 and rel_err(out[4], out[1]) < 1e-5


def test_linen_mlp_dropout_in_a_model(rand):
    """The 'dropout' rng reaches a block inside a model, beside flax's own nn.Dropout: with
    the same rng, the model trains differently once the block's rate is not 0, and evaluates
    the same."""
    mesh = make_mesh((TP, "tp"))

    class Model(nn.Module):
        rate: float

        @nn.compact
        def __call__(self, x, train):
            mlp = ubf.linen.ParallelMLP(F, mesh=mesh, dropout_rate=self.rate)
            x = mlp(x, deterministic=not train)
            return nn.Dropout(RATE, deterministic=not train)(x)

    x = rand(SEQ, BATCH, D)
    variables = Model(RATE).init(jax.random.key(0), x, train=False)
    out = {
        (rate, train): Model(rate).apply(
            variables, x, train=train, rngs={"dropout": jax.random.key(1)}
        )
        for rate in (0.0, RATE)
        for train in (False, True)
    }
    assert jnp.array_equal(out[0.0, False], out[RATE, False])
    assert not jnp.allclose(out[0.0, True], out[RATE, True])  # the block's own mask
    assert not jnp.allclose(out[RATE, False], out[RATE, True])
