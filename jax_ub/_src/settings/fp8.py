"""fp8 formats, per-tensor scales and the scaling recipes: what a caller passes as
``fp8=Fp8Scales(...)`` (public in :mod:`jax_ub.fp8`), and the dtype rules of an fp8 call.
The ops' fp8 forward and backward are :mod:`jax_ub._src.ops.fp8_ops`.

Scales, per tensor (per local shard for ``w`` and for tensors that are not gathered):
* current scaling: leave a field ``None``; the op uses this step's ``amax / fp8_max``
  (for a tensor that is all-gathered, the amax over the group, so one scale fits all
  its chunks);
* delayed scaling: pass a float32 scalar, e.g. :func:`delayed_scale` of an amax history
  carried in the model state, the same on every rank of the group. The gradient the op
  returns for such a field is this step's amax of its tensor (over the group), which the
  caller records with :func:`update_amax_history` (flax's OVERWRITE_WITH_GRADIENT
  convention). Fields left ``None`` get no gradient.

``x`` or ``w`` (or both) may also come already quantized, ``float8_e4m3fn`` with its scale
in ``Fp8Scales`` (``x ~ x * fp8.x``): the result then has the other operand's dtype
(bfloat16 when both are fp8, :func:`result_dtype`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jax_ub._src.lowering.unfused import all_max
from jax_ub._src.lowering.varying import counted_once, summed_axes

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # activations and weights
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """Per-tensor fp8 scales of one op call: ``x ~ quantized(x) * x``; ``None`` for current
    scaling (see the module docstring). ``grad`` scales the output's gradient."""

    x: jax.Array | None = None
    w: jax.Array | None = None
    grad: jax.Array | None = None


def amax(a: jax.Array, axis_name: str | None = None) -> jax.Array:
    """max |a| as float32, over the group of ``axis_name`` too when given."""
    m = jnp.max(jnp.abs(a)).astype(jnp.float32)
    return m if axis_name is None else all_max(m, axis_name)


def scale_from_amax(a: jax.Array, dtype=E4M3) -> jax.Array:
    """The scale that maps amax ``a`` onto ``dtype``'s largest finite value (1 for 0)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.where(a > 0, a / fmax, 1.0).astype(jnp.float32)


def current_scale(a: jax.Array, dtype=E4M3, axis_name: str | None = None) -> jax.Array:
    """Current scaling: the scale of ``a`` itself (over the group of ``axis_name``)."""
    return scale_from_amax(amax(a, axis_name), dtype)


def delayed_scale(amax_history: jax.Array, dtype=E4M3) -> jax.Array:
    """Delayed scaling: the scale of the largest amax in a history (``[length]`` float32)."""
    return scale_from_amax(jnp.max(amax_history), dtype)


def update_amax_history(amax_history: jax.Array, new_amax: jax.Array) -> jax.Array:
    """The history with ``new_amax`` in front and its oldest entry dropped."""
    return jnp.roll(amax_history, 1).at[0].set(new_amax.astype(amax_history.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def delayed_scale_owg(amax_history: jax.Array, dtype=E4M3) -> jax.Array:
    """:func:`delayed_scale` of ``amax_history`` (``[length]`` float32) whose gradient is
    the history to keep: flax's OVERWRITE_WITH_GRADIENT convention, where a training step
    overwrites such a variable with its "gradient" instead of stepping along it.

    The cotangent arriving for the scale is the tensor's amax this step (what the ops
    return for a given scale); the history's gradient is then
    ``update_amax_history(amax_history, amax)``, or the history unchanged when that amax is
    not finite (as flax keeps its previous scale then). Use the scale once per step:
    cotangents of several uses would add up.
    """
    return delayed_scale(amax_history, dtype)


def _owg_fwd(amax_history, dtype):
    return delayed_scale(amax_history, dtype), amax_history


def _owg_bwd(dtype, amax_history, seen):
    recorded = update_amax_history(amax_history, seen)
    kept = jnp.where(jnp.isfinite(seen), recorded, amax_history)
    # Inside an unchecked shard_map the history's cotangent is summed over its devices: the
    # first gives it, as the ops report `seen` there (fp8_ops.reported_amax), the others 0.
    split = summed_axes()
    return (counted_once(kept, split),)


delayed_scale_owg.defvjp(_owg_fwd, _owg_bwd)


def quantize(a: jax.Array, scale: jax.Array, dtype=E4M3) -> jax.Array:
    """``a / scale`` saturated to ``dtype``'s finite range and rounded to it."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(a.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def is_quantized(a) -> bool:
    """Whether ``a`` (an array or anything with a ``dtype``) is an fp8 operand."""
    dtype = jnp.dtype(a.dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def result_dtype(x, w) -> jnp.dtype:
    """The fp8 op's output dtype: the first operand given in high precision, else bf16."""
    for a in (x, w):
        if not is_quantized(a):
            return jnp.dtype(a.dtype)
    return jnp.dtype(jnp.bfloat16)


def compute_operands(x, w) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """``x`` and ``w`` as the implementation choice sees an fp8 call: both in its result
    dtype (the dtype its partial sums and output move in)."""
    dtype = result_dtype(x, w)
    return jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(w.shape, dtype)
