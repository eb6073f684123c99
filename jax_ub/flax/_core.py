"""Framework-free pieces shared by the nnx and linen layers.

Argument checks, the ``PartitionSpec``s of the sequence-parallel layout, and the
per-shard computations that run inside ``jax.shard_map``. Activations are laid out
``[seq, *batch, features]``; "sequence-sharded" means dim 0 is split over the tensor
parallel axis, "feature-sharded" means the last dim is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import checks
from jax_ub._src.extension import normalize_platform

Params = Mapping[str, jax.Array]


# --- argument checks ---------------------------------------------------------------------


def tp_size(owner: str, mesh: Any, axis_name: Any) -> int:
    """Size of ``axis_name`` in ``mesh``, or a ValueError saying what is wrong."""
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"{owner}: mesh must be a concrete jax.sharding.Mesh (the userbuffer ops need its "
            f"devices), got {type(mesh).__name__}"
        )
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        raise ValueError(
            f"{owner}: axis_name {axis_name!r} is not an axis of the mesh; "
            f"mesh.axis_names={mesh.axis_names}"
        )
    return int(mesh.shape[axis_name])


# One spelling of the impl check for the ops and the layers.
check_impl = checks.check_impl


def check_divisible(owner: str, what: str, value: int, tp: int, axis_name: str) -> None:
    if value <= 0 or value % tp != 0:
        raise ValueError(
            f"{owner}: {what}={value} must be a positive multiple of the size of axis "
            f"{axis_name!r} ({tp})"
        )


def check_input(owner: str, x: Any, in_features: int | None, tp: int, axis_name: str) -> None:
    """x must be ``[seq, *batch, in_features]`` with ``seq`` divisible by ``tp``.

    ``in_features=None`` accepts any feature count (linen infers it from the input).
    """
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(f"{owner}: input must be [seq, *batch, features], got shape {shape}")
    if in_features is not None and shape[-1] != in_features:
        raise ValueError(
            f"{owner}: input has {shape[-1]} features (last dim) but the layer expects "
            f"{in_features}; input shape {shape}"
        )
    if shape[0] % tp != 0:
        raise ValueError(
            f"{owner}: sequence length (dim 0) {shape[0]} is not divisible by the size of "
            f"axis {axis_name!r} ({tp}); input shape {shape}"
        )


def check_mask(owner: str, mask: Any, x_shape: tuple[int, ...]) -> None:
    """mask must broadcast to ``[*batch, 1, seq, seq]`` (one mask for every head)."""
    seq, batch = x_shape[0], tuple(x_shape[1:-1])
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


# --- sharding layout ---------------------------------------------------------------------


def seq_spec(ndim: int, axis_name: str) -> P:
    """``[seq, *batch, features]`` split over ``axis_name`` on the sequence dim."""
    return P(axis_name, *([None] * (ndim - 1)))


def feature_spec(ndim: int, axis_name: str) -> P:
    """``[seq, *batch, features]`` split over ``axis_name`` on the feature dim."""
    return P(*([None] * (ndim - 1)), axis_name)


def column_param_specs(axis_name: str, use_bias: bool) -> dict[str, P]:
    specs = {"kernel": P(None, axis_name)}
    if use_bias:
        specs["bias"] = P(axis_name)
    return specs


def row_param_specs(axis_name: str, use_bias: bool) -> dict[str, P]:
    specs = {"kernel": P(axis_name, None)}
    if use_bias:
        specs["bias"] = P(None)  # replicated
    return specs


# --- per-shard computations (run inside shard_map) ---------------------------------------


def _promote(dtype: Any, *arrays: jax.Array | None) -> list[jax.Array | None]:
    """Cast to ``dtype``, or to the arrays' common dtype when it is None (like nnx.Linear)."""
    present = [a for a in arrays if a is not None]
    dtype = dtype if dtype is not None else jnp.result_type(*present)
    return [None if a is None else jnp.asarray(a, dtype) for a in arrays]


def column_local(
    x: jax.Array, params: Params, *, axis_name: str, impl: str, dtype: Any
) -> jax.Array:
    """Local ``[seq/tp, *b, k]`` rows -> ``[seq, *b, n/tp]``: all_gather_matmul, then bias."""
    x, kernel, bias = _promote(dtype, x, params["kernel"], params.get("bias"))
    y = jax_ub.all_gather_matmul(x, kernel, axis_name, impl=impl)
    return y if bias is None else y + bias  # the bias shard of this rank's columns


def row_local(x: jax.Array, params: Params, *, axis_name: str, impl: str, dtype: Any) -> jax.Array:
    """Local ``[seq, *b, k/tp]`` -> ``[seq/tp, *b, n]``: matmul_reduce_scatter, then bias."""
    x, kernel, bias = _promote(dtype, x, params["kernel"], params.get("bias"))
    y = jax_ub.matmul_reduce_scatter(x, kernel, axis_name, impl=impl)
    return y if bias is None else y + bias  # after the reduction, so it is added once


ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")


def check_attention_implementation(owner: str, implementation: Any, mesh: Mesh) -> None:
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"{owner}: attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    platform = mesh.devices.flat[0].platform
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
    is_causal: bool = False,
    implementation: str | None = None,
    platform: str = "cpu",
) -> jax.Array:
    """Self-attention over the local heads, with ``jax.nn.dot_product_attention``.

    Args:
      qkv: ``[seq, *batch, heads * 3 * head_dim]``, columns ordered (head, q/k/v, head_dim).
      mask: boolean, broadcastable to ``[*batch, 1, seq, seq]``; True attends.
      is_causal: attend only to earlier positions (no mask array needed).
      implementation: ``"xla"``, ``"cudnn"``, or None (cuDNN on GPUs where it applies).
      platform: the devices' platform, for ``implementation=None``.

    Returns:
      ``[seq, *batch, heads * head_dim]``, columns ordered (head, head_dim).
    """
    seq, batch = qkv.shape[0], qkv.shape[1:-1]
    qkv = qkv.reshape(seq, *batch, -1, 3, head_dim)
    heads = qkv.shape[-3]
    # dot_product_attention takes [batch, seq, heads, head_dim]: fold the batch dims.
    qkv = jnp.moveaxis(qkv, 0, len(batch)).reshape(-1, seq, heads, 3, head_dim)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    if mask is not None:
        mask = jnp.broadcast_to(mask, (*batch, 1, seq, seq)).reshape(-1, 1, seq, seq)
    backend = _attention_backend(implementation, platform, q.dtype, head_dim, mask is not None)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, implementation=backend
    )
    out = out.reshape(*batch, seq, heads * head_dim)
    return jnp.moveaxis(out, len(batch), 0)


# --- whole-layer functions: jit(shard_map(per-shard computation)), one per configuration ---
#
# Cached so that eager calls compile once per shape (an eager shard_map would dispatch op
# by op); under an outer jit the inner jit is simply inlined.


def _jit_shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if AxisType.Explicit not in tuple(mesh.axis_types):
        return jax.jit(mapped)

    def resharded(*args):
        # Explicit mesh axes: shard_map takes inputs only in exactly the in_specs' layout.
        def reshard(spec, a):
            return a if spec is None else jax.reshard(a, NamedSharding(mesh, spec))

        is_spec = lambda s: s is None or isinstance(s, P)  # noqa: E731
        return mapped(*jax.tree.map(reshard, in_specs, args, is_leaf=is_spec))

    return jax.jit(resharded)


@functools.lru_cache(maxsize=256)
def column_call(
    mesh: Mesh, axis_name: str, impl: str, dtype: Any, ndim: int, use_bias: bool
) -> Callable[[jax.Array, Params], jax.Array]:
    """``f(x, params)``: sequence-sharded ``x`` -> feature-sharded output."""
    local = functools.partial(column_local, axis_name=axis_name, impl=impl, dtype=dtype)
    in_specs = (seq_spec(ndim, axis_name), column_param_specs(axis_name, use_bias))
    return _jit_shard_map(local, mesh, in_specs, feature_spec(ndim, axis_name))


@functools.lru_cache(maxsize=256)
def row_call(
    mesh: Mesh, axis_name: str, impl: str, dtype: Any, ndim: int, use_bias: bool
) -> Callable[[jax.Array, Params], jax.Array]:
    """``f(x, params)``: feature-sharded ``x`` -> sequence-sharded output."""
    local = functools.partial(row_local, axis_name=axis_name, impl=impl, dtype=dtype)
    in_specs = (feature_spec(ndim, axis_name), row_param_specs(axis_name, use_bias))
    return _jit_shard_map(local, mesh, in_specs, seq_spec(ndim, axis_name))


@functools.lru_cache(maxsize=256)
def mlp_call(
    mesh: Mesh,
    axis_name: str,
    impl: str,
    dtype: Any,
    activation: Callable[[jax.Array], jax.Array],
    ndim: int,
    use_bias: bool,
) -> Callable[[jax.Array, Params, Params], jax.Array]:
    """``f(x, up_params, down_params)``: column -> activation -> row, sequence-sharded."""
    kw = dict(axis_name=axis_name, impl=impl, dtype=dtype)

    def body(x, p_up, p_down):
        return row_local(activation(column_local(x, p_up, **kw)), p_down, **kw)

    col, row = column_param_specs(axis_name, use_bias), row_param_specs(axis_name, use_bias)
    spec = seq_spec(ndim, axis_name)
    return _jit_shard_map(body, mesh, (spec, col, row), spec)


@functools.lru_cache(maxsize=256)
def attention_call(
    mesh: Mesh,
    axis_name: str,
    impl: str,
    dtype: Any,
    head_dim: int,
    ndim: int,
    use_bias: bool,
    has_mask: bool,
    is_causal: bool = False,
    attention_implementation: str | None = None,
) -> Callable[[jax.Array, Params, Params, jax.Array | None], jax.Array]:
    """``f(x, qkv_params, out_params, mask)``: self-attention, sequence-sharded."""
    kw = dict(axis_name=axis_name, impl=impl, dtype=dtype)
    attend = functools.partial(
        attention_local,
        head_dim=head_dim,
        is_causal=is_causal,
        implementation=attention_implementation,
        platform=mesh.devices.flat[0].platform,
    )

    def body(x, p_qkv, p_out, mask):
        return row_local(attend(column_local(x, p_qkv, **kw), mask), p_out, **kw)

    col, row = column_param_specs(axis_name, use_bias), row_param_specs(axis_name, use_bias)
    spec = seq_spec(ndim, axis_name)
    return _jit_shard_map(body, mesh, (spec, col, row, P() if has_mask else None), spec)
