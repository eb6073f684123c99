"""Logical axis names of the Flax layers' params, and the tensor-parallel axis they imply:
the user's ``logical_axis_rules`` (flax's, for linen and nnx alike) map the names to mesh
axes."""

from __future__ import annotations

from typing import Any

from flax.core import spmd as flax_spmd

from jax_ub._src.settings.warn_registry import warn_once
from jax_ub.flax._checks import DEFAULT_AXIS


def tp_axis(owner: str, axis_name: str | None, split_name: str | None) -> str:
    """The tensor-parallel mesh axis of a layer: ``axis_name`` where given; else, for a
    layer with logical axis names, the mesh axis the user's ``logical_axis_rules``
    (``nn.logical_axis_rules`` / ``nnx.logical_axis_rules``) map its split dim's name
    ``split_name`` to; else ``"tp"``."""
    if axis_name is not None:
        return axis_name
    if split_name is None:
        return DEFAULT_AXIS
    rules = flax_spmd.get_logical_axis_rules()
    mapped = next((mesh_axes for name, mesh_axes in rules or () if name == split_name), None)
    if not mapped:
        _warn_unmapped(owner, split_name, rules)
        return DEFAULT_AXIS
    if isinstance(mapped, (tuple, list)):
        if len(mapped) != 1:
            raise ValueError(
                f"{owner}: the logical axis rules map {split_name!r} to the mesh axes "
                f"{tuple(mapped)}; jax_ub splits over one axis: map it to one, or pass "
                "axis_name=..."
            )
        mapped = mapped[0]
    return mapped


def _warn_unmapped(owner: str, split_name: str, rules: Any) -> None:
    """Once per layer kind and name: the rules place none of the params' split dims, so
    the params would be replicated where the layer splits them over the default axis."""
    where = (
        "no logical axis rules are active"
        if not rules
        else f"the logical axis rules map {split_name!r} to no mesh axis (rules: {tuple(rules)})"
    )
    message = (
        f"{owner}: its params' split dim is named {split_name!r} (kernel_axes), but {where}: "
        f"the params are not split by the rules, and the layer runs over the default mesh "
        f"axis {DEFAULT_AXIS!r}. Map {split_name!r} to the tensor-parallel mesh axis in the "
        "rules (active at init and apply), or pass axis_name=... (to the layer or to "
        "jax_ub.flax.defaults)"
    )
    warn_once(f"unmapped logical axis: {owner} {split_name} {where}", message)


def logical_param_names(kind: str, kernel_axes: Any, owner: str, param_axes: Any) -> dict:
    """Param names of a ``kind`` layer given the kernel's logical axis names ``(in, out)``:
    the kernel's, and the bias's (its output dim's)."""
    if param_axes is not None:
        raise ValueError(
            f"{owner}: pass either param_axes (mesh axes) or kernel_axes (logical names, "
            f"for logical_axis_rules), not both; got {param_axes=}, {kernel_axes=}"
        )
    if not isinstance(kernel_axes, (tuple, list)) or len(kernel_axes) != 2:
        raise ValueError(
            f"{owner}: kernel_axes must name the kernel's two dims, (in, out), e.g. "
            f"('embed', 'mlp'); got {kernel_axes!r}"
        )
    return {"kernel": tuple(kernel_axes), "bias": (kernel_axes[1],)}


def block_split_name(owner: str, kernel_axes: Any, param_axes: Any) -> str | None:
    """The logical name of a block's split dim (hidden units, heads) from its checked
    ``kernel_axes`` ``(model dim, split dim)``; None without them."""
    if kernel_axes is None:
        return None
    return logical_param_names("column", kernel_axes, owner, param_axes)["kernel"][1]


def split_name(kind: str, kernel_axes: Any) -> str | None:
    """The logical name of the kernel dim a ``kind`` layer splits over its axis."""
    if kernel_axes is None:
        return None
    return kernel_axes[1] if kind == "column" else kernel_axes[0]
