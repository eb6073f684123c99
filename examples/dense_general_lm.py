"""Your own Llama-style linen LM, written on flax's ``nn.DenseGeneral``, switched to jax_ub by
its projection constructors alone.

The model keeps what real code bases keep for themselves: interleaved RoPE (pairs ``(2i,
2i+1)`` rotated) at explicit positions, packed sequences (segment ids: a token sees the
earlier tokens of its own segment), grouped-query attention, its own KV cache for greedy
decoding (a ``"cache"`` collection), RMSNorm, a SwiGLU MLP with separate gate and up
kernels, and params named with logical axes (``nn.with_logical_partitioning``). Its
projections are built by two constructors, ``column`` (q, k, v, gate, up) and ``row`` (o,
down), ``nn.DenseGeneral`` by default: jax_ub's version of the model is the same code
with ``jax_ub.flax.linen.ColumnParallelLinear`` and ``RowParallelLinear`` passed instead.
With ``gather`` (``jax_ub.flax.linen.project``) q, k and v, and gate and up, run from one
gather of their input each. Runs on 2 GPUs where there are, else on 2 CPU devices:

    python3 examples/dense_general_lm.py

It initialises both versions from one key (the same checkpoint), then prints their losses
and the largest relative difference of their gradients (jit under ``jax.set_mesh``, the
rules mapping heads and the MLP's hidden units to the "tensor" axis), and what each
decodes greedily. ``tests/test_flax_general_lm.py`` checks the same, and
``benchmarks/general_lm_step.py`` times the step.
"""

from __future__ import annotations

import dataclasses
import functools
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Two CPU devices where there is no GPU (set before JAX starts; GPUs ignore it).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

import jax_ub.flax as ubf  # before JAX starts its devices: it sizes the CPU thread pool

VOCAB, E, HEADS, KV_HEADS, HD, FFN, LAYERS = 64, 32, 4, 2, 8, 64, 2
RULES = (
    ("batch", "data"),
    ("length", None),
    ("vocab", None),
    ("embed", None),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
)
logical = nn.with_logical_partitioning
init = nn.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class Config:
    column: Callable[..., nn.Module] = nn.DenseGeneral
    row: Callable[..., nn.Module] = nn.DenseGeneral
    gather: Callable[..., Any] | None = None
    dtype: Any = jnp.float32
    decode: bool = False
    max_len: int = 32
    vocab: int = VOCAB
    embed: int = E
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HD
    ffn: int = FFN
    layers: int = LAYERS


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Interleaved rotary embedding of ``x [b, l, h, d]`` at ``positions [b, l]``."""
    d = x.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [b, l, 1, d/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    even, odd = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", logical(nn.initializers.ones, ("embed",)), (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale).astype(x.dtype)


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, positions, segments):
        cfg = self.cfg
        kw = dict(dtype=cfg.dtype, use_bias=False)
        qkv_init = logical(init, ("embed", "heads", "kv"))
        q_proj = cfg.column((cfg.heads, cfg.head_dim), kernel_init=qkv_init, name="query", **kw)
        k_proj = cfg.column((cfg.kv_heads, cfg.head_dim), kernel_init=qkv_init, name="key", **kw)
        v_proj = cfg.column((cfg.kv_heads, cfg.head_dim), kernel_init=qkv_init, name="value", **kw)
        if cfg.gather is None:
            q, k, v = q_proj(x), k_proj(x), v_proj(x)
        else:
            q, k, v = cfg.gather(x, q_proj, k_proj, v_proj)
        q, k = rope(q, positions), rope(k, positions)
        if cfg.decode:  # one token, appended to this model's own cache
            b = x.shape[0]
            shape = (b, cfg.max_len, cfg.kv_heads, cfg.head_dim)
            ck = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            i = index.value
            ck.value = jax.lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
            cv.value = jax.lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
            index.value = i + 1
            k, v = ck.value, cv.value
            mask = (jnp.arange(cfg.max_len) <= i)[None, None, None, :]
        else:  # packed sequences: a token sees the earlier tokens of its segment
            causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            same = segments[:, :, None] == segments[:, None, :]
            mask = (causal[None] & same)[:, None]  # [b, 1, l, l]
        group = cfg.heads // cfg.kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(q.dtype)
        logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        o_init = logical(init, ("heads", "kv", "embed"))
        return cfg.row(cfg.embed, axis=(-2, -1), kernel_init=o_init, name="out", **kw)(out)


class Mlp(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        kw = dict(dtype=cfg.dtype, use_bias=False)
        up_init, down_init = logical(init, ("embed", "mlp")), logical(init, ("mlp", "embed"))
        gate_proj = cfg.column(cfg.ffn, kernel_init=up_init, name="gate", **kw)
        up_proj = cfg.column(cfg.ffn, kernel_init=up_init, name="up", **kw)
        if cfg.gather is None:
            gate, up = gate_proj(x), up_proj(x)
        else:
            gate, up = cfg.gather(x, gate_proj, up_proj)
        return cfg.row(cfg.embed, kernel_init=down_init, name="down", **kw)(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, positions, segments):
        x = x + Attention(self.cfg, name="attn")(RMSNorm(name="attn_norm")(x), positions, segments)
        return x + Mlp(self.cfg, name="mlp")(RMSNorm(name="mlp_norm")(x))


class LM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens, positions, segments):
        cfg = self.cfg
        embed = nn.Embed(
            cfg.vocab, cfg.embed, embedding_init=logical(init, ("vocab", "embed")), name="embed"
        )
        x = embed(tokens).astype(cfg.dtype)
        for i in range(cfg.layers):
            x = Block(cfg, name=f"block_{i}")(x, positions, segments)
        return embed.attend(RMSNorm(name="final_norm")(x)).astype(jnp.float32)


def loss_fn(model: LM, params, batch) -> jax.Array:
    """Next-token cross-entropy over the tokens of a segment (not across boundaries)."""
    tokens, positions, segments = batch
    logits = model.apply({"params": params}, tokens, positions, segments)
    labels = tokens[:, 1:]
    keep = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * keep) / jnp.maximum(jnp.sum(keep), 1)


def packed_batch(key: jax.Array, batch: int, length: int) -> tuple:
    """Tokens with two packed segments per row (positions restarting at each), the last
    row's tail padding (segment 0)."""
    tokens = jax.random.randint(key, (batch, length), 1, VOCAB)
    cut = length // 2 + 1
    idx = jnp.arange(length)
    segments = jnp.where(idx < cut, 1, 2)[None].repeat(batch, 0)
    segments = segments.at[-1, length - 2 :].set(0)
    positions = jnp.where(idx < cut, idx, idx - cut)[None].repeat(batch, 0)
    return tokens, positions, segments


def greedy(model_decode: LM, params, prompt: jax.Array, new_tokens: int, step=None) -> jax.Array:
    """Greedy decoding one token per call through the model's own cache."""
    batch = prompt.shape[0]
    step = step or jax.jit(
        lambda p, c, tok, pos: model_decode.apply(
            {"params": p, "cache": c}, tok, pos, jnp.ones_like(tok), mutable=["cache"]
        )
    )
    # One compiled program for the empty cache (the params it also makes are dropped).
    cache = jax.jit(lambda *args: model_decode.init(*args)["cache"])(
        jax.random.key(0), prompt[:, :1], jnp.zeros_like(prompt[:, :1]), prompt[:, :1]
    )
    out, token = [], prompt[:, :1]
    for t in range(prompt.shape[1] + new_tokens - 1):
        logits, state = step(params, cache, token, jnp.full((batch, 1), t, jnp.int32))
        cache = state["cache"]
        if t + 1 < prompt.shape[1]:
            token = prompt[:, t + 1 : t + 2]
        else:
            token = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(prompt.dtype)
            out.append(token)
    return jnp.concatenate(out, axis=1)


def jax_ub_config(gather: bool = True, **kw: Any) -> Config:
    """The model's config with jax_ub's projections (and ``project`` with ``gather``)."""
    settings = dict(impl="ub", seq_axis=1)  # batch-major activations, [batch, length, embed]
    return Config(
        column=functools.partial(ubf.linen.ColumnParallelLinear, **settings),
        row=functools.partial(ubf.linen.RowParallelLinear, **settings),
        gather=ubf.linen.project if gather else None,
        **kw,
    )


def main() -> None:
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("tensor",))
    batch = packed_batch(jax.random.key(1), 4, 16)
    params = nn.unbox(LM(Config()).init(jax.random.key(0), *batch)["params"])
    grad = jax.value_and_grad(loss_fn, argnums=1)
    loss, grads = jax.jit(grad, static_argnums=0)(LM(Config()), params, batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        ours, our_grads = jax.jit(grad, static_argnums=0)(LM(jax_ub_config()), params, batch)
    worst = max(
        float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(grads))
    )
    print(
        f"loss: nn.DenseGeneral {float(loss):.6f}, jax_ub {float(ours):.6f}; "
        f"gradients' largest relative difference {worst:.2e}"
    )
    prompt = batch[0][:, :4]
    print("greedy, nn.DenseGeneral:", greedy(LM(Config(decode=True)), params, prompt, 8)[0])
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        tokens = greedy(LM(jax_ub_config(decode=True)), params, prompt, 8)[0]
    print("greedy, jax_ub:         ", tokens)


if __name__ == "__main__":
    main()
