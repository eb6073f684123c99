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
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import fp8 as _ops_fp8

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
