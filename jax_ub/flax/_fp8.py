"""fp8 recipes of the Flax layers: the ``fp8`` and ``amax_history_length`` checks, and
the ops' :class:`jax_ub.Fp8Scales` for a layer's recipe.

* ``fp8=False`` (or None): no fp8.
* ``fp8=True`` or ``"current"``: current scaling; every scale is its tensor's amax this
  step (:func:`jax_ub.fp8.current_scale`); no state.
* ``fp8="delayed"``: delayed scaling, flax's fp8 recipe (``flax.linen.Fp8DirectDotGeneralOp``).
  The layer's op call keeps three float32 ``[amax_history_length]`` amax histories, of
  its input (``x``), kernel (``w``) and output gradient (``grad``), zeros at first. The
  step's scale of each tensor is ``max(history) / fp8_max`` (1 while the history is all
  zeros), so it is known before the tensor is; the op reports the tensor's amax this
  step (over the tensor-parallel group) as that scale's gradient, and
  :func:`jax_ub.fp8.delayed_scale_owg` turns it into the history's gradient: the history
  with that amax rolled in front. The histories are flax's OVERWRITE_WITH_GRADIENT state:
  a training step overwrites them with their gradient.

The histories travel to the ops beside the params, under ``params["fp8"] = {"x": ...,
"w": ..., "grad": ...}``, replicated over the tensor-parallel axis.

Where a layer runs with its activations replicated over that axis (no sequence to split:
``_core.linear_replicated``), :func:`dense` computes its GEMM in XLA with the same recipe:
the same quantization forward and backward, and the same amaxes as the scales' gradients.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import fp8 as _ops_fp8
from jax_ub._src.lowering.varying import match_varying
from jax_ub._src.ops.fp8_ops import reported_amax

RECIPES = ("current", "delayed")
DEFAULT_HISTORY_LENGTH = 16

# The ops' scale field -> flax's name for its amax history (Fp8DirectDotGeneralOp's).
HISTORY_NAMES = {
    "x": "input_amax_history",
    "w": "kernel_amax_history",
    "grad": "output_grad_amax_history",
}
# What each tensor is quantized to: e4m3 forward, e5m2 gradients.
_DTYPES = {"x": _ops_fp8.E4M3, "w": _ops_fp8.E4M3, "grad": _ops_fp8.E5M2}


def recipe(fp8: Any) -> str | None:
    """A checked ``fp8`` setting as the recipe's name: ``"current"``, ``"delayed"`` or
    None (no fp8)."""
    if fp8 is None or fp8 is False:
        return None
    return "current" if fp8 is True else fp8


def check(owner: str, fp8: Any, amax_history_length: Any) -> None:
    """A clear error for an ``fp8`` that is not a recipe, or a history length that is not a
    positive int."""
    if isinstance(fp8, str):
        if fp8 not in RECIPES:
            raise ValueError(
                f"{owner}: fp8 must be False, True (= 'current') or one of {RECIPES}, got {fp8!r}"
            )
    elif fp8 is not None and not isinstance(fp8, bool):
        raise TypeError(
            f"{owner}: fp8 must be False, True (= 'current') or one of {RECIPES}, got "
            f"{fp8!r}; for scales of your own call jax_ub.all_gather_matmul / "
            "matmul_reduce_scatter with fp8=jax_ub.Fp8Scales(...)"
        )
    n = amax_history_length
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"{owner}: amax_history_length must be a positive int (the steps of amaxes a "
            f"delayed scale looks back over), got {n!r}"
        )


def history_specs(fp8: str | None) -> dict[str, Any]:
    """The ``PartitionSpec``s of the histories a layer's params carry for ``fp8`` (a
    :func:`recipe`): ``{"fp8": {"x": P(), ...}}`` (replicated) for delayed scaling, else
    nothing."""
    return {"fp8": {k: P() for k in HISTORY_NAMES}} if fp8 == "delayed" else {}


def scales(fp8: str | None, histories: dict[str, jax.Array] | None) -> jax_ub.Fp8Scales | None:
    """The ops' ``fp8`` argument: None, current scaling, or the delayed scales of
    ``histories`` (``{"x", "w", "grad"}`` -> ``[length]`` float32) whose gradients are the
    updated histories."""
    if fp8 is None:
        return None
    if fp8 == "current":
        return jax_ub.Fp8Scales()
    assert histories is not None, "fp8='delayed' needs the layer's amax histories"
    return jax_ub.Fp8Scales(
        **{k: _ops_fp8.delayed_scale_owg(histories[k], _DTYPES[k]) for k in HISTORY_NAMES}
    )


# --- the recipe in XLA (the replicated layout) ---------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fake_quant(a: jax.Array, scale: jax.Array | None, dtype: Any, axis_name: str | None):
    """``a`` quantized to ``dtype`` at ``scale`` (this rank's current scale when None) and
    back, in float32; straight-through."""
    return _fake_quant_fwd(a, scale, dtype, axis_name)[0]


def _fake_quant_fwd(a, scale, dtype, axis_name):
    s = jax.lax.stop_gradient(_ops_fp8.current_scale(a, dtype)) if scale is None else scale
    seen = None if scale is None else reported_amax(_ops_fp8.amax(a), axis_name, scale)
    return _ops_fp8.quantize(a, s, dtype).astype(jnp.float32) * s, (a[:0], seen)


def _fake_quant_bwd(dtype, axis_name, res, ct):
    a0, seen = res  # a given scale's gradient: a's amax
    return match_varying(ct.astype(a0.dtype), a0), seen


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _quantized_grad(y: jax.Array, scale: jax.Array | None, axis_name: str | None):
    """``y`` as it is; its gradient quantized to e5m2 at ``scale`` (the gradient's current
    scale when None) and back, with the gradient's amax as a given scale's gradient."""
    return y


def _quantized_grad_fwd(y, scale, axis_name):
    return y, scale


def _quantized_grad_bwd(axis_name, scale, dy):
    dq = _fake_quant_fwd(dy, scale, _ops_fp8.E5M2, axis_name)[0].astype(dy.dtype)
    return dq, None if scale is None else reported_amax(_ops_fp8.amax(dy), axis_name, scale)


_quantized_grad.defvjp(_quantized_grad_fwd, _quantized_grad_bwd)


def dense(
    x: jax.Array, kernel: jax.Array, scales: jax_ub.Fp8Scales, axis_name: str | None = None
) -> jax.Array:
    """``x [..., k] @ kernel [k, n]`` in XLA, in fp8 as the ops compute it: ``x`` and
    ``kernel`` quantized to e4m3 at ``scales.x``, ``scales.w`` and multiplied in float32
    (result in ``x.dtype``), the output gradient quantized to e5m2 at ``scales.grad``; a
    scale left None is the tensor's current one (on this rank). The gradient of each scale
    given is its tensor's amax this step, over ``axis_name``'s group (the ops' report, which
    :func:`jax_ub.fp8.delayed_scale_owg` records in its history)."""
    xq = _fake_quant(x, scales.x, _ops_fp8.E4M3, axis_name)
    wq = _fake_quant(kernel, scales.w, _ops_fp8.E4M3, axis_name)
    y = jnp.einsum("...k,kn->...n", xq, wq).astype(x.dtype)
    return _quantized_grad(y, scales.grad, axis_name)
