"""Tensor-parallel MLP and self-attention blocks for Flax NNX, built from the parallel layers.

Each block runs as one ``shard_map``: the column-parallel layer all-gathers the
sequence-parallel input into its matmul, the middle of the block works on the local
feature/head shard with no communication, and the row-parallel layer reduce-scatters the
result back to sequence-parallel. The gated MLP, :class:`ParallelGatedMLP`, lives in
:mod:`jax_ub.flax.nnx.gated` (and is importable from here too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype

from jax_ub.flax import _attention, _checks, _core, _projection
from jax_ub.flax._settings import ParallelConfig
from jax_ub.flax.nnx.base import (
    BiasedSettings,
    Dropping,
    block_config,
    check_split,
    prepare_call,
    sharded_param,
    take_settings,
)
from jax_ub.flax.nnx.gated import ParallelGatedMLP as ParallelGatedMLP  # re-exported
from jax_ub.flax.nnx.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _projections(config: ParallelConfig, settings: dict, rngs: nnx.Rngs) -> tuple[dict, dict]:
    """A block's column and row projections' keyword arguments: its settings (from
    :func:`take_settings`, resolved as ``config``), and their names from its ``kernel_axes``
    or its ``kernel_init``'s partitioning, ``(model dim, split dim)``, reversed for the row
    projection."""
    common = {name: settings[name] for name in ("param_axes", "use_bias", "kernel_init")}
    common |= dict(config=config, bias_init=settings["bias_init"], rngs=rngs)
    row = common | {"kernel_init": _projection.row_kernel_init(settings["kernel_init"])}
    kernel_axes = settings["kernel_axes"]
    if kernel_axes is None:
        return common, row
    return (
        common | {"kernel_axes": tuple(kernel_axes)},
        row | {"kernel_axes": tuple(reversed(kernel_axes))},
    )


class ParallelMLP(Dropping, nnx.Module):
    """``down_proj(activation(up_proj(x)))`` with tensor-parallel projections.

    ``up_proj`` is a :class:`ColumnParallelLinear` ``in_features -> hidden_features`` and
    ``down_proj`` a :class:`RowParallelLinear` ``hidden_features -> out_features``; the
    hidden activations stay feature-sharded on their device.

    Shapes and sharding: input ``[seq, *batch, in_features]`` and output
    ``[seq, *batch, out_features]``, both sequence-sharded ``P(axis_name, None, ...)``;
    ``seq`` and ``hidden_features`` are multiples of ``tp``.

    Example::

        >>> mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        >>> mlp = jax_ub.flax.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0))
        >>> jax.jit(mlp)(jnp.ones((32, 2, 16))).shape
        (32, 2, 16)

    Args:
      in_features: number of input features.
      hidden_features: number of hidden features; a multiple of ``tp``.
      out_features: number of output features (default: ``in_features``).
      activation: elementwise function applied to the hidden features (default: gelu,
        ``jax.nn.gelu``, which runs in the up-projection GEMMs' epilogue with its bias;
        other functions run in XLA after them).
      fp8: run both matmuls in fp8 (e4m3 forward, e5m2 gradients); the collectives move
        fp8 bytes. ``True`` or ``"current"``: current scaling; ``"delayed"``: delayed
        scaling, each projection keeping its own amax histories (as
        :class:`ColumnParallelLinear` describes); ``False``: no fp8 (default).
      dropout_rate: dropout of the hidden activations before ``down_proj`` (default 0:
        none), as ``nnx.Dropout``: ``deterministic`` (here, per call, or with
        ``nnx.view(model, deterministic=...)``) turns it off, and the masks draw from the
        call's ``rngs`` or else the ``dropout`` stream of ``rngs`` (forked). The masks are
        drawn per device for its shard of the hidden units, the same whichever ``impl``.
      deterministic: see ``dropout_rate`` (default None: given per call).
      config, mesh, axis_name, param_axes, impl, sequence_parallel, amax_history_length,
        seq_axis, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs: as for
        :class:`ColumnParallelLinear`, shared by both projections; names a
        ``kernel_init`` boxes its values with read ``(model dim, split dim)``, as
        ``kernel_axes`` do (reversed for the row-parallel projection).
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        out_features: int | None = None,
        activation: Callable[[jax.Array], jax.Array] = nnx.gelu,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        rngs: nnx.Rngs,
        **settings: Unpack[BiasedSettings],
    ):
        owner = type(self).__name__
        s = take_settings(owner, settings)
        config = block_config(owner, s)
        check_split(owner, config, "hidden_features", hidden_features)
        out_features = in_features if out_features is None else out_features
        col, row = _projections(config, s, rngs)
        self.up_proj = ColumnParallelLinear(in_features, hidden_features, **col)
        self.down_proj = RowParallelLinear(hidden_features, out_features, **row)
        self.activation = activation
        self._init_dropout(owner, dropout_rate, deterministic, rngs)

    def __call__(
        self, inputs: jax.Array, *, deterministic: bool | None = None, rngs=None
    ) -> jax.Array:
        """``[seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``.

        ``deterministic``, ``rngs``: the dropout's, as ``nnx.Dropout``'s call takes them
        (with ``dropout_rate`` > 0 only)."""
        up, down = self.up_proj, self.down_proj
        call = prepare_call(self, inputs, up, divisible={"hidden_features": up.out_features})
        key = self._dropout_key(deterministic, rngs)
        rate = self.dropout_rate if key is not None else 0.0
        f = _core.mlp_call(call, self.activation, inputs.ndim, up.use_bias, rate)
        return f(inputs, up.param_values(), down.param_values(), *([] if key is None else [key]))


class ParallelSelfAttention(Dropping, nnx.Module):
    """Multi-head self-attention with heads split over a tensor-parallel axis.

    ``qkv`` is a :class:`ColumnParallelLinear` ``in_features -> 3 * qkv_features`` whose
    output columns are ordered ``(head, q/k/v, head_dim)``, so each device's column shard
    holds the queries, keys and values of ``num_heads / tp`` whole heads. Each device
    attends over the full sequence for its heads, and ``out`` (a
    :class:`RowParallelLinear` ``qkv_features -> out_features``, rows ordered
    ``(head, head_dim)``) reduce-scatters the result back to sequence-parallel.

    Shapes and sharding: input ``[seq, *batch, in_features]`` and output
    ``[seq, *batch, out_features]``, both sequence-sharded ``P(axis_name, None, ...)``.

    Example::

        >>> attn = jax_ub.flax.ParallelSelfAttention(16, 4, mesh=mesh, rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((32, 2, 16)), is_causal=True).shape
        (32, 2, 16)

    Grouped-query attention (Llama 3, Mistral, Qwen): with ``num_kv_heads < num_heads``,
    each key/value head serves ``num_heads / num_kv_heads`` query heads, and ``qkv``'s
    columns are ordered ``(kv_head, [its queries, key, value], head_dim)``, so each device
    holds ``num_kv_heads / tp`` whole groups. From an unsharded checkpoint's ``q_proj
    [in, num_heads * head_dim]``, ``k_proj`` and ``v_proj [in, num_kv_heads * head_dim]``
    (``x @ kernel`` convention), with ``g = num_kv_heads``, ``r = num_heads / g``::

        q = q_proj.reshape(in_features, g, r, head_dim)
        k, v = (p.reshape(in_features, g, 1, head_dim) for p in (k_proj, v_proj))
        qkv_kernel = jnp.concatenate([q, k, v], axis=2).reshape(in_features, -1)

    and ``out``'s kernel is ``o_proj [num_heads * head_dim, out]`` as it is.
    ``rope_theta`` applies rotary position embeddings to queries and keys (Llama's
    convention, :func:`jax_ub.flax._attention.rotary`), positions ``0 .. seq - 1``.

    Args:
      in_features: number of input features.
      num_heads: number of attention (query) heads; a multiple of ``num_kv_heads``.
      num_kv_heads: number of key/value heads (default: ``num_heads``); a multiple of
        ``tp``.
      rope_theta: the rotary embeddings' base (e.g. 500000.0 for Llama 3), or None (default)
        for none.
      qkv_features: total width of the queries over all heads (default: ``in_features``);
        a multiple of ``num_heads``.
      out_features: number of output features (default: ``in_features``).
      attention_implementation: the attention core, as ``jax.nn.dot_product_attention``'s
        ``implementation``: ``"xla"``, ``"cudnn"`` (fused flash attention, GPUs only), or
        None (default): cuDNN on GPUs for 16-bit dtypes and head sizes up to 128 without
        a mask array, XLA otherwise.
      fp8: run both projections' matmuls in fp8 (e4m3 forward, e5m2 gradients); the
        collectives move fp8 bytes; the attention core stays in ``dtype``. ``True`` or
        ``"current"``: current scaling; ``"delayed"``: delayed scaling, each projection
        keeping its own amax histories (see :class:`ColumnParallelLinear`); ``False``: no
        fp8 (default).
      dropout_rate: dropout of the attention weights (after the softmax), as flax's
        attention (default 0: none). With it active the attention core runs the explicit
        softmax in XLA (``jax.nn.dot_product_attention`` and cuDNN have no dropout).
        ``deterministic`` and the rngs as ``nnx.Dropout``'s (see :class:`ParallelMLP`).
      broadcast_dropout: one ``[seq, seq]`` mask for every batch entry and head (default,
        flax's), else one per batch entry and head.
      deterministic, config, mesh, axis_name, param_axes, impl, sequence_parallel,
        amax_history_length, seq_axis, use_bias, dtype, param_dtype, kernel_init,
        bias_init, rngs: as for :class:`ParallelMLP` (the settings shared by the qkv and
        output projections).
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        rope_theta: float | None = None,
        qkv_features: int | None = None,
        out_features: int | None = None,
        attention_implementation: str | None = None,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        rngs: nnx.Rngs,
        **settings: Unpack[BiasedSettings],
    ):
        owner = type(self).__name__
        qkv_features = in_features if qkv_features is None else qkv_features
        out_features = in_features if out_features is None else out_features
        s = take_settings(owner, settings)
        config = block_config(owner, s)
        tp = _checks.group_size(owner, config.axis_name, mesh=config.mesh, required=False)
        head_dim, q_per_kv = _attention.check_heads(
            owner, num_heads, num_kv_heads, qkv_features, tp, config.axis_name, rope_theta
        )
        _attention.check_attention_implementation(owner, attention_implementation, config.mesh)
        col, row = _projections(config, s, rngs)
        width = _attention.qkv_width(head_dim, num_heads, q_per_kv)
        self.qkv = ColumnParallelLinear(in_features, width, **col)
        self.out = RowParallelLinear(qkv_features, out_features, **row)
        self.num_heads, self.q_per_kv, self.rope_theta = num_heads, q_per_kv, rope_theta
        self.head_dim = head_dim
        self.attention_implementation = attention_implementation
        self.broadcast_dropout = broadcast_dropout
        self._init_dropout(owner, dropout_rate, deterministic, rngs)

    def init_cache(
        self,
        batch: int,
        max_length: int,
        dtype: Dtype | None = None,
        *,
        batch_axis: str | tuple[str, ...] | None = None,
    ) -> None:
        """Allocate the key/value cache that ``decode=True`` calls fill: ``cached_key`` and
        ``cached_value`` ``[batch, max_length, num_kv_heads, head_dim]`` (``nnx.Cache``,
        the key/value heads split over the tensor-parallel axis like the layer's, the
        batch over ``batch_axis``, the mesh axes a data-parallel batch is split over, or
        kept whole with None), and ``cache_index``, the next position (0). ``dtype``
        defaults to the layer's."""
        qkv = self.qkv
        kv_heads = self.num_heads // self.q_per_kv
        dtype = dtype or qkv.dtype or qkv.param_dtype
        zeros = jnp.zeros((batch, max_length, kv_heads, self.head_dim), dtype)
        names = (batch_axis, None, qkv.axis_name, None)
        self.cached_key = sharded_param(zeros, names, qkv.mesh, nnx.Cache)
        self.cached_value = sharded_param(zeros, names, qkv.mesh, nnx.Cache)
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(
        self,
        inputs: jax.Array,
        mask: jax.Array | None = None,
        *,
        is_causal: bool = False,
        decode: bool = False,
        deterministic: bool | None = None,
        rngs=None,
    ) -> jax.Array:
        """Attend over ``inputs [seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``.

        Args:
          inputs: sequence-sharded activations.
          mask: optional mask broadcastable to ``[*batch, 1, seq, seq]``: booleans (True
            attends) or flax's 0/1 masks of another dtype (nonzero attends, as
            ``nn.make_attention_mask`` makes them).
          is_causal: each position attends only to itself and earlier ones; the same as
            ``mask=jnp.tril(jnp.ones((seq, seq), bool))`` but with no mask array, so the
            fused cuDNN kernel can run it.
          decode: the ``t`` tokens of ``inputs`` (``[t, batch, in_features]``, or
            ``[batch, t, ...]`` batch-major) continue the sequence in the cache
            (:meth:`init_cache`): they attend causally to it and to each other, their keys
            and values are written into it and ``cache_index`` advances by ``t``.
          deterministic, rngs: the attention dropout's, as ``nnx.Dropout``'s call takes
            them (with ``dropout_rate`` > 0 only; decoding drops nothing).
        """
        if decode:
            return self._decode(inputs, mask)  # causal whatever is_causal says
        owner = type(self).__name__
        qkv, out = self.qkv, self.out
        what = "num_heads" if self.q_per_kv == 1 else "num_kv_heads"
        heads = {what: self.num_heads // self.q_per_kv}
        settings = prepare_call(self, inputs, qkv, divisible=heads)
        if mask is not None:
            _attention.check_mask(owner, mask, inputs.shape, settings.seq_axis)
        key = self._dropout_key(deterministic, rngs)
        dropout = (
            {}
            if key is None
            else dict(dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout)
        )
        call = _attention.AttentionCall(
            head_dim=self.head_dim,
            ndim=inputs.ndim,
            use_bias=qkv.use_bias,
            has_mask=mask is not None,
            is_causal=bool(is_causal),
            implementation=self.attention_implementation,
            q_per_kv=self.q_per_kv,
            rope_theta=self.rope_theta,
            **dropout,
        )
        f = _attention.attention_call(settings, call)
        extra = () if key is None else (key,)
        return f(inputs, qkv.param_values(), out.param_values(), mask, *extra)

    def _decode(self, inputs: jax.Array, mask: jax.Array | None) -> jax.Array:
        owner = type(self).__name__
        qkv, out = self.qkv, self.out
        if getattr(self, "cached_key", None) is None:
            raise ValueError(f"{owner}: decode=True needs the cache: call init_cache first")
        if mask is not None:
            raise ValueError(
                f"{owner}: decode=True attends causally over the cache; pass no mask "
                f"(got one of shape {getattr(mask, 'shape', None)})"
            )
        shape = getattr(inputs, "shape", ())
        batch, length = self.cached_key.shape[:2]
        seq = _checks.seq_index(owner, shape, qkv.seq_axis) if len(shape) == 3 else None
        t = shape[seq] if seq is not None else None
        if seq is None or shape[1 - seq] != batch or shape[-1] != qkv.in_features:
            raise ValueError(
                f"{owner}: decode=True takes [t, batch, {qkv.in_features}] (or [batch, t, "
                f"{qkv.in_features}] with seq_axis=1) with the cache's batch {batch}; got "
                f"input shape {shape}"
            )
        _checks.group_size(owner, qkv.axis_name, inputs, mesh=qkv.mesh, impl=qkv.impl)
        settings = dataclasses.replace(qkv.config, seq_axis=seq, owner=owner)
        f = _attention.decode_call(
            settings, self.head_dim, qkv.use_bias, self.q_per_kv, self.rope_theta
        )
        index = self.cache_index[...]
        try:
            position = int(index)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
            # Under jit: known at run time only.
            position = None
        if position is not None and position + t > length:
            raise ValueError(
                f"{owner}: {t} new tokens at position {position} overflow the cache of "
                f"max_length {length}"
            )
        y, self.cached_key[...], self.cached_value[...] = f(
            inputs,
            qkv.param_values(),
            out.param_values(),
            self.cached_key[...],
            self.cached_value[...],
            index,
        )
        self.cache_index[...] = index + t
        # Under jit the position is not known until run time: an overflow gives NaN, never
        # numbers from a clipped write.
        return jnp.where(index + t <= length, y, jnp.nan)
