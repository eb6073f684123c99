"""What every Flax layer checks when called, and the ops' settings it is keyed on: the
tensor-parallel group's size, divisibility, the input's layout and features."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
from jax.sharding import AbstractMesh, Mesh

from jax_ub._src.ops import placement
from jax_ub.flax._projection import Projection

# The tensor-parallel mesh axis where nothing names one.
DEFAULT_AXIS = "tp"


def group_size(
    owner: str, mesh: Any, axis_name: Any, *, required: bool = True, impl: str | None = None
) -> int | None:
    """Size of the tensor-parallel axis, from where it is known, in this order: a shard_map
    over it being traced, the layer's ``mesh``, the mesh set by ``jax.set_mesh``.

    When none of them is known: None if ``required`` is False (a layer built before any
    mesh is set checks its sizes when it is called); else 1, or a ValueError, as
    :func:`without_mesh` says for ``impl``. A ValueError too when the axis is not in the
    mesh.
    """
    if not isinstance(axis_name, str):
        raise ValueError(f"{owner}: axis_name must be a mesh axis name (str), got {axis_name!r}")
    if axis_name in placement.manual_axes():
        return int(jax.lax.axis_size(axis_name))
    known = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if known.empty:
        if not required:
            return None
        without_mesh(owner, axis_name, impl)
        return 1
    if axis_name not in known.axis_names:
        raise ValueError(
            f"{owner}: axis_name {axis_name!r} is not an axis of the mesh; "
            f"mesh.axis_names={known.axis_names}{default_axis_hint(axis_name)}"
        )
    return int(known.shape[axis_name])


def without_mesh(owner: str, axis_name: str, impl: str | None) -> None:
    """The one rule for a layer called where no mesh is known (none given or set, none in
    its arrays' types, no shard_map over ``axis_name`` being traced): it runs its plain
    version on global arrays, XLA's matmuls that XLA partitions from the operands'
    shardings (nothing overlapped: ``_core``'s runner warns once), as a group of one;
    except under ``impl="ub"``, which raises here. (A linen init is the one caller that
    asks for the plain version under "ub": its params' shapes do not depend on the
    collectives, ``linen.layers.SettingsModule.resolved_config``.)"""
    if impl is None or impl == "ub":
        raise ValueError(
            f"{owner}: no mesh to run over: call the layer under `with jax.set_mesh(mesh):`, "
            f"pass mesh=... (to the layer or to jax_ub.flax.defaults), or call it inside a "
            f"shard_map over axis {axis_name!r} (impl="
            f"'auto' runs XLA's plain matmuls when no mesh is known; impl={impl!r} does not)"
            f"{default_axis_hint(axis_name)}"
        )


def default_axis_hint(axis_name: str) -> str:
    """What to add to a message about ``axis_name`` where it may be jax_ub's default."""
    if axis_name != DEFAULT_AXIS:
        return ""
    return (
        f". {DEFAULT_AXIS!r} is the default, taken where no axis_name is given and no "
        "logical axis rule maps the layer's split dim (its kernel_axes) to a mesh axis: "
        "pass axis_name=<the tensor-parallel mesh axis> to the layer or to "
        "jax_ub.flax.defaults, or call it under logical axis rules that map that name"
    )


def global_features(features: int, tp: int, axis_name: str, split: bool) -> int:
    """The layer's feature count from an input's: inside a shard_map over ``axis_name``, a
    ``split`` one is its local shard."""
    return features * tp if split and axis_name in placement.manual_axes() else features


def check_dropout(owner: str, rate: Any) -> None:
    """A dropout rate is a number in ``[0, 1)``."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"{owner}: dropout_rate must be a number in [0, 1), got {rate!r}")


def check_divisible(owner: str, what: str, value: int, tp: int, axis_name: str) -> None:
    if value <= 0 or value % tp != 0:
        raise ValueError(
            f"{owner}: {what}={value} must be a positive multiple of the size of axis "
            f"{axis_name!r} ({tp})"
        )


def check_input(
    owner: str,
    x: Any,
    in_features: int | Projection | None,
    tp: int,
    axis_name: str,
    seq_axis: int = 0,
    sequence_parallel: bool | None = None,
) -> bool:
    """Check that x is ``[seq, *batch, in_features]`` (the sequence at ``seq_axis``) and
    return whether the call runs sequence-parallel.

    ``in_features`` is the count of the last dim, or a projection's trailing dims
    (``Projection.in_shape``, its split one the local shard inside a shard_map over
    ``axis_name``), where ``seq_axis`` counts as on the input flattened to
    ``[..., features]``; None accepts any features (linen infers them from the input).

    ``sequence_parallel`` is the layer's setting (``ParallelConfig``'s): False runs with
    the activations replicated over the axis (:func:`linear_replicated`). Otherwise, inside
    a shard_map over ``axis_name`` the layers take sequence shards (True); on global arrays
    they run sequence-parallel where ``tp`` divides the sequence, and else (one token being
    decoded, a prompt of any length) replicated, unless ``sequence_parallel`` is True,
    which makes that a ValueError.
    """
    shape = getattr(x, "shape", None)
    trailing = _trailing(in_features, tp, axis_name)
    if shape is None or len(shape) < 1 + len(trailing or (0,)):
        dims = "features" if trailing is None or len(trailing) == 1 else f"*{trailing}"
        what = f"[seq, *batch, {dims}]"
        raise ValueError(f"{owner}: input must be {what}, got shape {shape}")
    if trailing is not None and tuple(shape[len(shape) - len(trailing) :]) != trailing:
        if len(trailing) == 1:
            got, want, where = shape[-1], trailing[0], "last dim"
        else:
            got, want = tuple(shape[len(shape) - len(trailing) :]), trailing
            where = f"last {len(trailing)} dims"
        raise ValueError(
            f"{owner}: input has {got} features ({where}) but the layer expects {want}; "
            f"input shape {tuple(shape)}"
        )
    n_in = len(trailing or (0,))
    flat = SimpleNamespace(shape=(*shape[: len(shape) - n_in], math.prod(shape[-n_in:])))
    seq = placement.check_seq_axis(owner, flat, seq_axis)
    if sequence_parallel is False:
        return False
    if axis_name in placement.manual_axes() or shape[seq] % tp == 0:
        return True
    if sequence_parallel:
        raise ValueError(
            f"{owner}: sequence_parallel=True splits the sequence (dim {seq} of the input, "
            f"{shape[seq]}) over axis {axis_name!r}, whose size {tp} does not divide it; "
            f"input shape {shape}"
        )
    return False


def _trailing(in_features: int | Projection | None, tp: int, axis_name: str) -> tuple | None:
    """The input's trailing dims a layer expects where it sees the input."""
    if in_features is None:
        return None
    if not isinstance(in_features, Projection):
        return (in_features,)
    dims = list(in_features.in_shape)
    if in_features.kind == "row" and axis_name in placement.manual_axes():
        dims[in_features.split] //= tp
    return tuple(dims)


def prepare(
    owner: str,
    config: Any,
    axis_name: str,
    x: Any,
    in_features: int | Projection | None = None,
    *,
    divisible: Mapping[str, int] | None = None,
    params: Callable[[], Any] | None = None,
) -> tuple[Ops, bool]:
    """What every layer checks when called, and what its compiled function is keyed on:
    the tensor-parallel group's size (from the mesh) divides each of ``divisible``'s
    values, ``x`` is ``[seq, *batch, in_features]`` (:func:`check_input`). Returns the ops'
    settings and whether the call runs sequence-parallel. With no mesh given or set, the
    mesh is the one ``x``'s or ``params()``' types say they are sharded over
    (:func:`mesh_of_arrays`): a step jitted on sharded arrays without ``jax.set_mesh``;
    ``params`` is called only then."""
    mesh = config.mesh
    if mesh is None and jax.sharding.get_abstract_mesh().empty:
        if axis_name not in placement.manual_axes():
            mesh = mesh_of_arrays(axis_name, x, None if params is None else params())
    tp = group_size(owner, mesh, axis_name, impl=config.impl)
    for what, value in (divisible or {}).items():
        check_divisible(owner, what, value, tp, axis_name)
    seq, sp = config.seq_axis, config.sequence_parallel
    sp = check_input(owner, x, in_features, tp, axis_name, seq, sp)
    return op_settings(config, axis_name, mesh), sp


def mesh_of_arrays(axis_name: str, *trees: Any) -> Any:
    """The mesh (an ``AbstractMesh``) over which the arrays of ``trees`` are sharded, as
    their types carry it (committed arrays under ``jit``), where it has ``axis_name``;
    else None."""
    for leaf in jax.tree.leaves(trees):
        try:
            mesh = jax.typeof(leaf).sharding.mesh
        except (AttributeError, TypeError):
            continue
        if not mesh.empty and axis_name in mesh.axis_names:
            return mesh
    return None


class Ops(NamedTuple):
    """The settings of the ops a layer runs, from its ``ParallelConfig`` and resolved
    axis: the leading argument of every ``*_call`` below, which are cached on it. ``fp8``
    is the recipe's name (``"current"``, ``"delayed"``) or None."""

    mesh: Mesh | AbstractMesh | None  # abstract: found from the arrays (mesh_of_arrays)
    axis_name: str
    impl: str
    dtype: Any
    fp8: str | None
    seq_axis: int


def op_settings(config: Any, axis_name: str, mesh: Any = None) -> Ops:
    """:class:`Ops` of a layer's ``ParallelConfig`` over its resolved ``axis_name``, on
    ``mesh`` where the config has none."""
    mesh = config.mesh if config.mesh is not None else mesh
    return Ops(mesh, axis_name, config.impl, config.dtype, config.fp8_recipe, config.seq_axis)
