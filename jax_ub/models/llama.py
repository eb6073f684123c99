"""A Llama-style decoder built from jax_ub's Flax blocks, and its training step.

Token embedding, ``layers`` blocks (RMSNorm, grouped-query causal attention with rotary
embeddings, RMSNorm, SwiGLU MLP, each with a residual) under ``nnx.scan`` with a
``jax.checkpoint`` policy, a final RMSNorm, an LM head and the cross-entropy of the next
token; optax AdamW. Activations are batch-major ``[batch, seq, hidden]``: the batch split
over the mesh's ``dp`` axis, the sequence over ``tp`` between the blocks (sequence
parallelism: the norms and residuals run on ``seq / tp`` rows); the blocks' projections
are tensor-parallel over ``tp``. The embedding table and the LM head are split over
``tp`` by vocabulary (:class:`VocabParallelEmbed`; the head a column-parallel linear whose
logits stay split, :func:`cross_entropy` reducing over them where they lie), as Megatron
does: a replicated table's gradient would be all-reduced whole every step (vocab x hidden,
1 GB per table for Llama 3 8B in bf16) and its AdamW state kept on every device.

``impl`` picks the model's collectives: ``"ub"`` (jax_ub's overlapped ops), ``"xla"``
(XLA's collectives), ``"auto"``, or ``"none"``: the same GEMMs with the communication
removed (wrong numbers; the step's no-communication bound, which the model benchmark
times); ``fp8`` runs the blocks' projections in fp8 (current or
delayed scaling; with ``impl="xla"`` XLA's collectives and XLA's fp8 GEMMs of the same
quantized operands, flax's fp8 recipe). Run under ``jax.set_mesh(mesh)`` with a
``("dp", "tp")`` mesh.

The same model decodes: :meth:`Llama.init_cache` gives every block's attention a key/value
cache (stacked over the layers like the params), ``model(tokens, decode=True)`` (or
:meth:`Llama.decode`) runs a prompt or one new token per sequence through the same scanned
blocks against it, and :func:`greedy_generate` continues a prompt greedily. Decoding
activations are replicated over ``tp`` (a token or a short prompt has no sequence to
split); the blocks' projections stay tensor-parallel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
from jax_ub._src.lowering.unfused import collectives_of
from jax_ub._src.ops import placement
from jax_ub.flax.nnx.base import sharded_param


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's shapes."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward and backward, 3x the forward's matmuls, with
        causal attention counted at half the full square, as MFU is usually reported)."""
        head_dim = self.hidden // self.heads
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * head_dim
        per_layer = qkv + self.heads * head_dim * self.hidden + 3 * self.hidden * self.ffn
        attention = 2 * seq * self.hidden / 2  # q.k and p.v over half the square
        return 6 * (self.layers * per_layer + self.hidden * self.vocab) + 6 * self.layers * (
            attention
        )


PRESETS = {
    # Llama 3 8B's shapes; --layers picks how many of its 32 blocks fit the GPUs.
    "llama3-8b": LlamaConfig(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8),
    # For CPU devices: small enough for CI, every dim still split over tp = 2.
    "tiny": LlamaConfig(
        vocab=256, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, rope_theta=10000.0
    ),
}

REMAT_POLICIES = {
    "none": None,  # no rematerialization: keep every activation
    # keep the matmuls' outputs, XLA's dots and jax_ub's ops alike, recompute the rest
    "dots": jax_ub.dots_and_ops_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
}


def split_dims(cfg: LlamaConfig) -> dict[str, int]:
    """What the model splits over tp: the heads, key/value heads, the MLP's hidden units and
    the vocabulary, by name."""
    return dict(heads=cfg.heads, kv_heads=cfg.kv_heads, ffn=cfg.ffn, vocab=cfg.vocab)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last dim, in float32."""

    def __init__(self, features: int, *, eps: float, param_dtype: Any, rngs: nnx.Rngs):
        del rngs
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class VocabParallelEmbed(nnx.Module):
    """``tokens [batch, seq]`` (int) -> ``[batch, seq, features]`` from a table
    ``embedding [vocab, features]`` whose rows are split over ``axis``.

    Each device looks the tokens up in its own rows (zeros for tokens outside them); the
    partial sums are then reduce-scattered over the sequence (``sequence_parallel``: the
    output sharded ``P(None, axis, None)``, as the blocks take it in training) or
    all-reduced (replicated over ``axis``, as for decoding). The table's gradient is a
    scatter-add into each device's own rows, with no all-reduce. The param and its default
    initializer are ``nnx.Embed``'s, its rows split ``P(axis, None)``: a checkpoint's
    ``[vocab, features]`` table loads as it is. Called from ``jit`` under ``jax.set_mesh``;
    ``vocab`` and (sequence-parallel) ``seq`` must be divisible by the axis's size.
    ``impl="none"`` sums the partial sums locally, uncommunicated (the bound's); other
    values use XLA's collectives.
    """

    def __init__(
        self,
        vocab: int,
        features: int,
        *,
        axis: str = "tp",
        impl: str = "auto",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        table = init(rngs.params(), (vocab, features), param_dtype)
        self.embedding = sharded_param(table, (axis, None), None)
        self.axis, self.impl, self.dtype = axis, impl, dtype

    def __call__(self, tokens: jax.Array, *, sequence_parallel: bool) -> jax.Array:
        axis, dtype = self.axis, self.dtype or self.embedding.dtype
        collectives = collectives_of(self.impl)

        def lookup(table, tokens):
            rows = table.shape[0]
            local = tokens - jax.lax.axis_index(axis) * rows
            mine = (local >= 0) & (local < rows)
            x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0).astype(dtype)
            x = jnp.where(mine[..., None], x, jnp.zeros((), dtype))
            if not sequence_parallel:
                # XLA's in float32 on CPU devices: jax_compat says why.
                return collectives.all_reduce(x, axis)
            # Into rank-major row blocks (the move fuses into the lookup); this rank's
            # block comes back batch-major as it is.
            blocks = placement.to_rank_blocks(x, 1, jax.lax.axis_size(axis))
            return placement.from_rank_block(collectives.scatter_rows(blocks, axis), 1)

        # Jitted: JAX runs a partly manual shard_map only traced (an eager call fails).
        return jax.jit(
            jax.shard_map(
                lookup,
                in_specs=(P(axis, None), P()),
                out_specs=P(None, axis, None) if sequence_parallel else P(),
                axis_names={axis},
                check_vma=False,
            )
        )(self.embedding[...], tokens)


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``, on ``[batch, seq, hidden]``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        impl: str,
        fp8: bool | str,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        common = dict(
            impl=impl, fp8=fp8, seq_axis=1, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        norm = dict(eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.hidden, **norm)
        self.attn = ubf.ParallelSelfAttention(
            cfg.hidden,
            cfg.heads,
            num_kv_heads=cfg.kv_heads,
            rope_theta=cfg.rope_theta,
            use_bias=False,
            **common,
        )
        self.mlp_norm = RMSNorm(cfg.hidden, **norm)
        self.mlp = ubf.ParallelGatedMLP(cfg.hidden, cfg.ffn, **common)

    def __call__(self, x: jax.Array, decode: bool = False) -> jax.Array:
        # With decode=True the attention reads and extends its cache (causal over it).
        x = x + self.attn(self.attn_norm(x), is_causal=not decode, decode=decode)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """The decoder: ``tokens [batch, seq]`` (int) -> logits ``[batch, seq, vocab]``.

    Args:
      cfg: the shapes.
      impl: the model's collectives (``"ub"``, ``"xla"``, ``"auto"``, ``"none"``).
      fp8: the blocks' projections in fp8: ``False``, ``"current"`` or ``"delayed"``
        (amax histories kept per layer; :func:`train_step` overwrites them).
      remat: ``"none"``, ``"dots"`` (keep the matmuls' outputs, recompute the rest) or
        ``"full"`` (recompute each block in the backward).
      dtype: the computation's dtype (None: the params').
      param_dtype: the params' dtype.
      scan_unroll: blocks per iteration of the scan over them (``True``: all, no loop left),
        as ``jax.lax.scan``'s ``unroll``.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        impl: str = "auto",
        fp8: bool | str = False,
        remat: str = "dots",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        scan_unroll: int | bool = 1,
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        tp = jax.sharding.get_abstract_mesh().shape.get("tp", 1)
        split = [f"{name}={size}" for name, size in split_dims(cfg).items() if size % tp]
        if split:
            raise ValueError(
                f"Llama: the mesh's tp ({tp}) must divide what the model splits over it; it "
                f"does not divide {', '.join(split)}"
            )
        self.embed = VocabParallelEmbed(
            cfg.vocab, cfg.hidden, impl=impl, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def blocks(rngs):
            return Block(cfg, impl=impl, fp8=fp8, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.blocks = blocks(rngs)
        self.norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        # Column-parallel: the vocabulary split over tp, the sequence gathered into the
        # matmul (overlapped with impl="ub"); the logits stay split (cross_entropy).
        self.head = ubf.ColumnParallelLinear(
            cfg.hidden,
            cfg.vocab,
            use_bias=False,
            impl=impl,
            seq_axis=1,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.remat = remat
        self.scan_unroll = scan_unroll

    def init_cache(self, batch: int, max_length: int, dtype: Any = None) -> None:
        """Allocate (or reset to empty) every block's key/value cache for ``batch``
        sequences of up to ``max_length`` tokens, prompt included: each attention's
        ``init_cache`` run under ``nnx.vmap``, so ``cached_key`` and ``cached_value`` are
        ``[layers, batch, max_length, kv_heads, head_dim]`` (the batch split over ``dp``
        where the mesh has it, as the tokens are; kv heads over ``tp``) and ``cache_index``
        ``[layers]``, scanned with the blocks like their params. ``dtype`` defaults to the
        attention's."""
        mesh = jax.sharding.get_abstract_mesh()
        dp = "dp" if "dp" in mesh.axis_names else None
        if dp and batch % mesh.shape[dp]:
            raise ValueError(
                f"Llama.init_cache: batch ({batch}) must be a multiple of the mesh's dp "
                f"({mesh.shape[dp]}): the cache splits its sequences over dp, as the tokens"
            )

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def init(b):
            b.attn.init_cache(batch, max_length, dtype, batch_axis=dp)

        init(self.blocks)

    def decode(self, tokens: jax.Array) -> jax.Array:
        """``tokens [batch, t]`` continuing the cached sequences (a prompt to prefill, or
        ``t = 1``) -> their logits ``[batch, t, vocab]``; the cache advances by ``t``."""
        return self(tokens, decode=True)

    def __call__(self, tokens: jax.Array, *, decode: bool = False) -> jax.Array:
        """``tokens [batch, seq]`` -> logits ``[batch, seq, vocab]``; with ``decode=True``
        the tokens continue the sequences in the cache (:meth:`init_cache`)."""
        tp = jax.sharding.get_abstract_mesh().shape.get("tp", 1)
        x = self.embed(tokens, sequence_parallel=not decode and tokens.shape[1] % tp == 0)
        policy = REMAT_POLICIES[self.remat]

        def block(x, b):
            return b(x, decode)

        # Decoding takes no gradient: nothing to rematerialize.
        if self.remat != "none" and not decode:
            block = nnx.remat(block, policy=policy)

        @nnx.scan(
            in_axes=(nnx.Carry, 0),
            out_axes=nnx.Carry,
            unroll=self.scan_unroll,
            transform_metadata={nnx.PARTITION_NAME: None},
        )
        def layers(x, b):
            return block(x, b)

        x = layers(x, self.blocks)
        return self.head(self.norm(x))


@nnx.jit
def _decode(model: Llama, tokens: jax.Array) -> jax.Array:
    return model.decode(tokens)


def greedy_generate(
    model: Llama, prompt: jax.Array, steps: int, max_length: int | None = None
) -> jax.Array:
    """``prompt [batch, p]`` followed by its ``steps`` greedy (argmax) next tokens:
    ``[batch, p + steps]``. Allocates the model's cache (``max_length``, default
    ``p + steps``), prefills it with the prompt in one step, then decodes a token at a
    time (two compiled steps: the prompt's length and one token)."""
    if steps < 0:
        raise ValueError(f"greedy_generate: steps must be >= 0, got {steps}")
    batch, length = prompt.shape
    if max_length is not None and max_length < length + steps:
        # The jitted decode cannot check its cache's room: the steps past it would be NaN.
        raise ValueError(
            f"greedy_generate: max_length ({max_length}) must hold the prompt and the steps: "
            f"{length} + {steps} = {length + steps} tokens"
        )
    model.init_cache(batch, length + steps if max_length is None else max_length)
    tokens = [prompt]
    if steps:
        logits = _decode(model, prompt)
        for i in range(steps):
            nxt = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
            tokens.append(nxt)
            if i + 1 < steps:
                logits = _decode(model, nxt)
    return jnp.concatenate(tokens, axis=1)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log softmax(logits)[target]`` per position: ``logits [..., vocab]``, ``targets
    [...]`` (int), computed in float32 (optax's ``softmax_cross_entropy_with_integer_labels``).
    Written with reductions over the vocabulary only, so that logits split over it stay
    split: each reduction is a local one and an all-reduce of ``[...]`` values, where
    picking the targets' logits by index would make XLA gather the logits."""
    logits = logits.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1)) + top[..., 0]
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    return log_sum - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)


def next_token_loss(model: Llama, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of each next token (the last position has none to predict)."""
    if tokens.shape[1] < 2:
        raise ValueError(
            f"next_token_loss: a sequence needs at least 2 tokens to predict one, got "
            f"{tokens.shape=}"
        )
    targets = jnp.roll(tokens, -1, axis=1)
    losses = cross_entropy(model(tokens), targets)
    valid = jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1
    return jnp.sum(losses * valid) / (tokens.shape[0] * (tokens.shape[1] - 1))


def float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` keeping its state in float32 whatever the params' dtype (bf16 params with
    float32 AdamW moments, as mixed-precision training does): it sees float32 gradients
    and params, and its updates come back in each param's dtype."""

    def f32(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32), tree)

    def init(params):
        return tx.init(f32(params))

    def update(grads, state, params=None):
        updates, state = tx.update(f32(grads), state, None if params is None else f32(params))
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(init, update)


def make_optimizer(model: Llama, learning_rate: float = 3e-4) -> nnx.Optimizer:
    """AdamW over the params, its moments in float32 whatever the params' dtype."""
    tx = float32_state(optax.adamw(learning_rate, weight_decay=0.1))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def loss_and_update(model: Llama, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    """One AdamW step on ``tokens [batch, seq]``; returns the loss before it. With delayed
    fp8 the amax histories are differentiated too and overwritten with their gradients
    (flax's OVERWRITE_WITH_GRADIENT convention)."""
    owg = ubf.OverwriteWithGradient
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, owg))
    loss, grads = nnx.value_and_grad(next_token_loss, argnums=wrt)(model, tokens)
    optimizer.update(model, nnx.state(grads, nnx.Param))
    nnx.update(model, nnx.state(grads, owg))
    return loss


train_step = nnx.jit(loss_and_update)
