"""Acceptance test, NNX: a Llama-style model written as NNX trainers write theirs, on its
own ``DenseGeneral`` (built with ``in_features_shape`` / ``out_features_shape``, n-d
kernels named by ``kernel_axes`` and placed by the rules, an n-d initializer called with
``in_axis`` / ``out_axis``, ``out_sharding=`` at call), its own RoPE and causal mask,
layers under ``nnx.remat``, switched to jax_ub by one assignment: its ``DenseGeneral``
replaced by ``jax_ub.flax.DenseGeneral``.

Against the trainer's own model, f32, on an fsdp 2 x tensor 2 mesh whose rules list
several mesh axes per name: the same params and shardings, equal loss and gradients leaf
by leaf, and jax_ub's custom calls in the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh

import jax_ub.flax as ubf

VOCAB, E, HEADS, HD, MLP, LAYERS, BATCH, LENGTH = 64, 32, 4, 8, 64, 2, 4, 16
AXES = ("data", "fsdp", "fsdp_transpose", "tensor", "autoregressive")
RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_heads", ("tensor", "autoregressive")),
    ("activation_kv", None),
    ("activation_mlp", ("tensor", "autoregressive")),
    ("activation_embed", None),
    ("embed", "fsdp"),
    ("heads", ("tensor", "autoregressive")),
    ("kv", None),
    ("mlp", ("fsdp_transpose", "tensor", "autoregressive")),
    ("vocab", None),
)


def nd_dense_init(scale: float, mode: str, distribution: str) -> Callable:
    """A trainer's initializer of n-d kernels: told which dims are contracted."""

    def init(key, shape, dtype, in_axis, out_axis):
        vs = jax.nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis)
        return vs(key, shape, dtype)

    return init


TRUNCATED = nd_dense_init(1.0, "fan_in", "truncated_normal")  # the trainer's default


class TrainerDenseGeneral(nnx.Module):
    """The trainer's own NNX projection."""

    def __init__(
        self, in_features_shape, out_features_shape, axis=-1, weight_dtype=jnp.float32,
        dtype=jnp.float32, kernel_init=TRUNCATED, kernel_axes=(), quant=None, use_bias=False,
        matmul_precision="default", *, rngs: nnx.Rngs,
    ):  # fmt: skip
        as_tuple = lambda v: (v,) if isinstance(v, int) else tuple(v)  # noqa: E731
        self.in_shape, self.out_shape = as_tuple(in_features_shape), as_tuple(out_features_shape)
        self.n_in, self.dtype = len(self.in_shape), dtype
        shape = self.in_shape + self.out_shape
        in_axis, out_axis = tuple(range(self.n_in)), tuple(range(self.n_in, len(shape)))
        kernel = kernel_init(rngs.params(), shape, weight_dtype, in_axis, out_axis)
        self.kernel = nnx.Param(kernel, out_sharding=kernel_axes)

    def __call__(self, inputs, out_sharding=None):
        n = inputs.ndim
        axes = tuple(range(n - self.n_in, n))
        out = jax.lax.dot_general(
            inputs.astype(self.dtype), self.kernel[...].astype(self.dtype),
            ((axes, tuple(range(self.n_in))), ((), ())),
        )  # fmt: skip
        return out if out_sharding is None else jax.lax.with_sharding_constraint(out, out_sharding)


def activations(*names):
    return nn.logical_to_mesh_axes(names)


def rope(x, positions):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[..., None, None] * freq
    a, b = x[..., :half], x[..., half:]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


class Block(nnx.Module):
    def __init__(self, dense: Callable, rngs: nnx.Rngs):
        self.q = dense(E, (HEADS, HD), kernel_axes=("embed", "heads", "kv"), rngs=rngs)
        self.k = dense(E, (HEADS, HD), kernel_axes=("embed", "heads", "kv"), rngs=rngs)
        self.v = dense(E, (HEADS, HD), kernel_axes=("embed", "heads", "kv"), rngs=rngs)
        self.o = dense(  # by the trainer's keyword names
            in_features_shape=(HEADS, HD),
            out_features_shape=E,
            axis=(-2, -1),
            kernel_axes=("heads", "kv", "embed"),
            rngs=rngs,
        )
        normal = nd_dense_init(2.0, "fan_in", "normal")  # a call site's own initializer
        self.wi = dense(E, MLP, kernel_axes=("embed", "mlp"), kernel_init=normal, rngs=rngs)
        self.wo = dense(MLP, E, kernel_axes=("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        heads = activations(
            "activation_batch", "activation_length", "activation_heads", "activation_kv"
        )
        embed = activations("activation_batch", "activation_length", "activation_embed")
        pos = jnp.arange(x.shape[1], dtype=jnp.float32)[None]
        q, k = rope(self.q(x, out_sharding=heads), pos), rope(self.k(x, out_sharding=heads), pos)
        v = self.v(x, out_sharding=heads)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD), -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
        x = x + self.o(out, out_sharding=embed)
        hidden = activations("activation_batch", "activation_length", "activation_mlp")
        return x + self.wo(jax.nn.gelu(self.wi(x, out_sharding=hidden)), out_sharding=embed)


class Model(nnx.Module):
    def __init__(self, dense: Callable, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(VOCAB, E, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(dense, rngs) for _ in range(LAYERS)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = nnx.remat(lambda b, x: b(x), policy=jax.checkpoint_policies.nothing_saveable)(
                block, x
            )
        return self.embed.attend(x)


def build(dense: Callable, mesh: Mesh) -> Model:
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        return nnx.jit(lambda: Model(dense, nnx.Rngs(0)))()


def loss(model, tokens):
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


@pytest.mark.slow
def test_nnx_trainer_model_swaps_to_jax_ub_by_one_assignment():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 1, 2, 1), AXES)
    ours_dense = functools.partial(
        ubf.DenseGeneral, use_bias=False, seq_axis=1, impl="ub", axis_name="tensor"
    )
    stock, ours = build(TrainerDenseGeneral, mesh), build(ours_dense, mesh)  # the one assignment
    assert ours.blocks[0].q.kind == "column" and ours.blocks[0].o.kind == "row"
    s_state, o_state = nnx.state(stock, nnx.Param), nnx.state(ours, nnx.Param)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(o_state), jax.tree.leaves(s_state), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, VOCAB)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        step = nnx.jit(nnx.value_and_grad(loss))
        (want, want_grads), (got, grads) = step(stock, tokens), step(ours, tokens)
        hlo = jax.jit(lambda s, t: loss(nnx.merge(*s), t)).lower(nnx.split(ours), tokens).as_text()
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo
    assert rel_err(got, want) < 1e-6
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(grads)),
        jax.tree.leaves(nnx.state(want_grads)),
        strict=True,
    ):
        assert rel_err(g, r) < 1e-5, (jax.tree_util.keystr(path), rel_err(g, r))
