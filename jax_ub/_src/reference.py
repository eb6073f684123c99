"""The unfused ops, built from lax collectives: CPU fallback, test oracle, benchmark baseline."""

from __future__ import annotations

import jax
from jax import lax


def all_gather_matmul_reference(
    x: jax.Array, w: jax.Array, axis_name: str, return_gathered: bool = False
):
    """all_gather(x, axis_name, tiled=True) @ w (and the gathered x when asked)."""
    gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
    out = gathered @ w
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter_reference(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)."""
    return lax.psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)
