"""Acceptance test: a Llama-style linen LM written as public LLM trainers write theirs, on
its own ``DenseGeneral`` (n-d kernels with logical names, an n-d initializer called with
``in_axis`` / ``out_axis``, ``weight_dtype``, ``quant`` and ``matmul_precision`` options,
``out_sharding=`` at call), with its own RoPE, causal mask, grouped-query attention and
KV cache, layers under ``nn.scan`` or unrolled, under ``nn.remat``, and logical axis rules
that list several mesh axes per name, switched to jax_ub by one assignment: its
``DenseGeneral`` replaced by ``jax_ub.flax.linen.DenseGeneral``.

Against the trainer's own model, f32, on fsdp 2 x tensor 2 and data 2 x tensor 2 meshes:
the same params placed as the rules place them (initialized as a trainer does, jitted with
the rules' shardings), equal losses and gradients leaf by leaf, equal losses over a few
steps of the trainer's AdamW loop, greedy decoding token-equal through the model's cache,
and jax_ub's custom calls in the step.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err
from flax import linen as nn
from jax.sharding import Mesh

import jax_ub.flax as ubf

VOCAB, E, HEADS, KV, HD, MLP, LAYERS, BATCH, LENGTH = 64, 32, 4, 2, 8, 64, 2, 4, 16
AXES = ("data", "fsdp", "fsdp_transpose", "sequence", "tensor", "tensor_sequence")
RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", "sequence"),
    ("activation_heads", ("tensor", "tensor_sequence")),
    ("activation_kv", None),
    ("activation_mlp", ("tensor", "tensor_sequence")),
    ("activation_embed", None),
    ("activation_vocab", ("tensor", "tensor_sequence")),
    ("embed", ("fsdp", "sequence")),
    ("q_heads", ("tensor", "tensor_sequence")),
    ("kv_heads", ("tensor", "tensor_sequence")),
    ("kv", None),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence")),
    ("vocab", ("tensor", "tensor_sequence")),
    ("norm", None),
    ("layers", None),
)
CALL = re.compile(r"(jax_ub_\w+)")


def nd_dense_init(scale: float, mode: str, distribution: str) -> Callable:
    """A trainer's initializer of n-d kernels: told which dims are contracted."""

    def init(key, shape, dtype, in_axis, out_axis):
        vs = jax.nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis)
        return vs(key, shape, dtype)

    return init


# What a trainer's call sites pass its DenseGeneral: dtypes, its quantization (none here),
# the matmul precision and an n-d initializer of their own.
CALL_SITE = dict(
    dtype=jnp.float32,
    weight_dtype=jnp.float32,
    quant=None,
    matmul_precision="float32",
    kernel_init=nd_dense_init(1.0, "fan_in", "normal"),
)


class TrainerDenseGeneral(nn.Module):
    """The trainer's own projection, as public trainers write it."""

    features: int | tuple[int, ...]
    axis: int | tuple[int, ...] = -1
    weight_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    kernel_init: Callable = nd_dense_init(1.0, "fan_in", "truncated_normal")
    kernel_axes: tuple[str | None, ...] = ()
    quant: Any = None
    use_bias: bool = False
    matmul_precision: str = "default"

    @nn.compact
    def __call__(self, inputs, out_sharding=None):
        features = (self.features,) if isinstance(self.features, int) else self.features
        axis = (self.axis,) if isinstance(self.axis, int) else self.axis
        axis = tuple(a % inputs.ndim for a in axis)
        shape = tuple(inputs.shape[a] for a in axis) + features
        in_axis = tuple(range(len(axis)))
        out_axis = tuple(range(len(axis), len(shape)))
        init = nn.with_logical_partitioning(self.kernel_init, self.kernel_axes)
        kernel = self.param("kernel", init, shape, self.weight_dtype, in_axis, out_axis)
        kernel = jnp.asarray(kernel, self.dtype)
        out = jax.lax.dot_general(
            inputs.astype(self.dtype), kernel, ((axis, in_axis), ((), ())),
            precision=None if self.matmul_precision == "default" else self.matmul_precision,
        )  # fmt: skip
        if self.use_bias:
            bias_init = nn.with_logical_partitioning(nn.zeros_init(), self.kernel_axes[len(axis) :])
            out = out + self.param("bias", bias_init, features, self.weight_dtype).astype(
                self.dtype
            )
        if out_sharding is not None:
            out = jax.lax.with_sharding_constraint(out, out_sharding)
        return out


@dataclasses.dataclass(frozen=True)
class Config:
    dense: Callable[..., nn.Module] = TrainerDenseGeneral
    scan: bool = True
    remat: str = "full"
    decode: bool = False
    shard_activations: bool = True
    max_len: int = LENGTH


REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}


def activations(cfg: Config, *names):
    """The trainer's out_sharding: its activations' logical names as mesh axes."""
    return nn.logical_to_mesh_axes(names) if cfg.shard_activations else None


def rope(x, positions):
    """Rotary embedding of ``x [b, l, h, d]`` (halves rotated) at ``positions [b, l]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[..., None, None].astype(jnp.float32) * freq
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate(
        [a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1
    )


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.ones_init(), ("norm",)), (x.shape[-1],)
        )
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, positions):
        cfg, dense = self.cfg, functools.partial(self.cfg.dense, **CALL_SITE)
        heads = activations(
            cfg, "activation_batch", "activation_length", "activation_heads", "activation_kv"
        )
        q = dense((HEADS, HD), kernel_axes=("embed", "q_heads", "kv"), name="query")(
            x, out_sharding=heads
        )
        k = dense((KV, HD), kernel_axes=("embed", "kv_heads", "kv"), name="key")(
            x, out_sharding=heads
        )
        v = dense((KV, HD), kernel_axes=("embed", "kv_heads", "kv"), name="value")(
            x, out_sharding=heads
        )
        q, k = rope(q, positions), rope(k, positions)
        if cfg.decode:
            shape = (x.shape[0], cfg.max_len, KV, HD)
            ck = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            i = index.value
            ck.value = jax.lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
            cv.value = jax.lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
            index.value = i + x.shape[1]
            k, v = ck.value, cv.value
            mask = (jnp.arange(cfg.max_len)[None, :] <= i + jnp.arange(x.shape[1])[:, None])[
                None, None
            ]
        else:
            mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None, None]
        k, v = jnp.repeat(k, HEADS // KV, axis=2), jnp.repeat(v, HEADS // KV, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
        weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        embed = activations(cfg, "activation_batch", "activation_length", "activation_embed")
        o = dense(E, axis=(-2, -1), kernel_axes=("q_heads", "kv", "embed"), name="out")
        return o(out, out_sharding=embed)


class Mlp(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        cfg, dense = self.cfg, functools.partial(self.cfg.dense, **CALL_SITE)
        hidden = activations(cfg, "activation_batch", "activation_length", "activation_mlp")
        gate = dense(MLP, kernel_axes=("embed", "mlp"), name="wi_0")(x, out_sharding=hidden)
        up = dense(MLP, kernel_axes=("embed", "mlp"), name="wi_1")(x, out_sharding=hidden)
        embed = activations(cfg, "activation_batch", "activation_length", "activation_embed")
        return dense(E, kernel_axes=("mlp", "embed"), name="wo")(
            nn.silu(gate) * up, out_sharding=embed
        )


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, positions):
        x = x + Attention(self.cfg, name="self_attention")(
            RMSNorm(name="pre_attention_norm")(x), positions
        )
        return x + Mlp(self.cfg, name="mlp")(RMSNorm(name="post_attention_norm")(x)), None


class Decoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens, positions):
        cfg = self.cfg
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        x = nn.Embed(VOCAB, E, embedding_init=init, name="token_embedder")(tokens)
        block = nn.remat(Block, policy=REMAT[cfg.remat]) if cfg.remat != "none" else Block
        if cfg.scan:
            scanned = nn.scan(
                block,
                variable_axes={"params": 0, "cache": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,),
                length=LAYERS,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = scanned(cfg, name="layers")(x, positions)
        else:
            for i in range(LAYERS):
                x, _ = block(cfg, name=f"layers_{i}")(x, positions)
        x = RMSNorm(name="decoder_norm")(x)
        vocab = activations(cfg, "activation_batch", "activation_length", "activation_vocab")
        head = cfg.dense(VOCAB, kernel_axes=("embed", "vocab"), name="logits_dense", **CALL_SITE)
        return head(x, out_sharding=vocab)


def jax_ub_dense(axis_name: str | None) -> Callable:
    """The one assignment: the trainer's DenseGeneral becomes jax_ub's (its defaults where
    they differ from jax_ub's: no bias; batch-major activations)."""
    kw = {} if axis_name is None else {"axis_name": axis_name}
    return functools.partial(ubf.linen.DenseGeneral, use_bias=False, seq_axis=1, impl="ub", **kw)


def make_mesh(data: int, fsdp: int) -> Mesh:
    devices = np.array(jax.devices()[: data * fsdp * 2]).reshape(data, fsdp, 1, 1, 2, 1)
    return Mesh(devices, AXES)


def tokens(key, length=LENGTH):
    toks = jax.random.randint(key, (BATCH, length), 0, VOCAB)
    return toks, jnp.broadcast_to(jnp.arange(length), (BATCH, length))


def init_sharded(cfg: Config, mesh: Mesh):
    """The trainer's init: abstract init, logical specs, the rules' shardings, jitted."""
    model = Decoder(cfg)
    toks, pos = tokens(jax.random.key(1))
    abstract = jax.eval_shape(model.init, jax.random.key(0), toks, pos)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), toks, pos)
    return variables["params"], shardings["params"]


def loss_fn(model, params, toks, pos):
    logits = model.apply({"params": params}, toks[:, :-1], pos[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()


def train(cfg: Config, mesh: Mesh, steps: int):
    """The trainer's loop (AdamW): step 0's loss and grads, every step's loss, its HLO."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        params, shardings = init_sharded(cfg, mesh)
        tx = optax.adamw(3e-3)
        opt = tx.init(params)
        model = Decoder(cfg)

        @jax.jit
        def step(params, opt, toks, pos):
            loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(params, toks, pos)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, loss, grads

        batch = tokens(jax.random.key(2), LENGTH + 1)
        hlo = step.lower(params, opt, *batch).as_text()
        losses, first = [], None
        for i in range(steps):
            batch = tokens(jax.random.key(10 + i), LENGTH + 1)
            new, opt, loss, grads = step(params, opt, *batch)
            first = (params, grads) if first is None else first
            params = new
            losses.append(float(loss))
    return dict(
        losses=np.array(losses), params=first[0], grads=first[1], shardings=shardings, hlo=hlo
    )


def greedy(cfg: Config, mesh: Mesh, params, prompt, new: int):
    """Greedy decoding through the model's own cache: the prompt at once, then a token at a time."""
    model = Decoder(dataclasses.replace(cfg, decode=True, max_len=prompt.shape[1] + new))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        pos = jnp.broadcast_to(jnp.arange(prompt.shape[1]), prompt.shape)
        cache = model.init(jax.random.key(0), prompt, pos)["cache"]
        step = jax.jit(
            lambda p, c, t, q: model.apply({"params": p, "cache": c}, t, q, mutable=["cache"])
        )
        logits, state = step(params, cache, prompt, pos)
        out = []
        for t in range(new):
            token = jnp.argmax(logits[:, -1], -1)[:, None]
            out.append(token)
            position = jnp.full((BATCH, 1), prompt.shape[1] + t)
            logits, state = step(params, state["cache"], token, position)
    return np.asarray(jnp.concatenate(out, axis=1))


MESHES = {"fsdp2_tensor2": (1, 2, "tensor"), "data2_tensor2": (2, 1, None)}
LAYOUTS = {"scan_full_remat": (True, "full"), "unrolled_dots_remat": (False, "dots")}


# Each mesh and each layout once (their product adds no path: the layout is the model's
# structure, the mesh its shardings).
@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_name, layout",
    [("fsdp2_tensor2", "scan_full_remat"), ("data2_tensor2", "unrolled_dots_remat")],
)
def test_trainer_model_swaps_to_jax_ub_by_one_assignment(mesh_name, layout):
    data, fsdp, axis_name = MESHES[mesh_name]
    mesh = make_mesh(data, fsdp)
    scan, remat = LAYOUTS[layout]
    stock = Config(scan=scan, remat=remat)
    ours = dataclasses.replace(stock, dense=jax_ub_dense(axis_name))  # the one assignment
    runs = {name: train(cfg, mesh, steps=3) for name, cfg in (("stock", stock), ("ours", ours))}

    # Every param the same, and sharded as the trainer's own (the rules' shardings).
    a, b = runs["ours"]["params"], runs["stock"]["params"]
    assert jax.tree.structure(a) == jax.tree.structure(b)
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    for (path, x), y, want in zip(
        jax.tree_util.tree_leaves_with_path(nn.unbox(a)),
        jax.tree.leaves(nn.unbox(b)),
        jax.tree.leaves(runs["stock"]["shardings"], is_leaf=is_sharding),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(x, y, err_msg=name)
        assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding, want)
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), name
    query = nn.unbox(a)["layers"]["self_attention"]["query"]["kernel"] if scan else None
    if query is not None:  # [layers, embed, heads, kv]: heads over tensor
        assert query.addressable_shards[0].data.shape[2] == HEADS // 2

    # Losses and gradients equal; the trainer's loop takes the same steps.
    np.testing.assert_allclose(runs["ours"]["losses"], runs["stock"]["losses"], rtol=2e-6)
    grads = [
        jax.tree_util.tree_leaves_with_path(nn.unbox(runs[n]["grads"])) for n in ("ours", "stock")
    ]
    for (path, g), (_, r) in zip(*grads, strict=True):
        assert rel_err(g, r) < 1e-5, (jax.tree_util.keystr(path), rel_err(g, r))
    calls = set(CALL.findall(runs["ours"]["hlo"]))
    assert {"jax_ub_all_gather_matmul", "jax_ub_matmul_reduce_scatter"} <= calls, calls
    assert not CALL.findall(runs["stock"]["hlo"])

    # Greedy decoding through the model's own cache: the same tokens.
    if scan:
        prompt = tokens(jax.random.key(5), 4)[0]
        want = greedy(stock, mesh, b, prompt, 6)
        got = greedy(ours, mesh, a, prompt, 6)
        np.testing.assert_array_equal(got, want)
        assert len(np.unique(want)) > 1
