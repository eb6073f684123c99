"""Argument checks shared by the public ops: all of them run before anything is traced.

What path a valid call takes is :mod:`jax_ub._src.ops.impl_choice`'s job, not this module's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub._src.settings.config import config
from jax_ub._src.settings.fp8 import E4M3, Fp8Scales, is_quantized

IMPLS = ("auto", "ub", "xla", "none")


def bound_axis_size(op: str, axis_name: str) -> int | None:
    """Size of `axis_name` where it is bound (a shard_map over it), else None: the op is
    then called on global arrays. A ValueError if `axis_name` is not an axis name."""
    if not isinstance(axis_name, str):
        raise ValueError(f"{op}: axis_name must be one mesh axis name (str), got {axis_name=}")
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def check_axis_in_mesh(owner: str, axis_name: str, mesh) -> None:
    """``axis_name`` is an axis of ``mesh`` (a ``Mesh`` or ``AbstractMesh``), or a
    ValueError naming both: the one place this is said, for the ops, their lowering and
    the communicators."""
    if axis_name not in mesh.axis_names:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}axis {axis_name!r} is not in the mesh; {mesh.axis_names=}")


def check_divisible(op: str, what: str, value: int, size: int, axis_name: str, shapes: str):
    if value % size != 0:
        raise ValueError(
            f"{op}: {what} ({value}) are not divisible by the size of axis {axis_name!r} "
            f"({size}); {shapes}"
        )


def check_impl(op: str, impl: str) -> None:
    """Every public op, layer and explain_impl call starts here: a JAX_UB_* environment
    variable with invalid text fails it (its error names the variable), then a bad impl."""
    config.check()
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl=}")


def check_matmul_shapes(op: str, x: jax.Array, w: jax.Array) -> None:
    for name, a in (("x", x), ("w", w)):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(
                f"{op}: {name} must be an array (jax.Array or NumPy), got {type(a).__name__}"
            )
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have at least 2 dims [rows, ..., k], got {x.shape=}")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be 2-D [k, n], got {w.shape=}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op}: contracting dims differ: x.shape[-1]={x.shape[-1]} but w.shape[0]="
            f"{w.shape[0]}; {x.shape=} {w.shape=}"
        )


def check_fp8_operands(
    op: str, x, w, fp8: object, names: tuple[str, str] = ("x", "w"), scales: str = "fp8"
) -> None:
    """A clear error for an fp8 operand without ``fp8`` scales, without its own scale, or
    in a format other than ``float8_e4m3fn``; ``names`` and ``scales`` name the operands
    and the scales argument in the message."""
    for field, label, a in (("x", names[0], x), ("w", names[1], w)):
        if not is_quantized(a):
            continue
        shapes = f"{names[0]}: {x.shape} {x.dtype}, {names[1]}: {w.shape} {w.dtype}"
        if jnp.dtype(a.dtype) != E4M3:
            raise ValueError(f"{op}: fp8 operands must be float8_e4m3fn, got {label}; {shapes}")
        where = f"fp8=jax_ub.Fp8Scales({field}=...)" if scales == "fp8" else f"{scales}.{field}"
        if fp8 is None:
            raise ValueError(
                f"{op}: {label} is already fp8: pass its scale as {where} ({label} ~ {label} * "
                f"scale); {shapes}"
            )
        if getattr(fp8, field, None) is None:
            raise ValueError(
                f"{op}: {label} is already fp8, so {scales}.{field} must be its scale (current "
                f"scaling needs the high-precision tensor), got None; {shapes}"
            )


def check_fp8_scales(op: str, fp8: object) -> None:
    """A clear error for anything but an Fp8Scales of float32 scalars (or None fields)."""
    if not isinstance(fp8, Fp8Scales):
        raise TypeError(f"{op}: fp8 must be a jax_ub.Fp8Scales, got {type(fp8).__name__}")
    for name in ("x", "w", "grad"):
        s = getattr(fp8, name)
        if s is None:
            continue
        shape, dtype = jnp.shape(s), jnp.result_type(s)
        if shape != () or dtype != jnp.float32:
            raise ValueError(
                f"{op}: fp8.{name} must be a float32 scalar scale, got shape={shape} dtype={dtype}"
            )


def check_fp8_pair(op: str, fp8, names: str) -> tuple[Fp8Scales | None, Fp8Scales | None]:
    """The ``fp8`` of a two-projection block as a pair of Fp8Scales, ``(None, None)``
    without fp8; a clear error unless a pair of Fp8Scales (``names`` names the pair's
    members in it, e.g. "(up, down)")."""
    if fp8 is None:
        return None, None
    if not isinstance(fp8, (tuple, list)) or len(fp8) != 2:
        raise TypeError(
            f"{op}: fp8 must be a pair {names} of jax_ub.Fp8Scales, got {type(fp8).__name__}"
        )
    for scales in fp8:
        check_fp8_scales(op, scales)
    return tuple(fp8)
