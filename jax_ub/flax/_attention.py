"""The attention block's pieces shared by the nnx and linen layers: its argument checks, the
choice of attention kernel, and the per-shard computation (QKV projection, attention over
the local heads, output projection) in ``jax.shard_map``. Layout as in ``_core``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_ub._src import layout
from jax_ub._src.extension import normalize_platform
from jax_ub.flax import _core
from jax_ub.flax._core import Params


def check_mask(owner: str, mask: Any, x_shape: tuple[int, ...], seq_axis: int = 0) -> None:
    """mask must broadcast to ``[*batch, 1, seq, seq]`` (one mask for every head); the
    batch dims are the input's others but the features, in order."""
    seq_axis %= len(x_shape)
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


def platform_of(mesh: Mesh | None) -> str:
    """The platform the layer runs on: its mesh's devices', else JAX's default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


@functools.lru_cache(maxsize=256)
def attention_call(
    mesh: Mesh | None,
    axis_name: str,
    impl: str,
    dtype: Any,
    fp8: str | None,
    seq_axis: int,
    head_dim: int,
    ndim: int,
    use_bias: bool,
    has_mask: bool,
    is_causal: bool = False,
    attention_implementation: str | None = None,
) -> Callable[[jax.Array, Params, Params, jax.Array | None], jax.Array]:
    """``f(x, qkv_params, out_params, mask)``: self-attention, sequence-sharded."""
    seq = seq_axis % ndim
    kw = dict(axis_name=axis_name, impl=impl, dtype=dtype, fp8=fp8, seq_axis=seq)
    attend = functools.partial(
        attention_local,
        head_dim=head_dim,
        is_causal=is_causal,
        implementation=attention_implementation,
        platform=platform_of(mesh),
    )

    def body(x, p_qkv, p_out, mask):
        # Attention takes the sequence first; XLA merges these moves with its own.
        qkv = layout.seq_first(_core.linear_local("column", x, p_qkv, **kw), seq)
        out = layout.seq_back(attend(qkv, mask), seq)
        return _core.linear_local("row", out, p_out, **kw)

    col = _core.param_specs("column", axis_name, use_bias, fp8)
    row = _core.param_specs("row", axis_name, use_bias, fp8)
    spec = _core.seq_spec(ndim, axis_name, seq)
    return _core._over_tp(body, mesh, axis_name, (spec, col, row, P() if has_mask else None), spec)
