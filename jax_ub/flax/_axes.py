"""Logical axis names of the Flax layers' params, and the tensor-parallel axis they imply:
the user's ``logical_axis_rules`` (flax's, for linen and nnx alike) map the names to mesh
axes."""

from __future__ import annotations

from typing import Any

import jax
from flax.core import spmd as flax_spmd

from jax_ub._src.settings.warn_registry import warn_once
from jax_ub.flax import _projection
from jax_ub.flax._checks import DEFAULT_AXIS


def tp_axis(owner: str, axis_name: str | None, split_name: str | None, mesh: Any = None) -> str:
    """The tensor-parallel mesh axis of a layer: ``axis_name`` where given; else, for a
    layer with logical axis names, the mesh axis the user's ``logical_axis_rules``
    (``nn.logical_axis_rules`` / ``nnx.logical_axis_rules``) map its split dim's name
    ``split_name`` to (of a rule listing several, the one of size > 1 on ``mesh`` or the
    mesh set: :func:`_split_axis`); else ``"tp"``."""
    if axis_name is not None:
        return axis_name
    if split_name is None:
        return DEFAULT_AXIS
    mapped = _rule_axis(owner, split_name, mesh)
    if mapped is None:
        _warn_unmapped(owner, split_name, flax_spmd.get_logical_axis_rules())
        return DEFAULT_AXIS
    return mapped


def box_split_axis(owner: str, name: Any, mesh: Any = None) -> str | None:
    """The tensor-parallel axis an NNX block's boxed ``kernel_init`` names its split dim
    with: the mesh axis the active logical axis rules map ``name`` to (as for
    ``kernel_axes``), else ``name`` itself where it is an axis of ``mesh`` (or the mesh set):
    NNX's box names may be mesh axes, which no rule lists. None where neither."""
    if name is None:
        return None
    mapped = _rule_axis(owner, name, mesh)
    if mapped is not None:
        return mapped
    return name if name in axis_sizes(mesh) else None


def _rule_axis(owner: str, name: Any, mesh: Any) -> str | None:
    """The tensor-parallel mesh axis the active logical axis rules map the kernel dim name
    ``name`` to (:func:`_split_axis`); None where no rule maps it."""
    rules = flax_spmd.get_logical_axis_rules()
    return _split_axis(owner, name, _mapped_axes(name, rules), None, mesh)


def axis_sizes(mesh: Any = None) -> dict[str, int]:
    """The sizes of ``mesh``'s axes, else of the mesh set (``jax.set_mesh``, a shard_map
    being traced); empty where none is known."""
    known = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    return {} if known.empty else dict(known.shape)


def _mapped_axes(name: Any, rules: Any) -> tuple[str, ...]:
    """The mesh axes the first of the ``rules`` for the logical ``name`` maps it to (one
    or several; none where no rule names it or it maps to None)."""
    mapped = next((mesh_axes for rule, mesh_axes in rules or () if rule == name), None)
    if isinstance(mapped, (tuple, list)):
        return tuple(a for a in mapped if a is not None)
    return () if mapped is None else (mapped,)


def _split_axis(owner: str, name: Any, axes: tuple, axis_name: str | None, mesh: Any) -> str | None:
    """The tensor-parallel axis among ``axes``, the mesh axes a kernel dim named ``name``
    is split over: ``axis_name`` where given and listed (None where not listed); else the
    one axis; else, of several (a rule ``'mlp' -> ['fsdp_transpose', 'tensor', ...]``),
    the one of size > 1 on the mesh (the first where all have size 1). Two of size > 1,
    or several with no mesh known, are a ValueError naming them."""
    if not axes:
        return None
    if axis_name is not None:
        return axis_name if axis_name in axes else None
    if len(axes) == 1:
        return axes[0]
    sizes = axis_sizes(mesh)
    if not sizes:
        raise ValueError(
            f"{owner}: the logical axis rules map {name!r} to the mesh axes {axes}; jax_ub "
            "splits over the one of size > 1, and no mesh is known here: set one "
            "(jax.set_mesh, or mesh=...), or pass axis_name=... naming the tensor-parallel axis"
        )
    big = [a for a in axes if sizes.get(a, 1) > 1]
    if len(big) > 1:
        raise ValueError(
            f"{owner}: the logical axis rules map {name!r} to the mesh axes {axes}, of which "
            f"{tuple(big)} have size > 1 ({', '.join(f'{a}={sizes[a]}' for a in big)}); jax_ub "
            f"splits over one axis: pass axis_name=... naming one of {tuple(big)}"
        )
    return big[0] if big else axes[0]


def choose_split(
    owner: str,
    kind: str,
    n_in: int,
    names: tuple | None,
    axis_name: str | None,
    *,
    mesh_names=False,
    mesh: Any = None,
) -> tuple[int, str]:
    """``(kernel dim, mesh axis)``: which dim of a ``kind`` projection's kernel
    ``[*in_shape (n_in dims), *features]`` is split over which tensor-parallel axis.

    The candidates are the features (column) or the contracted dims (row). With ``names``
    of the kernel's dims, logical ones (``kernel_axes``, or a ``kernel_init``'s
    partitioning; mesh axes with ``mesh_names``, a linen ``nn.Partitioned``): the first
    candidate named ``axis_name`` or mapped to it (alone or among several mesh axes) by the
    active logical axis rules, or, with no ``axis_name`` given, the first one a rule maps
    to a mesh axis (:func:`_split_axis`; or, with no rule for it, the first named
    ``"tp"``). Else the first candidate, over ``axis_name`` or ``"tp"``. A warning where
    the names place no candidate on the chosen axis, or where that axis has size 1 on
    ``mesh`` (or the mesh set) while they split a candidate over another axis: XLA would
    then gather the kernel whole at every call (:func:`_warn_group_of_one`)."""
    if names is None:
        return (n_in if kind == "column" else 0), axis_name or DEFAULT_AXIS
    candidates = list(range(n_in, len(names)) if kind == "column" else range(n_in))
    rules = () if mesh_names else flax_spmd.get_logical_axis_rules()
    listed = {d: _dim_axes(names[d], rules, mesh_names, axis_name) for d in candidates}
    for d in candidates:
        axis = _split_axis(owner, names[d], listed[d], axis_name, mesh)
        if axis is not None:
            _warn_group_of_one(owner, names, listed, d, axis, mesh)
            return d, axis
    d, axis = candidates[0], axis_name or DEFAULT_AXIS
    if names[d] is None:
        _warn_unnamed(owner, names, d, axis)
    elif axis_name is None:
        _warn_unmapped(owner, names[d], rules)
    _warn_group_of_one(owner, names, listed, d, axis, mesh)
    return d, axis


def choose_kind(
    owner: str,
    n_in: int,
    names: tuple | None,
    axis_name: str | None,
    *,
    mesh_names: bool = False,
    mesh: Any = None,
) -> tuple[str, str | None]:
    """``(kind, tensor-parallel axis or None)`` of a DenseGeneral-shaped projection from
    its kernel's names ``[*in (n_in dims), *features]`` (logical, placed by the active
    rules; mesh axes with ``mesh_names``) and the mesh (``mesh``, else the one set).

    The tensor-parallel axis is ``axis_name``; without it, the one mesh axis of size > 1
    the names split the kernel over (several: a ValueError naming them, asking for
    ``axis_name``). Then ``"column"`` where a feature dim is split over it, ``"row"`` where
    a contracted dim is, else ``"replicated"``: a plain matmul, XLA's, as also where the
    axis has size 1 (a group of one) or no names or mesh say anything (a layer initialized
    with no mesh has the same params either way)."""
    if names is None:
        return "replicated", axis_name
    sizes = axis_sizes(mesh)
    rules = () if mesh_names else flax_spmd.get_logical_axis_rules()
    listed = [_dim_axes(n, rules, mesh_names, axis_name) for n in names]
    if axis_name is None:
        if not sizes:
            return "replicated", None
        order = list(sizes)
        big = sorted({a for on in listed for a in on if sizes.get(a, 1) > 1}, key=order.index)
        if len(big) > 1:
            raise ValueError(
                f"{owner}: the kernel's names {names} are split over the mesh axes "
                f"{tuple(big)} ({', '.join(f'{a}={sizes[a]}' for a in big)}); pass "
                "axis_name=... naming the tensor-parallel one (to the layer, or to "
                "jax_ub.flax.defaults); XLA keeps the others as it would"
            )
        if not big:
            return "replicated", None
        axis_name = big[0]
    elif sizes and sizes.get(axis_name, 1) == 1:
        return "replicated", axis_name
    column = [d for d in range(n_in, len(names)) if axis_name in listed[d]]
    row = [d for d in range(n_in) if axis_name in listed[d]]
    if column and row:
        raise ValueError(
            f"{owner}: the kernel's names {names} split both a contracted dim ({row[0]}) "
            f"and a feature dim ({column[0]}) over the tensor-parallel axis {axis_name!r}; "
            "a projection splits one side"
        )
    return ("column" if column else "row" if row else "replicated"), axis_name


def _dim_axes(name: Any, rules: Any, mesh_names: bool, axis_name: str | None) -> tuple:
    """The mesh axes a kernel dim of that ``name`` is split over: ``name`` itself where
    ``mesh_names`` (one axis or several), else the rules'; a name the rules do not map
    that is ``axis_name`` or ``"tp"`` counts as a mesh axis named directly."""
    if mesh_names:
        return tuple(name) if isinstance(name, (tuple, list)) else (() if name is None else (name,))
    axes = _mapped_axes(name, rules)
    if not axes and name is not None and name in (axis_name, DEFAULT_AXIS):
        return (name,)
    return axes


def _warn_group_of_one(
    owner: str, names: tuple, listed: dict, dim: int, axis: str, mesh: Any
) -> None:
    """Once: the layer splits over ``axis``, of size 1 on the mesh (a group of one), or
    over an axis its names do not place the split ``dim`` on, while they split one of
    the dims it could split over another axis of size > 1: the ops run unsplit, and XLA
    gathers that kernel whole onto every device at every call (splitting the batch
    instead)."""
    sizes = axis_sizes(mesh)
    if not sizes or (sizes.get(axis, 1) > 1 and axis in listed.get(dim, ())):
        return
    other = [(d, a) for d, on in listed.items() for a in on if a != axis and sizes.get(a, 1) > 1]
    if not other:
        return
    d, a = other[0]
    message = (
        f"{owner}: it runs over axis_name {axis!r} (size {sizes.get(axis, 1)} on the mesh), "
        f"while its kernel's dim {d} (named {names[d]!r}) is split over {a!r} (size "
        f"{sizes[a]}): jax_ub runs a group of {sizes.get(axis, 1)} over {axis!r}, and XLA "
        f"gathers the kernel whole onto every device at every call. Pass axis_name={a!r} "
        "(to the layer or to jax_ub.flax.defaults) for tensor parallelism over it"
    )
    warn_once(f"group of one: {owner} {names} {axis} {a}", message)


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


def block_kernel_axes(owner: str, kernel_axes: Any, param_axes: Any) -> tuple:
    """A block's ``kernel_axes``, the logical names ``(model dim, split dim)``, checked."""
    kernel_axes = kernel_names(owner, kernel_axes, None, param_axes)
    check_kernel_axes(owner, kernel_axes, 2)
    return kernel_axes


def check_kernel_axes(owner: str, kernel_axes: Any, ndim: int) -> None:
    """``kernel_axes`` name each of a kernel's ``ndim`` dims."""
    if not isinstance(kernel_axes, (tuple, list)) or len(kernel_axes) != ndim:
        example = "('embed', 'mlp')" if ndim == 2 else "('embed', 'heads', 'head_dim')"
        raise ValueError(
            f"{owner}: kernel_axes must name each of the kernel's {ndim} dims ([*in, *out]), "
            f"e.g. {example}; got {kernel_axes!r}"
        )


def given_names(
    owner: str, kernel_axes: Any, kernel_init: Any, param_axes: Any
) -> tuple[tuple | None, bool]:
    """A kernel's names, or a block's ``(model dim, split dim)``, and whether they are mesh
    axes: ``kernel_axes`` (logical), or those ``kernel_init`` boxes its values with
    (``_projection.box_names``: linen's ``nn.with_partitioning`` gives mesh axes); checked
    by :func:`kernel_names`."""
    from_init, mesh_names = _projection.box_names(kernel_init)
    names = kernel_names(owner, kernel_axes, from_init, param_axes)
    return names, mesh_names and kernel_axes is None


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
    return block_kernel_axes(owner, kernel_axes, param_axes)[1]
