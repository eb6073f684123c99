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
    mapped = _mapped(owner, split_name, rules)
    if mapped is None:
        _warn_unmapped(owner, split_name, rules)
        return DEFAULT_AXIS
    return mapped


def _mapped(owner: str, name: Any, rules: Any) -> str | None:
    """The mesh axis the ``rules`` map the logical ``name`` to, or None."""
    mapped = next((mesh_axes for rule, mesh_axes in rules or () if rule == name), None)
    if not mapped:
        return None
    if isinstance(mapped, (tuple, list)):
        if len(mapped) != 1:
            raise ValueError(
                f"{owner}: the logical axis rules map {name!r} to the mesh axes "
                f"{tuple(mapped)}; jax_ub splits over one axis: map it to one, or pass "
                "axis_name=..."
            )
        mapped = mapped[0]
    return mapped


def choose_split(
    owner: str,
    kind: str,
    n_in: int,
    names: tuple | None,
    axis_name: str | None,
    *,
    mesh_names=False,
) -> tuple[int, str]:
    """``(kernel dim, mesh axis)``: which dim of a ``kind`` projection's kernel
    ``[*in_shape (n_in dims), *features]`` is split over which tensor-parallel axis.

    The candidates are the features (column) or the contracted dims (row). With ``names``
    of the kernel's dims, logical ones (``kernel_axes``, or a ``kernel_init``'s
    partitioning; mesh axes with ``mesh_names``, a linen ``nn.Partitioned``): the first
    candidate named ``axis_name`` or mapped to it by the active logical axis rules, or,
    with no ``axis_name`` given, the first one a rule maps to a mesh axis (or, with no
    rule for it, the first named ``"tp"``). Else the first candidate, over ``axis_name``
    or ``"tp"``; with names that place no candidate on that axis, a warning: the params
    would not be split."""
    if names is None:
        return (n_in if kind == "column" else 0), axis_name or DEFAULT_AXIS
    candidates = list(range(n_in, len(names)) if kind == "column" else range(n_in))
    rules = () if mesh_names else flax_spmd.get_logical_axis_rules()
    placed = {}
    for d in candidates:
        mapped = names[d] if mesh_names else _mapped(owner, names[d], rules)
        if mapped is None and names[d] in (axis_name, DEFAULT_AXIS):
            mapped = names[d]  # a mesh axis named directly
        if isinstance(mapped, str):
            placed[d] = mapped
    wanted = axis_name if axis_name is not None else next(iter(placed.values()), None)
    for d, mapped in placed.items():
        if mapped == wanted:
            return d, wanted
    split_name = names[candidates[0]]
    if split_name is None:
        _warn_unnamed(owner, names, candidates[0], axis_name or DEFAULT_AXIS)
    elif axis_name is None:
        _warn_unmapped(owner, split_name, rules)
    return candidates[0], axis_name or DEFAULT_AXIS


def _warn_unnamed(owner: str, names: tuple, dim: int, axis_name: str) -> None:
    """Once: the kernel's names leave every dim the layer could split unnamed, so its
    params would be placed replicated while the layer splits them."""
    message = (
        f"{owner}: the kernel's names {names} name none of the dims it splits over the "
        f"tensor-parallel axis (dim {dim}, None there): the params are placed unsplit while "
        f"the layer runs split over {axis_name!r}. Name dim {dim} (kernel_axes, or the "
        "kernel_init's partitioning) with a name your logical axis rules map to that axis"
    )
    warn_once(f"unnamed split dim: {owner} {names}", message)


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
    kernel_axes = kernel_names(owner, kernel_axes, None, param_axes)
    check_kernel_axes(owner, kernel_axes, 2)
    return {"kernel": kernel_axes, "bias": (kernel_axes[1],)}


def check_kernel_axes(owner: str, kernel_axes: Any, ndim: int) -> None:
    """``kernel_axes`` name each of a kernel's ``ndim`` dims."""
    if not isinstance(kernel_axes, (tuple, list)) or len(kernel_axes) != ndim:
        example = "('embed', 'mlp')" if ndim == 2 else "('embed', 'heads', 'head_dim')"
        raise ValueError(
            f"{owner}: kernel_axes must name each of the kernel's {ndim} dims ([*in, *out]), "
            f"e.g. {example}; got {kernel_axes!r}"
        )


def kernel_names(
    owner: str, kernel_axes: Any, from_init: tuple | None, param_axes: Any
) -> tuple | None:
    """A projection kernel's names: ``kernel_axes``, or ``from_init``, those its
    ``kernel_init``'s partitioning boxes it with (not both; neither with ``param_axes``)."""
    if kernel_axes is not None and from_init is not None:
        raise ValueError(
            f"{owner}: the kernel's names come from kernel_axes={kernel_axes!r} or from its "
            f"kernel_init's partitioning ({from_init!r}), not both"
        )
    names = kernel_axes if kernel_axes is not None else from_init
    if names is not None and param_axes is not None:
        raise ValueError(
            f"{owner}: pass either param_axes (mesh axes) or kernel_axes (logical names, for "
            f"logical_axis_rules; or a kernel_init with partitioning), not both; got "
            f"param_axes={param_axes!r}, names={tuple(names)!r}"
        )
    return None if names is None else tuple(names)


def block_split_name(owner: str, kernel_axes: Any, param_axes: Any) -> str | None:
    """The logical name of a block's split dim (hidden units, heads) from its checked
    ``kernel_axes`` ``(model dim, split dim)``; None without them."""
    if kernel_axes is None:
        return None
    return logical_param_names("column", kernel_axes, owner, param_axes)["kernel"][1]
