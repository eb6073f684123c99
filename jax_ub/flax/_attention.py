"""The attention block's pieces shared by the nnx and linen layers: its argument checks, the
choice of attention kernel, and the per-shard computation (QKV projection, attention over
the local heads, output projection) in ``jax.shard_map``. Layout as in ``_core``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ub._src.lowering import batch_layout
from jax_ub._src.ops import placement
from jax_ub._src.runtime.extension import normalize_platform
from jax_ub.flax import _checks, _core, _projection
from jax_ub.flax._settings import ParallelConfig


def check_mask(owner: str, mask: Any, x_shape: tuple[int, ...], seq_axis: int = 0) -> None:
    """mask must broadcast to ``[*batch, 1, seq, seq]`` (one mask for every head); the
    batch dims are the input's others but the features, in order. ``seq_axis``: an index
    (``_checks.prepare``'s)."""
    seq = x_shape[seq_axis]
    batch = tuple(d for i, d in enumerate(x_shape[:-1]) if i != seq_axis)
    target = batch + (1, seq, seq)
    shape = tuple(getattr(mask, "shape", ()))
    try:
        ok = len(shape) <= len(target) and jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{owner}: mask of shape {shape} does not broadcast to [*batch, 1, seq, seq] = "
            f"{target} (heads are split over devices, so the head dim of the mask must be 1)"
        )
    dtype = jnp.dtype(getattr(mask, "dtype", jnp.bool_))
    if not any(jnp.issubdtype(dtype, kind) for kind in (jnp.bool_, jnp.integer, jnp.floating)):
        raise ValueError(
            f"{owner}: mask of dtype {dtype}: pass booleans or flax's 0/1 float masks "
            f"(nonzero attends); mask shape {shape}"
        )


def check_heads(
    owner: str,
    num_heads: int,
    num_kv_heads: int | None,
    qkv_features: int,
    tp: int | None,
    axis_name: str,
    rope_theta: float | None = None,
) -> tuple[int, int]:
    """``(head_dim, queries per key/value head)`` of a (grouped-query) attention block, or a
    ValueError naming the setting: ``num_kv_heads`` (default ``num_heads``) divides
    ``num_heads`` and is a multiple of ``tp`` (whole groups on each device), ``num_heads``
    divides ``qkv_features``, and rotary embeddings need an even head size."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or kv <= 0 or num_heads % kv != 0:
        raise ValueError(f"{owner}: num_kv_heads={kv} must divide num_heads={num_heads}")
    if tp is not None:
        what = "num_heads" if num_kv_heads is None else "num_kv_heads"
        _checks.check_divisible(owner, what, kv, tp, axis_name)
    if qkv_features % num_heads != 0:
        raise ValueError(f"{owner}: qkv_features={qkv_features} is not divisible by {num_heads=}")
    head_dim = qkv_features // num_heads
    if rope_theta is not None and (head_dim % 2 or not rope_theta > 0):
        raise ValueError(
            f"{owner}: rotary embeddings need an even head size and rope_theta > 0, got "
            f"head_dim={head_dim} (qkv_features={qkv_features} / {num_heads=}), {rope_theta=}"
        )
    return head_dim, num_heads // kv


def qkv_width(head_dim: int, num_heads: int, q_per_kv: int) -> int:
    """Columns of the fused QKV projection: per key/value head, its ``q_per_kv`` queries,
    its key and its value."""
    return (num_heads // q_per_kv) * (q_per_kv + 2) * head_dim


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embeddings of ``x [batch, seq, heads, head_dim]`` at ``positions
    [seq]``, in the convention of Llama's reference and Hugging Face checkpoints: the two
    halves of each head are rotated as pairs ``(x[i], x[i + head_dim / 2])`` by
    ``position * theta ** (-2i / head_dim)``. Computed in float32."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [seq, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")


def check_attention_implementation(owner: str, implementation: Any, mesh: Mesh | None) -> None:
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"{owner}: attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    platform = platform_of(mesh)
    if implementation == "cudnn" and normalize_platform(platform) != "cuda":
        raise ValueError(
            f"{owner}: attention_implementation='cudnn' needs GPU devices, but the mesh is "
            f"on {platform!r}; use None (picks per platform) or 'xla'"
        )


def _attention_backend(
    requested: str | None, platform: str, dtype: Any, head_dim: int, has_mask: bool
) -> str:
    """What ``implementation=None`` means: cuDNN flash attention where it applies, else XLA.

    XLA's attention materialises the ``[heads, seq, seq]`` logits in f32, which dominates
    a long-sequence step; cuDNN's fused kernel does not. It takes 16-bit inputs and head
    sizes up to 128; an arbitrary boolean mask stays on XLA (``is_causal`` does not need one).
    """
    if requested is not None:
        return requested
    eligible = (
        normalize_platform(platform) == "cuda"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim <= 128
        and head_dim % 8 == 0
        and not has_mask
    )
    return "cudnn" if eligible else "xla"


def attention_local(
    qkv: jax.Array,
    mask: jax.Array | None,
    *,
    head_dim: int,
    q_per_kv: int = 1,
    rope_theta: float | None = None,
    is_causal: bool = False,
    implementation: str | None = None,
    platform: str = "cpu",
    nest_cudnn: bool = True,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    dropout_key: jax.Array | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Self-attention over the local heads, with ``jax.nn.dot_product_attention``.

    Args:
      qkv: ``[seq, *batch, kv_heads * (q_per_kv + 2) * head_dim]``, columns ordered
        (key/value head, [its q_per_kv queries, key, value], head_dim); query head
        ``g * q_per_kv + j`` attends with key/value head ``g``. With ``q_per_kv=1``:
        (head, q/k/v, head_dim).
      q_per_kv: queries per key/value head (grouped-query attention when > 1).
      rope_theta: rotary embeddings (:func:`rotary`) of the queries and keys at positions
        ``0 .. seq - 1`` with this base, or None for none.
      mask: broadcastable to ``[*batch, 1, seq, seq]``; True (or nonzero, as flax's float
        masks) attends.
      is_causal: attend only to earlier positions (no mask array needed).
      implementation: ``"xla"``, ``"cudnn"``, or None (cuDNN on GPUs where it applies).
      platform: the devices' platform, for ``implementation=None``.
      nest_cudnn: where mesh axes besides the manual ones remain, run cuDNN's core in a
        shard_map over them (:func:`_every_axis_manual`; the caller's shard_map must then
        be unchecked); if False, XLA's core runs there instead.
      dropout_rate, broadcast_dropout, dropout_key: with a key, dropout of the attention
        weights (after the softmax), as flax's ``dot_product_attention_weights``: one
        ``[seq, seq]`` mask for every batch entry and head (``broadcast_dropout``), else one
        per batch entry and head (head ``h``'s drawn from the key folded with its global
        index, so that a head's mask does not depend on the device it is on). Runs the
        explicit softmax (:func:`_explicit_attention`): ``jax.nn.dot_product_attention``
        has no dropout.
      axis_name: the tensor-parallel axis, inside a shard_map over it (None on global
        arrays): where this device's heads start, for the per-head masks.

    Returns:
      ``[seq, *batch, heads * head_dim]``, columns ordered (head, head_dim).
    """
    seq, batch = qkv.shape[0], qkv.shape[1:-1]
    qkv = qkv.reshape(seq, *batch, -1, q_per_kv + 2, head_dim)
    groups = qkv.shape[-3]
    heads = groups * q_per_kv
    # dot_product_attention takes [batch, seq, heads, head_dim]: fold the batch dims.
    qkv = jnp.moveaxis(qkv, 0, len(batch)).reshape(-1, seq, groups, q_per_kv + 2, head_dim)
    q = qkv[..., :q_per_kv, :].reshape(-1, seq, heads, head_dim)
    k, v = qkv[..., q_per_kv, :], qkv[..., q_per_kv + 1, :]
    if rope_theta is not None:
        positions = jnp.arange(seq)
        q, k = rotary(q, positions, rope_theta), rotary(k, positions, rope_theta)
    if mask is not None:
        # Flax's masks (nn.make_attention_mask, nn.make_causal_mask) are float 0/1: nonzero
        # attends, as in flax's own attention; dot_product_attention takes booleans only.
        mask = jnp.asarray(mask).astype(bool)
        mask = jnp.broadcast_to(mask, (*batch, 1, seq, seq)).reshape(-1, 1, seq, seq)
    if dropout_key is not None:
        first_head = 0 if axis_name is None else jax.lax.axis_index(axis_name) * heads
        drop = functools.partial(
            _drop_weights,
            rate=dropout_rate,
            key=dropout_key,
            broadcast=broadcast_dropout,
            first_head=first_head,
        )
        out = _explicit_attention(q, k, v, mask, is_causal, drop)
        out = out.reshape(*batch, seq, heads * head_dim)
        return jnp.moveaxis(out, len(batch), 0)
    backend = _attention_backend(implementation, platform, q.dtype, head_dim, mask is not None)
    partly_manual = backend == "cudnn" and _automatic_axes()
    if partly_manual and not nest_cudnn:
        backend = "xla"
    core = functools.partial(
        jax.nn.dot_product_attention, mask=mask, is_causal=is_causal, implementation=backend
    )
    out = _every_axis_manual(core, q, k, v) if backend == "cudnn" else core(q, k, v)
    out = out.reshape(*batch, seq, heads * head_dim)
    return jnp.moveaxis(out, len(batch), 0)


def _explicit_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    is_causal: bool,
    drop: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """``jax.nn.dot_product_attention`` (XLA's) written out, with ``drop`` applied to the
    attention weights ``[batch, heads, q, k]`` after the softmax. ``q [batch, seq, heads,
    head_dim]``, ``k, v [batch, seq, kv_heads, head_dim]``: query head ``h`` attends with
    key/value head ``h // (heads / kv_heads)``. Logits and softmax in float32."""
    b, t, heads, d = q.shape
    groups = k.shape[2]
    qg = q.reshape(b, t, groups, heads // groups, d)
    logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, heads, t, k.shape[1]) / jnp.sqrt(jnp.float32(d))
    allowed = None if mask is None else mask  # [b, 1, t, s]
    if is_causal:
        causal = jnp.tril(jnp.ones((t, k.shape[1]), bool))
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    weights = drop(jax.nn.softmax(logits, axis=-1)).astype(q.dtype)
    weights = weights.reshape(b, groups, heads // groups, t, k.shape[1])
    out = jnp.einsum("bgrts,bsgd->btgrd", weights, v)
    return out.reshape(b, t, heads, d)


def _drop_weights(
    w: jax.Array, *, rate: float, key: jax.Array, broadcast: bool, first_head: Any
) -> jax.Array:
    """Dropout of attention weights ``w [batch, heads, q, k]``, kept ones scaled by ``1 /
    (1 - rate)`` (flax's). ``broadcast``: one ``[q, k]`` mask for all; else each head's
    ``[batch, q, k]`` from ``key`` folded with its global index ``first_head + h``."""
    keep_prob = 1.0 - rate
    if broadcast:
        keep = jax.random.bernoulli(key, keep_prob, w.shape[-2:])
    else:
        heads = first_head + jnp.arange(w.shape[1])
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, heads)
        shape = (w.shape[0], *w.shape[2:])
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, keep_prob, shape), out_axes=1)(keys)
    return w * (keep.astype(w.dtype) / jnp.asarray(keep_prob, w.dtype))


def _automatic_axes() -> tuple[str, ...]:
    """The mesh axes not manual where the caller is traced (none outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in mesh.axis_names if a not in placement.manual_axes())


def _every_axis_manual(f: Callable, *arrays: jax.Array) -> jax.Array:
    """``f(*arrays)`` (each ``[batch, ...]``) in a shard_map over the mesh axes still
    automatic here (those besides the tensor-parallel one: dp, fsdp, ...), the batch split
    over them as :func:`jax_ub._src.lowering.batch_layout.batch_spec` lays it out.

    cuDNN attention partitions itself with ``custom_partitioning``, which XLA's GPU
    compiler cannot handle in a partly manual computation: it fails or crashes the process
    (jaxlib 0.11.2, a ``(dp, tp)`` mesh even with ``dp = 1``). With every axis manual
    there is nothing left to partition. The batch is already laid out this way by data
    parallelism, so nothing moves.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = _automatic_axes()
    if not auto:
        return f(*arrays)
    # batch_spec reads [rows, *batch, cols]: the batch as its one batch dim.
    batch = jax.ShapeDtypeStruct((1, arrays[0].shape[0], 1), arrays[0].dtype)
    spec = P(batch_layout.batch_spec(batch, mesh, auto)[1])

    return jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(spec,) * len(arrays),
        out_specs=spec,
        axis_names=frozenset(auto),
        check_vma=False,
    )(*arrays)


def platform_of(mesh: Mesh | None) -> str:
    """The platform the layer runs on: its mesh's devices', else those of the mesh in
    context (abstract: JAX 0.10 on), else JAX's default backend."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    return jax.default_backend() if platform is None else platform


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """What an attention block's compiled function depends on besides its call's settings
    (``_checks.prepare``'s ParallelConfig; hashable: :func:`attention_call` is cached on it).

    Attributes:
      head_dim: each head's size.
      ndim: the activations' rank (``[seq, *batch, features]`` or batch-major).
      use_bias: the projections have biases.
      has_mask: a mask array is passed.
      is_causal: attend only to earlier positions.
      implementation: the attention core, as :func:`attention_local` takes it.
      q_per_kv: queries per key/value head.
      rope_theta: rotary embeddings' base, or None.
      dropout_rate, broadcast_dropout: the attention weights' dropout (a key is passed
        where the rate is above 0).
    """

    head_dim: int
    ndim: int
    use_bias: bool
    has_mask: bool
    is_causal: bool = False
    implementation: str | None = None
    q_per_kv: int = 1
    rope_theta: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = True


@functools.lru_cache(maxsize=256)
def attention_call(config: ParallelConfig, call: AttentionCall) -> Callable[..., jax.Array]:
    """``f(x, qkv_params, out_params, mask)``: self-attention, sequence-sharded (or with
    the activations replicated over the axis: ``_core.linear_replicated``, without
    ``config.sequence_parallel``). With ``call.dropout_rate`` > 0, ``f(x, qkv_params,
    out_params, mask, key)``: the attention weights dropped as :func:`attention_local`
    says."""
    seq, fp8, kw = config.seq_axis, config.fp8_recipe, _core._kw(config)
    attend = functools.partial(
        attention_local,
        head_dim=call.head_dim,
        q_per_kv=call.q_per_kv,
        rope_theta=call.rope_theta,
        is_causal=call.is_causal,
        implementation=call.implementation,
        # The nested shard_map needs an unchecked one around it, whose transpose sums the
        # cotangents of replicated inputs over the axis: right for the bias's partial sums,
        # tp times the delayed-fp8 histories' (each device's is the whole history). With
        # delayed scaling, a partly manual cuDNN core gives way to XLA's.
        nest_cudnn=fp8 != "delayed",
        dropout_rate=call.dropout_rate,
        broadcast_dropout=call.broadcast_dropout,
    )

    def body(x, p_qkv, p_out, mask, key=None, linear=None, axis=config.axis_name):
        if linear is None:
            linear = _core.linear_local if config.sequence_parallel else _core.linear_replicated
        platform = platform_of(config.mesh)  # of the mesh this is traced under
        # Attention takes the sequence first; XLA merges these moves with its own.
        qkv = placement.seq_first(linear("column", x, p_qkv, **(kw | {"axis_name": axis})), seq)
        out = attend(qkv, mask, platform=platform, dropout_key=key, axis_name=axis)
        return linear("row", placement.seq_back(out, seq), p_out, **(kw | {"axis_name": axis}))

    plain = functools.partial(body, linear=_core.linear_replicated, axis=None)

    col = _projection.param_specs("column", config.axis_name, call.use_bias, fp8)
    row = _projection.param_specs("row", config.axis_name, call.use_bias, fp8)
    spec = _core.activation_spec(call.ndim, config)
    in_specs = (spec, col, row, P() if call.has_mask else None)
    in_specs += (P(),) if call.dropout_rate > 0 else ()
    unchecked = fp8 != "delayed"  # see nest_cudnn above
    return _core.over_axis(config, body, in_specs, spec, plain, check_vma=not unchecked)


@functools.lru_cache(maxsize=256)
def decode_call(
    config: ParallelConfig,
    head_dim: int,
    use_bias: bool,
    q_per_kv: int = 1,
    rope_theta: float | None = None,
) -> Callable:
    """``f(x, qkv_params, out_params, cached_key, cached_value, index) -> (y, key, value)``:
    self-attention of new tokens ``x`` (``[t, batch, features]``, or ``[batch, t, ...]``
    with ``config.seq_axis`` 1, an index) at positions ``index .. index + t - 1`` over the
    key/value cache ``[batch, max_length, kv_heads, head_dim]`` (kv heads split over the
    axis), which comes back with the new tokens' keys and values written at ``index``.
    Causal: each new token attends to the cache up to itself. Activations replicated over
    the axis (``_core.linear_replicated``): decoding has no sequence to split."""
    seq, axis_name, fp8 = config.seq_axis, config.axis_name, config.fp8_recipe
    kw = _core._kw(config)

    def body(x, p_qkv, p_out, cached_key, cached_value, index, axis=axis_name):
        kw_axis = kw | {"axis_name": axis}
        qkv = placement.seq_first(_core.linear_replicated("column", x, p_qkv, **kw_axis), seq)
        t, batch = qkv.shape[0], qkv.shape[1]
        qkv = jnp.swapaxes(qkv.reshape(t, batch, -1, q_per_kv + 2, head_dim), 0, 1)
        groups = qkv.shape[2]
        q = qkv[..., :q_per_kv, :].reshape(batch, t, groups * q_per_kv, head_dim)
        k, v = qkv[..., q_per_kv, :], qkv[..., q_per_kv + 1, :]
        if rope_theta is not None:
            positions = index + jnp.arange(t)
            q, k = rotary(q, positions, rope_theta), rotary(k, positions, rope_theta)
        start = (0, index, 0, 0)
        cached_key = jax.lax.dynamic_update_slice(cached_key, k.astype(cached_key.dtype), start)
        cached_value = jax.lax.dynamic_update_slice(
            cached_value, v.astype(cached_value.dtype), start
        )
        length = cached_key.shape[1]
        mask = jnp.arange(length)[None, :] <= (index + jnp.arange(t))[:, None]  # [t, length]
        out = jax.nn.dot_product_attention(
            q,
            cached_key.astype(q.dtype),
            cached_value.astype(q.dtype),
            mask=mask[None, None],
            implementation="xla",
        )
        out = placement.seq_back(jnp.swapaxes(out.reshape(batch, t, -1), 0, 1), seq)
        y = _core.linear_replicated("row", out, p_out, **kw_axis)
        return y, cached_key, cached_value

    col = _projection.param_specs("column", axis_name, use_bias, fp8)
    row = _projection.param_specs("row", axis_name, use_bias, fp8)
    cache = P(None, None, axis_name, None)
    in_specs = (P(), col, row, cache, cache, P())
    plain = functools.partial(body, axis=None)
    return _core.over_axis(config, body, in_specs, (P(), cache, cache), plain)
