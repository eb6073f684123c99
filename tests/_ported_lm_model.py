"""The public-style LM of test_flax_ported_lm.py: a decoder-only LM written as flax's lm1b
example writes one (batch-first tokens, ``nn.Embed`` plus fixed sinusoidal position
embeddings with lm1b's decode-time ``cache_index``, blocks of LayerNorm -> causal
``nn.MultiHeadDotProductAttention`` -> dropout -> residual -> LayerNorm -> a gelu MLP of two
``nn.Dense`` -> residual, params with logical axes), and its port: the same code with the
attention and the MLP swapped for ``jax_ub.flax.linen.ParallelSelfAttention`` and
``ParallelMLP`` (``Config.ported``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import jax_ub.flax as ubf

VOCAB, D, HEADS, FFN, LAYERS, BATCH, MAX_LEN = 64, 32, 4, 64, 2, 4, 32
RATE, LR, STEPS, PROMPT, NEW_TOKENS = 0.1, 0.5, 5, 4, 8
RULES = (  # lm1b's, with its "model" axis named "tensor"
    ("batch", "data"),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
)
logical = nn.with_logical_partitioning
kernel_init = nn.initializers.lecun_normal()
zeros = nn.initializers.zeros_init()


# --- the model -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    ported: bool = False
    dtype: Any = jnp.float32
    dropout_rate: float = RATE
    decode: bool = False


def sinusoid(max_len, features):
    """lm1b's sinusoidal_init table, ``[1, max_len, features]``."""
    position = np.arange(max_len)[:, None]
    div = np.exp(np.arange(0, features, 2) * -(np.log(10000.0) / features))
    table = np.zeros((max_len, features), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(position * div), np.cos(position * div)
    return jnp.asarray(table[None])


class AddPositionEmbs(nn.Module):
    """lm1b's fixed position embeddings; decoding keeps the position in the cache."""

    decode: bool = False

    @nn.compact
    def __call__(self, x):
        length, table = x.shape[1], sinusoid(MAX_LEN, x.shape[-1])
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if is_initialized:
                i = index.value
                index.value = i + length
                return x + jax.lax.dynamic_slice_in_dim(table, i, length, axis=1).astype(x.dtype)
        return x + table[:, :length].astype(x.dtype)


class MlpBlock(nn.Module):
    """lm1b's MlpBlock: Dense -> gelu -> dropout -> Dense (names Dense_0, Dense_1)."""

    cfg: Config

    @nn.compact
    def __call__(self, x, deterministic):
        dense = dict(dtype=self.cfg.dtype)
        h = nn.Dense(
            FFN,
            kernel_init=logical(kernel_init, ("embed", "mlp")),
            bias_init=logical(zeros, ("mlp",)),
            **dense,
        )(x)
        h = nn.Dropout(self.cfg.dropout_rate)(nn.gelu(h), deterministic=deterministic)
        return nn.Dense(
            x.shape[-1],
            kernel_init=logical(kernel_init, ("mlp", "embed")),
            bias_init=logical(zeros, ("embed",)),
            **dense,
        )(h)


def attention(cfg, x, mask, deterministic):
    """The block's self-attention, named "attn": flax's, or (ported) jax_ub's."""
    if cfg.ported:
        return ubf.linen.ParallelSelfAttention(
            HEADS,
            kernel_axes=("embed", "heads"),
            seq_axis=1,
            impl="ub",
            dtype=cfg.dtype,
            dropout_rate=cfg.dropout_rate,
            name="attn",
        )(x, mask=mask, decode=cfg.decode, deterministic=deterministic)
    return nn.MultiHeadDotProductAttention(
        HEADS,
        dtype=cfg.dtype,
        # DenseGeneral initializes (and, under a mesh, constrains) the flat 2-D kernel:
        # q, k, v [embed, heads * kv] and out [heads * kv, embed]. Their leading names
        # then name [embed, heads, kv] and [heads, kv, embed] (the last dim unsplit).
        kernel_init=logical(kernel_init, ("embed", "heads")),
        out_kernel_init=logical(kernel_init, ("heads", "kv")),
        bias_init=logical(zeros, ("embed",)),  # lm1b's names for all its biases
        dropout_rate=cfg.dropout_rate,
        decode=cfg.decode,
        name="attn",
    )(x, mask=mask, deterministic=deterministic)


def mlp(cfg, x, deterministic):
    """The block's MLP, named "mlp": lm1b's MlpBlock, or (ported) jax_ub's."""
    if cfg.ported:
        return ubf.linen.ParallelMLP(
            FFN,
            kernel_axes=("embed", "mlp"),
            seq_axis=1,
            impl="ub",
            dtype=cfg.dtype,
            dropout_rate=cfg.dropout_rate,
            name="mlp",
        )(x, deterministic=deterministic)
    return MlpBlock(cfg, name="mlp")(x, deterministic)


class DecoderBlock(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, mask, deterministic):
        cfg = self.cfg
        norm = dict(
            dtype=cfg.dtype,
            scale_init=logical(nn.initializers.ones, ("embed",)),
            bias_init=logical(zeros, ("embed",)),
        )
        h = attention(cfg, nn.LayerNorm(**norm)(x), mask, deterministic)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = mlp(cfg, nn.LayerNorm(**norm)(x), deterministic)
        return x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


class DecoderLM(nn.Module):
    """Token ids ``[batch, length]`` -> logits ``[batch, length, vocab]``."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens, train=False):
        cfg, deterministic = self.cfg, not train
        embed = logical(nn.initializers.normal(1.0), ("vocab", "embed"))
        x = nn.Embed(VOCAB, D, embedding_init=embed, dtype=cfg.dtype)(tokens)
        x = AddPositionEmbs(decode=cfg.decode)(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        # lm1b's decoder mask (no padding mask: token 0 is an ordinary token here)
        mask = None if cfg.decode else nn.make_causal_mask(tokens)
        for i in range(LAYERS):
            x = DecoderBlock(cfg, name=f"block_{i}")(x, mask, deterministic)
        x = nn.LayerNorm(
            dtype=cfg.dtype,
            scale_init=logical(nn.initializers.ones, ("embed",)),
            bias_init=logical(zeros, ("embed",)),
        )(x)
        return nn.Dense(
            VOCAB,
            dtype=cfg.dtype,
            kernel_init=logical(kernel_init, ("embed", "vocab")),
            bias_init=logical(zeros, ("vocab",)),
            name="lm_head",
        )(x)
