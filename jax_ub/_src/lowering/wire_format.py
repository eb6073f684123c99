"""How fp8 scales travel to the userbuffer custom calls (the FFI's scales operand).

The scales are one float32 ``[8]`` array: x's at ``[0]``, w's at ``[SCALE_STRIDE]``, each
16-byte aligned on the device, as cuBLASLt reads them (the C++ side's ``kScaleStride`` must
equal :data:`SCALE_STRIDE`). Non-fp8 calls pass scales of 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SCALE_STRIDE = 4


def pack_scales(x_scale, w_scale) -> jax.Array:
    """The scales operand of the custom calls: ``x_scale`` at [0], ``w_scale`` at [4]."""
    z = jnp.zeros((SCALE_STRIDE - 1,), jnp.float32)
    parts = (x_scale, z, w_scale, z)
    return jnp.concatenate([jnp.reshape(jnp.asarray(p, jnp.float32), (-1,)) for p in parts])


def unit_scales() -> jax.Array:
    """The scales operand of a call whose product is not scaled (operands not in fp8): 1 at
    both places, zeros between. Not all ones: XLA turns a constant of one repeated value
    into a broadcast, a kernel launched before every call; this one stays a constant."""
    one = np.zeros((2 * SCALE_STRIDE,), np.float32)
    one[[0, SCALE_STRIDE]] = 1.0
    return jnp.asarray(one)


def product_scale(scales: jax.Array) -> jax.Array:
    """``x_scale * w_scale``: what multiplies the product of a call given ``scales``."""
    return scales[0] * scales[SCALE_STRIDE]
