"""Tensor-parallel MLP and self-attention blocks for Flax linen.

Same math, parameter names and sharding as the NNX blocks in :mod:`jax_ub.flax`; each
block runs as one ``shard_map`` around its two parallel layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from jax_ub.flax import _attention, _axes, _checks, _core, _gated, _projection
from jax_ub.flax.linen.layers import (
    Biased,
    ColumnParallelLinear,
    RowParallelLinear,
    SettingsModule,
    local_or_param,
)


def _layer_kwargs(block: nn.Module, kind: str) -> dict[str, Any]:
    """What a block passes on to its ``kind`` (column or row) parallel layer: its settings,
    and the layer's names from the block's ``kernel_axes`` or ``kernel_init``'s
    partitioning, ``(model dim, split dim)``, reversed for the row layer."""
    axes, init = block.kernel_axes, block.kernel_init
    if kind == "row":
        axes = None if axes is None else tuple(reversed(axes))
        init = _projection.row_kernel_init(init)
    return dict(
        config=block.resolved_config(),
        param_axes=block.param_axes,
        kernel_axes=axes,
        use_bias=block.use_bias,
        kernel_init=init,
        bias_init=block.bias_init,
    )


class _Block:
    """A block's tensor-parallel axis: ``axis_name``, or what the logical axis rules
    map its split dim (``kernel_axes[1]``) to, or ``"tp"``."""

    @nn.nowrap
    def _split_name(self) -> str | None:
        names, mesh_names = self._names()  # mesh axes: the axis is axis_name's, or "tp"
        owner = type(self).__name__
        return _axes.block_split_name(owner, None if mesh_names else names, self.param_axes)

    @nn.nowrap
    def _names(self) -> tuple[tuple | None, bool]:
        """The block's names ``(model dim, split dim)`` and whether they are mesh axes:
        ``kernel_axes`` (logical), or those ``kernel_init`` boxes values with (not both);
        None where neither names them."""
        owner = type(self).__name__
        return _axes.given_names(owner, self.kernel_axes, self.kernel_init, self.param_axes)


class ParallelMLP(_Block, Biased):
    """Linen version of :class:`jax_ub.flax.ParallelMLP`.

    ``down_proj(activation(up_proj(x)))``: a :class:`ColumnParallelLinear` to
    ``hidden_features`` and a :class:`RowParallelLinear` back to ``out_features``. Input and
    output ``[seq, *batch, features]`` are sequence-sharded ``P(axis_name, None, ...)``.

    Example::

        >>> mlp = jax_ub.flax.linen.ParallelMLP(64, mesh=mesh)
        >>> variables = mlp.init(jax.random.key(0), x)  # x: [seq, batch, 16]
        >>> jax.jit(mlp.apply)(variables, x).shape
        (32, 2, 16)

    Attributes:
      hidden_features: number of hidden features; a multiple of ``tp``.
      mesh: optional :class:`jax.sharding.Mesh` (default: the mesh set by ``jax.set_mesh``,
        or the enclosing shard_map's).
      out_features: number of output features (default: the input's).
      activation: elementwise function applied to the hidden features (default: gelu,
        ``jax.nn.gelu``, which runs in the up-projection GEMMs' epilogue with its bias;
        other functions run in XLA after them).
      fp8: run both matmuls in fp8 (e4m3 forward, e5m2 gradients); the collectives move
        fp8 bytes. ``True`` or ``"current"``: current scaling; ``"delayed"``: delayed
        scaling, ``up_proj`` and ``down_proj`` each keeping their amax histories in the
        ``"_overwrite_with_gradient"`` collection (see :class:`ColumnParallelLinear`);
        ``False``: no fp8 (default).
      dropout_rate: dropout of the hidden activations before ``down_proj`` (default 0),
        drawing from the ``"dropout"`` rng; ``deterministic`` (the attribute or the call's
        argument, merged as flax's attention merges them) turns it off.
      deterministic: see ``dropout_rate``.
      config, axis_name, param_axes, impl, sequence_parallel, amax_history_length,
        seq_axis, use_bias, dtype, param_dtype, kernel_init, bias_init: as for
        :class:`ColumnParallelLinear`, shared by both projections; names a
        ``kernel_init`` boxes its values with read ``(model dim, split dim)``, as
        ``kernel_axes`` do (reversed for the row-parallel projection).
    """

    hidden_features: int
    out_features: int | None = None
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    dropout_rate: float = 0.0
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None) -> jax.Array:
        """``[seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``.

        ``deterministic``: no dropout (merged with the attribute, as flax's attention
        does; with ``dropout_rate`` > 0 only). Dropout draws from the ``"dropout"`` rng."""
        in_features = inputs.shape[-1] if inputs.ndim else 0
        out_features = in_features if self.out_features is None else self.out_features
        up = ColumnParallelLinear(
            self.hidden_features, name="up_proj", **_layer_kwargs(self, "column")
        )
        down = RowParallelLinear(out_features, name="down_proj", **_layer_kwargs(self, "row"))
        call = self.prepare(inputs, divisible={"hidden_features": self.hidden_features})
        p_up = up.get_params(in_features)
        p_down = down.get_params(self.hidden_features)
        key = self.dropout_key(deterministic)
        rate = 0.0 if key is None else self.dropout_rate
        f = _core.mlp_call(call, self.activation, inputs.ndim, self.use_bias, rate)
        return f(inputs, p_up, p_down, *(() if key is None else (key,)))


class ParallelGatedMLP(_Block, SettingsModule):
    """Linen version of :class:`jax_ub.flax.ParallelGatedMLP`: the same params
    (``gate_up [in, 2, hidden]``, ``down_proj [hidden, out]``), math and sharding.

    Example::

        >>> mlp = jax_ub.flax.linen.ParallelGatedMLP(64, mesh=mesh)
        >>> variables = mlp.init(jax.random.key(0), x)  # x: [seq, batch, 16]
        >>> jax.jit(mlp.apply)(variables, x).shape
        (32, 2, 16)

    With ``fp8="delayed"`` the block keeps the NNX block's six amax histories, with its
    names (``gate_up_input_amax_history``, ..., ``down_proj_output_grad_amax_history``:
    float32 ``[amax_history_length]``, zeros at first, boxed with names ``(None,)``:
    replicated), in the ``"_overwrite_with_gradient"`` collection; train as
    :class:`ColumnParallelLinear` shows.

    Attributes:
      hidden_features: number of hidden features; a multiple of ``tp``.
      fp8: ``True`` or ``"current"``: both projections in fp8 with current scaling;
        ``"delayed"``: delayed scaling from the amax histories above; ``False``: no fp8
        (default).
      out_features, activation, amax_history_length, config, mesh, axis_name, param_axes,
        kernel_axes, impl, sequence_parallel, seq_axis, dtype, param_dtype, kernel_init: as
        for the NNX block.
      dropout_rate, deterministic: as for :class:`ParallelMLP`.
    """

    hidden_features: int
    out_features: int | None = None
    activation: str | Callable[[jax.Array], jax.Array] = "silu"
    dropout_rate: float = 0.0
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None) -> jax.Array:
        """``[seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``;
        ``deterministic`` as for :class:`ParallelMLP`."""
        owner = type(self).__name__
        config = self.prepare(inputs, divisible={"hidden_features": self.hidden_features})
        k, hidden = inputs.shape[-1], self.hidden_features
        out = k if self.out_features is None else self.out_features
        given, mesh_names = self._names()
        if given is None:
            names = _gated.gated_kernel_names(owner, config.axis_name, self.param_axes)
            partitioning = nn.with_partitioning
        elif mesh_names:  # kernel_init's nn.with_partitioning: mesh axes as given
            _axes.check_kernel_axes(owner, given, 2)
            (model, split), partitioning = given, nn.with_partitioning
            names = {"gate_up": (model, None, split), "down_proj": (split, model)}
        else:  # logical names, mapped by the user's logical_axis_rules
            names = _gated.logical_kernel_names(owner, given, self.param_axes)
            partitioning = nn.with_logical_partitioning

        def gate_up_init(key, shape, dtype):  # fan-in is k, not the 2 of [k, 2, hidden]
            flat = self.kernel_init(key, (shape[0], 2 * shape[2]), dtype)
            return _gated.unboxed(flat).reshape(shape)

        def down_init(key, shape, dtype):
            return _gated.unboxed(self.kernel_init(key, shape, dtype))

        split = {"gate_up": 2, "down_proj": 0}  # the hidden dim, over the axis

        def param(name, init, shape):
            init = partitioning(init, names[name], mesh=config.mesh)
            return local_or_param(
                self, config.axis_name, name, init, shape, config.param_dtype, split[name]
            )

        def history(name):
            # Zeros: scale 1 until the first step records its amaxes (as flax's fp8 ops).
            zeros = lambda: jnp.zeros((config.amax_history_length,), jnp.float32)  # noqa: E731
            init = partitioning(zeros, (None,), mesh=config.mesh)
            return self.variable(OVERWRITE_WITH_GRADIENT, name, init).value

        gate_up = param("gate_up", gate_up_init, (k, 2, hidden))
        down = param("down_proj", down_init, (hidden, out))
        key = self.dropout_key(deterministic)
        rate = 0.0 if key is None else self.dropout_rate
        f = _gated.gated_mlp_call(config, self.activation, inputs.ndim, rate)
        return f(inputs, gate_up, down, _gated.histories(config.fp8, history), key)


class ParallelSelfAttention(_Block, Biased):
    """Linen version of :class:`jax_ub.flax.ParallelSelfAttention`.

    ``qkv`` (column-parallel, columns ordered ``(head, q/k/v, head_dim)``) splits the heads
    over ``axis_name``; each device attends over the full sequence for its heads and
    ``out`` (row-parallel) reduce-scatters back. Input and output
    ``[seq, *batch, features]`` are sequence-sharded ``P(axis_name, None, ...)``.

    Example::

        >>> attn = jax_ub.flax.linen.ParallelSelfAttention(num_heads=4, mesh=mesh)
        >>> causal = jnp.tril(jnp.ones((32, 32), bool))
        >>> variables = attn.init(jax.random.key(0), x, causal)
        >>> jax.jit(attn.apply)(variables, x, causal).shape
        (32, 2, 16)

    Decoding with a key/value cache, as ``flax.linen.MultiHeadDotProductAttention`` does:
    with ``decode=True`` the block keeps ``cached_key`` and ``cached_value`` (``[batch,
    max_length, num_kv_heads, head_dim]`` in ``dtype`` or else ``param_dtype``, boxed like
    the params with names ``(None, None, axis_name, None)`` or, with ``kernel_axes``,
    ``(None, None, kernel_axes[1], None)``: the key/value heads split over the axis) and
    ``cache_index`` (int32, the next position) in the ``"cache"`` collection. The first
    ``decode=True`` call creates them, zeros at position 0, sized by its input
    ``[max_length, batch, features]``: ``init(..., decode=True)``, or an ``apply(...,
    decode=True, mutable=["cache"])`` given only the params. Later ``decode=True`` calls
    take a prompt or one token ``[t, batch, features]`` (``[batch, t, ...]`` with
    ``seq_axis=1``; activations replicated over the axis), attend causally over the cache
    (rotary positions from ``cache_index``) and, applied with ``mutable=["cache"]``, return
    the cache with their keys and values written and ``cache_index`` advanced by ``t``. A
    call past ``max_length`` raises a ValueError, or under ``jit`` gives NaN::

        >>> attn = jax_ub.flax.linen.ParallelSelfAttention(num_heads=4, mesh=mesh)
        >>> variables = attn.init(jax.random.key(0), jnp.ones((32, 2, 16)), decode=True)
        >>> nn.get_partition_spec(variables["cache"])  # max_length 32
        {'cache_index': P(), 'cached_key': P(None, None, 'tp', None),
         'cached_value': P(None, None, 'tp', None)}
        >>> step = jax.jit(lambda v, x: attn.apply(v, x, decode=True, mutable=["cache"]))
        >>> tokens = jax.random.normal(jax.random.key(1), (6, 2, 16))
        >>> y, cache = step(variables, tokens[:5])  # a prompt of 5 tokens
        >>> variables = {**variables, **cache}
        >>> y, cache = step(variables, tokens[5:])  # then one token
        >>> int(cache["cache"]["cache_index"]), y.shape
        (6, (1, 2, 16))
        >>> full = attn.apply(variables, tokens, is_causal=True)  # recomputed: the same
        >>> bool(jnp.allclose(y, full[5:], atol=1e-5))
        True

    Attributes:
      num_heads: number of attention (query) heads; a multiple of ``num_kv_heads``.
      num_kv_heads: key/value heads (default ``num_heads``; fewer: grouped-query
        attention, ``qkv`` laid out as :class:`jax_ub.flax.ParallelSelfAttention` says); a
        multiple of ``tp``.
      rope_theta: rotary embeddings' base, or None (default) for none.
      mesh: optional :class:`jax.sharding.Mesh` (default: the mesh set by ``jax.set_mesh``,
        or the enclosing shard_map's).
      qkv_features: total query (and key, value) width over all heads (default: the
        input's features); a multiple of ``num_heads``.
      out_features: number of output features (default: the input's).
      attention_implementation: ``"xla"``, ``"cudnn"`` or None (cuDNN flash attention on
        GPUs where it applies, else XLA); see :class:`jax_ub.flax.ParallelSelfAttention`.
      fp8: run both projections' matmuls in fp8 (e4m3 forward, e5m2 gradients); the
        collectives move fp8 bytes; the attention core stays in ``dtype``. ``True`` or
        ``"current"``: current scaling; ``"delayed"``: delayed scaling, ``qkv`` and
        ``out`` each keeping their amax histories in the ``"_overwrite_with_gradient"``
        collection (see :class:`ColumnParallelLinear`); ``False``: no fp8 (default).
      dropout_rate, broadcast_dropout, deterministic: dropout of the attention weights,
        as :class:`jax_ub.flax.ParallelSelfAttention`'s, drawing from the ``"dropout"``
        rng; ``deterministic`` as for :class:`ParallelMLP`.
      config, axis_name, param_axes, impl, sequence_parallel, amax_history_length,
        seq_axis, use_bias, dtype, param_dtype, kernel_init, bias_init: as for
        :class:`ColumnParallelLinear`, shared by both projections; names a
        ``kernel_init`` boxes its values with read ``(model dim, split dim)``, as
        ``kernel_axes`` do (reversed for the row-parallel projection).
    """

    num_heads: int
    num_kv_heads: int | None = None
    rope_theta: float | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    attention_implementation: str | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        mask: jax.Array | None = None,
        is_causal: bool = False,
        decode: bool = False,
        deterministic: bool | None = None,
    ) -> jax.Array:
        """Attend over ``inputs [seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``.

        ``mask``: optional mask broadcastable to ``[*batch, 1, seq, seq]``: booleans (True
        attends) or flax's 0/1 masks (``nn.make_attention_mask``; nonzero attends).
        ``deterministic``: no attention dropout (merged with the attribute, as flax's
        attention does; with ``dropout_rate`` > 0 only; decoding drops nothing).
        ``is_causal``: attend only to earlier positions, with no mask array (so
        the fused cuDNN kernel can run it). ``decode``: the ``t`` tokens of ``inputs``
        (``[t, batch, in_features]``, or ``[batch, t, ...]`` with ``seq_axis=1``) continue
        the sequence in the ``"cache"`` collection, as the class docstring shows: they
        attend causally to it and to each other (no mask), their keys and values are
        written into it and ``cache_index`` advances by ``t``. Where the cache does not
        exist yet, it is created with ``max_length`` the input's length, and the input is
        attended causally from position 0 without being written (flax's convention).
        """
        owner = type(self).__name__
        config = self.resolved_config()
        in_features = inputs.shape[-1] if inputs.ndim else 0
        qkv_features = in_features if self.qkv_features is None else self.qkv_features
        out_features = in_features if self.out_features is None else self.out_features
        out = RowParallelLinear(out_features, name="out", **_layer_kwargs(self, "row"))
        tp = out.tp_size(inputs, self.variables.get("params"))
        head_dim, q_per_kv = _attention.check_heads(
            owner,
            self.num_heads,
            self.num_kv_heads,
            qkv_features,
            tp,
            config.axis_name,
            self.rope_theta,
        )
        width = _attention.qkv_width(head_dim, self.num_heads, q_per_kv)
        qkv = ColumnParallelLinear(width, name="qkv", **_layer_kwargs(self, "column"))
        _attention.check_attention_implementation(owner, self.attention_implementation, config.mesh)
        if decode:
            return self._decode(inputs, mask, qkv, out, qkv_features, head_dim, q_per_kv)
        settings = self.prepare(inputs)
        if mask is not None:
            _attention.check_mask(owner, mask, inputs.shape, settings.seq_axis)
        p_qkv = qkv.get_params(in_features)
        p_out = out.get_params(qkv_features)
        key = self.dropout_key(deterministic)
        dropout = (
            {}
            if key is None
            else dict(dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout)
        )
        call = _attention.AttentionCall(
            head_dim=head_dim,
            ndim=inputs.ndim,
            use_bias=self.use_bias,
            has_mask=mask is not None,
            is_causal=bool(is_causal),
            implementation=self.attention_implementation,
            q_per_kv=q_per_kv,
            rope_theta=self.rope_theta,
            **dropout,
        )
        f = _attention.attention_call(settings, call)
        return f(inputs, p_qkv, p_out, mask, *(() if key is None else (key,)))

    @nn.nowrap
    def _decode(self, inputs, mask, qkv, out, qkv_features, head_dim, q_per_kv) -> jax.Array:
        """``decode=True``: :func:`jax_ub.flax._attention.decode_call` over the cache
        variables, created here where they do not exist yet."""
        owner = type(self).__name__
        if mask is not None:
            raise ValueError(
                f"{owner}: decode=True attends causally over the cache; pass no mask "
                f"(got one of shape {getattr(mask, 'shape', None)})"
            )
        has_cache = self.has_variable("cache", "cached_key")
        if not has_cache and not self.is_mutable_collection("cache"):
            raise ValueError(
                f"{owner}: decode=True needs the cache: create it with "
                f"model.init(..., decode=True) on an input of length max_length, or with "
                f"model.apply(..., decode=True, mutable=['cache']), and pass it back in the "
                f"variables' 'cache' collection"
            )
        if has_cache and not self.is_mutable_collection("cache"):
            raise ValueError(
                f"{owner}: decode=True writes the new keys and values into the cache: call "
                f"apply with mutable=['cache'] and keep the cache it returns"
            )
        config = self.resolved_config()
        shape = inputs.shape
        seq = _checks.seq_index(owner, shape, config.seq_axis) if len(shape) == 3 else None
        if has_cache:  # boxed or not: its one leaf
            batch, length = jax.tree.leaves(self.get_variable("cache", "cached_key"))[0].shape[:2]
        if len(shape) != 3 or (has_cache and shape[1 - seq] != batch):
            raise ValueError(
                f"{owner}: decode=True takes [t, batch, features] (or [batch, t, features] "
                f"with seq_axis=1)"
                + (f" with the cache's batch {batch}" if has_cache else "")
                + f"; got input shape {shape}"
            )
        t = shape[seq]
        if not has_cache:  # flax's convention: the first input's length is max_length
            batch, length = shape[1 - seq], t
        # The cache: [batch, max_length, kv_heads, head_dim], kv heads split like qkv's.
        if self.kernel_axes is None:
            names = (None, None, config.axis_name, None)
            partitioning = nn.with_partitioning
        else:  # logical names, mapped by the user's logical_axis_rules
            names = (None, None, self.kernel_axes[1], None)
            partitioning = nn.with_logical_partitioning
        kv_shape = (batch, length, self.num_heads // q_per_kv, head_dim)
        dtype = config.dtype or config.param_dtype
        zeros = partitioning(lambda: jnp.zeros(kv_shape, dtype), names, mesh=config.mesh)
        cached_key = self.variable("cache", "cached_key", zeros)
        cached_value = self.variable("cache", "cached_value", zeros)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        settings = dataclasses.replace(config, seq_axis=seq, owner=owner)
        f = _attention.decode_call(settings, head_dim, self.use_bias, q_per_kv, self.rope_theta)
        params = (qkv.get_params(shape[-1]), out.get_params(qkv_features))
        index = cache_index.value
        if not has_cache:  # just created: attend from position 0, keep the cache empty
            return f(inputs, *params, cached_key.value, cached_value.value, index)[0]
        try:
            position = int(index)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
            position = None  # under jit: known at run time only
        if position is not None and position + t > length:
            raise ValueError(
                f"{owner}: {t} new tokens at position {position} overflow the cache of "
                f"max_length {length}"
            )
        y, cached_key.value, cached_value.value = f(
            inputs, *params, cached_key.value, cached_value.value, index
        )
        cache_index.value = index + t
        # Under jit the position is not known until run time: an overflow gives NaN, never
        # numbers from a clipped write.
        return jnp.where(index + t <= length, y, jnp.nan)
