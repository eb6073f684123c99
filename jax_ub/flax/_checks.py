"""What every Flax layer checks when called, and the ops' settings it is keyed on: the
tensor-parallel group's size, divisibility, the input's layout and features."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jax_ub._src.ops import placement
from jax_ub.flax._projection import Projection
from jax_ub.flax._settings import ParallelConfig

# The tensor-parallel mesh axis where nothing names one.
DEFAULT_AXIS = "tp"


def group_size(
    owner: str,
    axis_name: Any,
    *arrays: Any,
    mesh: Any = None,
    required: bool = True,
    impl: str | None = None,
) -> int | None:
    """Size of the tensor-parallel axis: a shard_map's over it being traced, else the mesh a
    call on ``arrays`` runs over (:func:`placement.find_mesh`: the one set by
    ``jax.set_mesh``, the layer's ``mesh``, the arrays').

    When no mesh is known: None if ``required`` is False (a layer built before any mesh is
    set checks its sizes when it is called); else 1, or a ValueError, as
    :func:`without_mesh` says for ``impl``. A ValueError too when the axis is not in the
    mesh.
    """
    if not isinstance(axis_name, str):
        raise ValueError(f"{owner}: axis_name must be a mesh axis name (str), got {axis_name!r}")
    if axis_name in placement.manual_axes():
        return int(jax.lax.axis_size(axis_name))
    known = placement.find_mesh(axis_name, *arrays, given=mesh)
    if known is None:
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
    runs the plain version under "ub": its params' shapes do not depend on the
    collectives; ``linen.layers.SettingsModule.resolved_config`` gives it ``impl="xla"``,
    as only linen's scope knows it is initializing.)"""
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
) -> tuple[bool, int]:
    """Check that x is ``[seq, *batch, in_features]`` (the sequence at ``seq_axis``) and
    return whether the call runs sequence-parallel, and ``seq_axis`` as an index (``>= 0``):
    the one place a layer's ``seq_axis`` is checked against its input.

    ``in_features`` is the count of the last dim, or a projection's trailing dims
    (``Projection.in_shape``, its split one the local shard inside a shard_map over
    ``axis_name``), which a negative ``seq_axis`` counts as one dim (the ops' features,
    the input flattened to ``[..., features]``); None accepts any features (linen infers
    them from the input).

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
    seq = seq_index(owner, tuple(shape), seq_axis, len(trailing or (0,)))
    if sequence_parallel is False:
        return False, seq
    if axis_name in placement.manual_axes() or shape[seq] % tp == 0:
        return True, seq
    if sequence_parallel:
        raise ValueError(
            f"{owner}: sequence_parallel=True splits the sequence (dim {seq} of the input, "
            f"{shape[seq]}) over axis {axis_name!r}, whose size {tp} does not divide it; "
            f"input shape {shape}"
        )
    return False, seq


def seq_index(owner: str, shape: tuple, seq_axis: int, n_in: int = 1) -> int:
    """A layer's ``seq_axis`` (an int: ``ParallelConfig`` checks its type) as an index of a
    dim of an input of ``shape`` before its ``n_in`` features (which negative values count
    as one dim), or a ValueError naming the shape."""
    lead = len(shape) - n_in
    index = seq_axis + lead + 1 if seq_axis < 0 else seq_axis
    if not 0 <= index < lead:
        features = "the last dim" if n_in == 1 else f"the last {n_in} dims, which count as one"
        raise ValueError(
            f"{owner}: seq_axis={seq_axis} is not a dim of x before its features ({features}); "
            f"for x.shape={shape} it is one of 0..{lead - 1} (or {-lead - 1}..-2)"
        )
    return index


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
    config: ParallelConfig,
    x: Any,
    in_features: int | Projection | None = None,
    *,
    divisible: Mapping[str, int] | None = None,
    params: Callable[[], Any] | None = None,
) -> ParallelConfig:
    """What every layer checks when called: the tensor-parallel group's size (from the
    mesh a call on ``x`` and ``params()``, called only where no mesh is set or given,
    runs over) divides each of ``divisible``'s values, ``x`` is ``[seq, *batch,
    in_features]`` (:func:`check_input`). Returns the call's settings, what its compiled
    function is keyed on: ``config`` (its ``axis_name`` resolved) with
    ``sequence_parallel`` decided for ``x`` and ``seq_axis`` an index of its dims."""
    axis_name = config.axis_name
    arrays = (x,) if params is None else (x, params)
    tp = group_size(owner, axis_name, *arrays, mesh=config.mesh, impl=config.impl)
    for what, value in (divisible or {}).items():
        check_divisible(owner, what, value, tp, axis_name)
    seq, sp = config.seq_axis, config.sequence_parallel
    sp, seq = check_input(owner, x, in_features, tp, axis_name, seq, sp)
    return dataclasses.replace(config, sequence_parallel=sp, seq_axis=seq, owner=owner)
