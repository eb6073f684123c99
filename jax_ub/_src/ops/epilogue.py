"""all_gather_matmul's epilogue (bias, GELU): argument checks and the backward's first step.

The forward runs in the custom call's GEMMs (cuBLASLt's bias/GELU epilogues on GPUs, the
same arithmetic emulated on the host) and keeps GELU's input for the backward. The
backward turns ``dy`` (the gradient of the epilogue's output) into the gradient of the
product, ``dpre = dy * gelu'(pre)``, and the bias gradient, the sum of ``dpre`` over rows;
both are XLA fusions over data the backward GEMMs read anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ub._src.lowering.unfused import ACTIVATIONS, dgelu_reference
from jax_ub._src.lowering.varying import match_varying


def check_epilogue(op: str, x: jax.Array, w: jax.Array, bias, activation) -> None:
    """A clear error for an activation other than None/"gelu" or a bias not ``[n]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation=}")
    if bias is None:
        return
    if not (hasattr(bias, "shape") and hasattr(bias, "dtype")):
        raise TypeError(f"{op}: bias must be an array [n], got {type(bias).__name__}")
    shape = jnp.shape(bias)
    if shape != (w.shape[1],):
        raise ValueError(
            f"{op}: bias must be [n] = [{w.shape[1]}], one value per column of w, got "
            f"bias.shape={shape}; {x.shape=} {w.shape=}"
        )
    if not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
        raise ValueError(f"{op}: bias must be floating point, got {jnp.result_type(bias)}")


def epilogue_grads(dy: jax.Array, pre, bias_like, with_gelu: bool):
    """``(dpre, dbias)`` from ``dy``: GELU's backward at ``pre`` (GELU's input, kept by the
    forward) where ``with_gelu``, and the bias gradient where there is a bias
    (``bias_like``: an empty slice of it, carrying its dtype and sharding type), else None."""
    dpre = dgelu_reference(dy, pre) if with_gelu else dy
    return dpre, bias_grad(dpre, bias_like)


def bias_grad(dp: jax.Array, bias_like):
    """The gradient of a bias added to every row of a product whose gradient is ``dp``: its
    sum over rows (accumulated in float32), typed like ``bias_like``; None without a bias."""
    if bias_like is None:
        return None
    rows = tuple(range(dp.ndim - 1))
    db = jnp.sum(dp, axis=rows, dtype=jnp.float32).astype(bias_like.dtype)
    return match_varying(db, bias_like)
