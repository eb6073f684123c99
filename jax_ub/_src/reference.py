"""The unfused ops, built from lax collectives: CPU fallback, test oracle, benchmark baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# fp8 scales travel to the custom calls as float32 [8]: x's at [0], w's at [4], each 16-byte
# aligned on the device, as cuBLASLt reads them (kScaleStride in src/dtype.h).
SCALE_STRIDE = 4


def pack_scales(x_scale, w_scale) -> jax.Array:
    """The scales operand of the custom calls: ``x_scale`` at [0], ``w_scale`` at [4]."""
    z = jnp.zeros((SCALE_STRIDE - 1,), jnp.float32)
    parts = (x_scale, z, w_scale, z)
    return jnp.concatenate([jnp.reshape(jnp.asarray(p, jnp.float32), (-1,)) for p in parts])


def scaled_matmul(x: jax.Array, w: jax.Array, scales=None, out_dtype=None) -> jax.Array:
    """``x @ w``; with fp8 operands, ``x_scale * w_scale * (x @ w)`` (``scales`` laid out by
    :func:`pack_scales`) accumulated in float32 and cast to ``out_dtype``: XLA's
    dequantize-then-dot pattern, which its GPU compiler turns into an fp8 GEMM."""
    if scales is None or jnp.dtype(x.dtype).itemsize > 1:
        out = x @ w
        return out if out_dtype is None else out.astype(out_dtype)
    wide = jnp.dtype(out_dtype)
    out = lax.dot_general(
        x.astype(wide),
        w.astype(wide),
        (((x.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return (out * (scales[0] * scales[SCALE_STRIDE])).astype(wide)


ACTIVATIONS = (None, "gelu")


def gelu(y: jax.Array) -> jax.Array:
    """GELU's tanh approximation (``jax.nn.gelu``'s default), as cuBLASLt's epilogue computes it."""
    return jax.nn.gelu(y, approximate=True)


def dgelu_reference(dy: jax.Array, pre: jax.Array) -> jax.Array:
    """``dy * gelu'(pre)``: GELU's backward, from its output's gradient and its input."""
    return jax.vjp(gelu, pre)[1](dy)[0]


def epilogue(y: jax.Array, bias=None, activation: str | None = None):
    """``(activation(y + bias), y + bias)``: the epilogue's output and the activation's input."""
    pre = y if bias is None else y + bias.astype(y.dtype)
    return (gelu(pre) if activation == "gelu" else pre), pre


def all_gather_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    return_gathered: bool = False,
    scales=None,
    out_dtype=None,
    bias=None,
    activation: str | None = None,
    return_pre_activation: bool = False,
):
    """``activation(all_gather(x, axis_name, tiled=True) @ w + bias)``; fp8 operands scaled by
    ``scales``, as :func:`scaled_matmul`. Returns the result, then the gathered ``x`` with
    ``return_gathered``, then the activation's input with ``return_pre_activation``."""
    gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
    out, pre = epilogue(scaled_matmul(gathered, w, scales, out_dtype), bias, activation)
    extra = (gathered,) * return_gathered + (pre,) * return_pre_activation
    return (out, *extra) if extra else out


def matmul_reduce_scatter_reference(
    x: jax.Array, w: jax.Array, axis_name: str, scales=None, out_dtype=None
) -> jax.Array:
    """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True); fp8 operands
    scaled by ``scales``, as :func:`scaled_matmul`."""
    return lax.psum_scatter(
        scaled_matmul(x, w, scales, out_dtype), axis_name, scatter_dimension=0, tiled=True
    )
