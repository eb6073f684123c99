"""How a partly manual computation keeps the batch split: the layout in which lowering's
nested shard_map (``custom_call._lower_nested``) takes an op's operands over the mesh axes
still automatic, and the local shape of an array so laid out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_ub._src.settings.warn_registry import warn_once


def batch_spec(aval: Any, mesh: Any, auto: Sequence[str]) -> P:
    """How ``x [rows, *batch, cols]`` is split over the automatic axes ``auto``.

    Only batch dims can be: the rows are the dim the op gathers or scatters over its own
    axis, and the columns are contracted or are the weight's. Where the array's type
    carries its sharding (``Explicit`` axes), that is used. ``Auto`` axes have no sharding
    at trace time, so they are laid out the way data parallelism lays out a batch: every
    automatic axis of size > 1, in mesh order, on the first batch dim they divide. If the
    activations are laid out otherwise, XLA moves them into this layout and back; if no
    batch dim fits, the op's operands are replicated over those axes (correct, but each
    device then computes the whole batch).
    """
    ndim = len(aval.shape)
    entries: list[Any] = [None] * ndim
    typed = getattr(getattr(aval, "sharding", None), "spec", None)
    explicit = [a for a in auto if _axis_type(mesh, a) == AxisType.Explicit]
    if typed is not None and explicit:
        for d in range(1, ndim - 1):
            names = spec_axes(typed[d] if d < len(typed) else None)
            kept = tuple(a for a in names if a in auto)
            entries[d] = kept[0] if len(kept) == 1 else (kept or None)
    free = [a for a in auto if a not in explicit and mesh.shape[a] > 1]
    size = int(np.prod([mesh.shape[a] for a in free])) if free else 1
    if free:
        for d in range(1, ndim - 1):
            if entries[d] is None and aval.shape[d] % size == 0:
                entries[d] = free[0] if len(free) == 1 else tuple(free)
                break
        else:
            _warn_replicated(tuple(aval.shape), tuple(free), size)
    return P(*entries)


def _warn_replicated(shape: tuple, axes: tuple, size: int) -> None:
    """Once per shape: no batch dim of x can be split over the automatic axes, so every
    device of them computes the whole op (correct, but not data-parallel)."""
    if len(shape) > 2:
        message = (
            f"jax_ub: x of shape {shape} ([rows, *batch, features] as the op sees it) has "
            f"batch dims {shape[1:-1]}, none divisible by {size}, the size of the automatic "
            f"mesh axes {axes}: the op runs on the whole batch on every device of those "
            f"axes (correct, not data-parallel). A batch divisible by {size} is split."
        )
    else:
        message = (
            f"jax_ub: x of shape {shape} has no batch dim (between the rows and the "
            f"features) to split over the automatic mesh axes {axes} (size {size}): the op "
            "runs on the whole batch on every device of those axes (correct, not "
            "data-parallel). Keep a batch dim, e.g. [seq, batch, features] rather than "
            "[seq * batch, features]."
        )
    warn_once(message, message)


def local_shape(shape: Sequence[int], spec: P, mesh: Any) -> tuple[int, ...]:
    """The shape of one device's shard of an array of ``shape`` laid out as ``spec``."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    sizes = [int(np.prod([mesh.shape[a] for a in spec_axes(e)])) for e in entries]
    return tuple(d // s for d, s in zip(shape, sizes))


def _axis_type(mesh: Any, axis: str) -> Any:
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis]


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names (None, a name, or a tuple)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)
