"""Where the ops' operands live on the mesh, in the three ways the ops can be called.

1. Inside ``jax.shard_map`` with every mesh axis manual: operands are the local shards.
2. Inside ``jax.shard_map`` whose manual axes include the op's axis while others stay
   automatic (partial-auto): operands are local over the manual axes, global over the
   others. Lowering makes the remaining axes manual around the custom call, keeping the
   batch dims sharded over them (``lowering.batch_layout.batch_spec``).
3. From plain ``jit`` (or eagerly) on global arrays under a mesh (``jax.set_mesh``): the
   op runs in a shard_map (:func:`global_call`) manual over every axis, the others
   splitting its rows (case 1), or, where no row dim splits or in fp8, over its own axis
   alone (case 2).
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub._src.lowering import device_probe
from jax_ub._src.lowering.batch_layout import spec_axes
from jax_ub._src.lowering.varying import manual_axes as manual_axes  # the ops and layers ask here
from jax_ub._src.ops.cpu_16bit import INPUTS_DTYPE, Widening, is_spec
from jax_ub._src.settings import checks

# --- the sequence dim --------------------------------------------------------------------


def check_seq_axis_type(op: str, seq_axis: Any) -> None:
    """``seq_axis`` is an int (a layer checks it when built, before it knows its input)."""
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, (int, np.integer)):
        raise ValueError(f"{op}: seq_axis must be an int (a dim of x), got {seq_axis!r}")


def check_seq_axis(op: str, x: Any, seq_axis: Any) -> int:
    """``seq_axis`` as an index in ``[0, x.ndim - 1)``: the dim of ``x`` the op gathers or
    scatters over its mesh axis (the sequence). 0 for ``[seq, batch, ..., k]``, 1 for
    batch-major ``[batch, seq, ..., k]``; negative values count from the end. The last dim
    is the features, never the sequence."""
    ndim = len(x.shape)
    check_seq_axis_type(op, seq_axis)
    index = int(seq_axis) + ndim if seq_axis < 0 else int(seq_axis)
    if not 0 <= index < ndim - 1:
        raise ValueError(
            f"{op}: seq_axis={seq_axis} is not a dim of x before its features (the last "
            f"dim); for x.shape={tuple(x.shape)} it is one of 0..{ndim - 2} (or {-ndim}..-2)"
        )
    return index


def seq_first(a: Any, seq_axis: int) -> Any:
    """``a`` with its sequence dim moved to the front, for code that reads the sequence
    first (attention, ``matmul_all_reduce``'s padding of the rows). The ops' calls take a
    batch-major shard without it (:func:`as_rank_block`). The move keeps the feature dim
    last (rows are reordered, not transposed), and XLA fuses it into the op that produces
    ``a`` where it can."""
    return a if seq_axis == 0 else jax.numpy.moveaxis(a, seq_axis, 0)


def seq_back(tree: Any, seq_axis: int) -> Any:
    """Every array of ``tree`` with dim 0 moved back to ``seq_axis``: :func:`seq_first`'s
    inverse, for an op's results."""
    if seq_axis == 0:
        return tree
    return jax.tree.map(lambda a: jax.numpy.moveaxis(a, 0, seq_axis), tree)


def as_rank_block(x: Any, seq_axis: int) -> Any:
    """A rank's shard ``x [*lead, m, ..., k]`` (split on ``seq_axis``) as the custom calls'
    ``[rows, *batch, k]`` with one row: ``[1, *lead, m, ..., k]``, free (no data moves).

    The calls move a rank's whole shard as one block, so a batch-major shard needs no
    reordering: gathered, the blocks come out rank-major, ``[tp, *lead, m, ..., n]``
    (:func:`from_rank_blocks` puts them in sequence order). Ops whose gathered rows only
    meet row-wise math before they are scattered again (the MLPs) keep them rank-major
    and move no rows at all, where moving the sequence dim to the front would copy every
    operand and result of each call and of its gradient."""
    return x if seq_axis == 0 else x.reshape(1, *x.shape)


def from_rank_blocks(tree: Any, seq_axis: int) -> Any:
    """Every array of ``tree``, gathered rank blocks ``[tp, *lead, m, ..., n]`` (see
    :func:`as_rank_block`), in sequence order: ``[*lead, tp * m, ..., n]``. Moves the rows
    once."""
    if seq_axis == 0:
        return tree

    def in_order(y):
        size, m = y.shape[0], y.shape[seq_axis + 1]
        y = jax.numpy.moveaxis(y, 0, seq_axis)  # [*lead, size, m, ..., n]
        return y.reshape(*y.shape[:seq_axis], size * m, *y.shape[seq_axis + 2 :])

    return jax.tree.map(in_order, tree)


def to_rank_blocks(x: Any, seq_axis: int, size: int) -> Any:
    """``x [*lead, size * m, ..., k]`` (the whole sequence on ``seq_axis``) as the rank
    blocks a reduce-scatter hands out, rank-major: ``[size, *lead, m, ..., k]``. Moves the
    rows once; the scattered result is then one block, ``[1, *lead, m, ..., n]``."""
    if seq_axis == 0:
        return x
    shape = x.shape
    x = x.reshape(*shape[:seq_axis], size, shape[seq_axis] // size, *shape[seq_axis + 1 :])
    return jax.numpy.moveaxis(x, seq_axis, 0)


def from_rank_block(y: Any, seq_axis: int) -> Any:
    """:func:`as_rank_block`'s inverse: ``[1, *lead, m, ..., n]`` -> ``[*lead, m, ..., n]``."""
    return y if seq_axis == 0 else y.reshape(y.shape[1:])


def seq_spec(ndim: int, axis_name: str, seq_axis: int = 0) -> P:
    """An ``ndim``-dim activation split over ``axis_name`` on its sequence dim."""
    return P(*([None] * seq_axis), axis_name, *([None] * (ndim - seq_axis - 1)))


# --- global arrays (case 3) -----------------------------------------------------------


def find_mesh(axis_name: str, *arrays: Any, given: Any = None) -> Any:
    """The mesh a call on global arrays runs over, or None where none is known: the one set
    by ``jax.set_mesh``/``use_mesh``; else ``given`` (a layer's own); else that of the
    concrete, eagerly passed arrays; else the one the traced arrays' types carry, where it
    has ``axis_name`` (arrays sharded over a mesh, jitted with none set: an
    ``AbstractMesh``, whose devices the calls' lowering takes from the program, see
    ``device_probe``). ``arrays``: arrays or trees of them; a function returning such a
    tree is called only where no mesh is set or given (a layer's params)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    if given is not None:
        return given
    leaves = jax.tree.leaves([a() if isinstance(a, FunctionType) else a for a in arrays])
    for a in leaves:
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(a, jax.core.Tracer):
            return sharding.mesh
    for a in leaves:
        try:
            typed = jax.typeof(a).sharding.mesh
        except (AttributeError, TypeError):
            continue
        if not typed.empty and axis_name in typed.axis_names:
            return typed
    return None


def context_mesh(op: str, axis_name: str, *arrays: Any) -> Any:
    """The mesh an op's call on global arrays runs over (:func:`find_mesh`); a ValueError if
    there is none or it lacks ``axis_name``."""
    mesh = find_mesh(axis_name, *arrays)
    if mesh is None:
        raise ValueError(
            f"{op}: axis {axis_name!r} is not bound; call {op} inside jax.shard_map over a "
            "mesh that has this axis (like lax.all_gather), or on global arrays under "
            "`with jax.set_mesh(mesh):`"
        )
    checks.check_axis_in_mesh(op, axis_name, mesh)
    return mesh


def check_global_layout(op: str, mesh: Any, named: dict[str, tuple[Any, P]]) -> None:
    """Each array must be split over the op's axis exactly where ``named``'s spec says.

    Checked where the layout is known: arrays whose type carries their sharding
    (``Explicit`` axes) and concrete arrays. Other axes are not the op's business. Under
    ``Auto`` axes inside ``jit``, XLA moves the operands into the expected layout.
    """
    manual_axis = _the_axis(named)
    for what, (a, expected) in named.items():
        actual = _known_spec(a)
        if actual is None:
            continue
        ndim = len(a.shape)
        got = tuple(
            manual_axis in spec_axes(actual[d] if d < len(actual) else None) for d in range(ndim)
        )
        want = tuple(
            manual_axis in spec_axes(expected[d] if d < len(expected) else None)
            for d in range(ndim)
        )
        if got != want:
            raise ValueError(
                f"{op}: {what} of shape {tuple(a.shape)} must be sharded "
                f"{_spec_over(expected, manual_axis, ndim)} over axis {manual_axis!r}, but it "
                f"is sharded {actual} (mesh axes {tuple(mesh.axis_names)})"
            )


def _the_axis(named: dict[str, tuple[Any, P]]) -> str:
    for _, spec in named.values():
        for entry in spec:
            if spec_axes(entry):
                return spec_axes(entry)[0]
    raise AssertionError("no axis in the expected specs")


def _spec_over(spec: P, axis: str, ndim: int) -> P:
    return P(
        *[
            (axis if axis in spec_axes(spec[d] if d < len(spec) else None) else None)
            for d in range(ndim)
        ]
    )


def _known_spec(a: Any) -> P | None:
    if isinstance(a, jax.core.Tracer):
        return typed_spec(a)
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    return sharding.spec


def typed_spec(a: Any) -> P | None:
    """The spec an array's type carries under ``Explicit`` mesh axes, else None."""
    if not hasattr(a, "shape"):
        return None
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()  # an unsharded array: replicated on it
    if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, P) else P()


def replace_axis(actual: P, wanted: P, axis: str, ndim: int) -> P:
    """``actual`` with ``axis`` moved to where ``wanted`` has it; other axes kept."""
    entries = []
    for d in range(ndim):
        names = [a for a in spec_axes(actual[d] if d < len(actual) else None) if a != axis]
        if axis in spec_axes(wanted[d] if d < len(wanted) else None):
            names = [axis, *names]
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return P(*entries)


def row_dims(leading: int, fp8: bool) -> int:
    """:func:`global_call`'s ``row_dims`` for a projection whose input has ``leading`` dims
    before its contracted ones: all of them are rows it computes independently, except in
    fp8, whose amaxes are the whole batch's (its rows stay whole over the other axes)."""
    return 0 if fp8 else leading


def global_call(
    f: Callable,
    mesh: Any,
    axis_name: str,
    in_specs: tuple,
    out_specs: Any,
    check_vma: bool = True,
    row_dims: int = 0,
    widening: Widening = INPUTS_DTYPE,
) -> Callable:
    """``f`` (a computation on local shards) as a function of global arrays laid out on
    ``mesh``: the one way the ops and the Flax layers run on global arrays (case 3), in a
    shard_map over ``axis_name`` (other axes XLA's, unless ``row_dims`` splits over them).

    - Under ``Explicit`` axes shard_map takes inputs only already split as its ``in_specs``
      say: each array's split over ``axis_name`` is moved there, its other axes kept (the
      ops check the layout first, so theirs stay as they are).
    - ``check_vma=False`` where ``f`` nests a shard_map over the other axes (JAX cannot
      differentiate a nested unchecked shard_map inside a checked one). A size-1 axis
      stays automatic in JAX, where XLA refuses the psum that would type a replicated
      output as such: nothing to check over a group of one, so ``check_vma`` applies to
      larger groups only.
    - ``row_dims``: the first arg's and every output's leading dims that are rows ``f``
      computes independently (a projection's; not attention's, which mixes the sequence).
      With other mesh axes, all ``Auto``, the shard_map is then manual over every axis,
      those axes splitting a row dim of the first arg and the outputs that none of the
      specs splits (the first such dim they divide), as data parallelism splits a batch:
      no op inside needs lowering's nested shard_map over them (XLA's Shardy export drops
      the outer manual axes of the 24th, 48th, ... such nested call: RELIABILITY's gap 14).
    - On a mesh found from the arrays' types (an ``AbstractMesh``, none set), the first
      arg is marked for the calls' lowering to find the program's devices (device_probe).
    - On CPU devices, where the shard_map leaves other mesh axes automatic, ``widening``
      (:mod:`cpu_16bit`) keeps XLA from aborting on a 16-bit all-reduce: the ops' own
      calls take their inputs' dtypes; a Flax layer's says its compute dtype and recipe.
    """
    check_vma = check_vma and int(mesh.shape[axis_name]) > 1
    kwargs: dict[str, Any] = {}
    if not mesh.empty and jax.sharding.get_abstract_mesh().empty:
        # An eager call on concrete arrays, or a mesh found from the arrays' types
        # (abstract): no mesh in context.
        kwargs["mesh"] = mesh
    platform = mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else None

    def call(*args):
        if not isinstance(mesh, Mesh) and jax.sharding.get_abstract_mesh().empty:
            # A mesh found from the arrays' types: its devices at lowering.
            args = (device_probe.probe(args[0]), *args[1:])
        args = _moved_to_specs(axis_name, in_specs, args)
        body, checked = f, check_vma
        axis_names, specs_in, specs_out = {axis_name}, in_specs, out_specs
        split = _rows_over_other_axes(mesh, axis_name, in_specs, out_specs, args, row_dims)
        if split is not None:
            specs_in, specs_out = split
            axis_names = set(mesh.axis_names)
        partly_manual = len(axis_names) < len(mesh.axis_names)
        widened = partly_manual and widening.apply(f, args, in_specs, axis_name, platform)
        if widened:
            (body, args), checked = widened, False
        mapped = jax.shard_map(
            body,
            in_specs=specs_in,
            out_specs=specs_out,
            axis_names=axis_names,
            check_vma=checked,
            **kwargs,
        )
        # JAX runs an unchecked, partly manual shard_map only traced (eagerly it refuses
        # out_specs over the automatic axes): the widened call is jitted, at once where a
        # caller jits it already.
        return (jax.jit(mapped) if widened else mapped)(*args)

    return call


def _rows_over_other_axes(
    mesh: Any, axis_name: str, in_specs: tuple, out_specs: Any, args: tuple, row_dims: int
) -> tuple | None:
    """``(in_specs, out_specs)`` with the mesh's other axes splitting a row dim of the first
    arg and of every output (:func:`global_call`'s ``row_dims``), or None where that does
    not apply: no row dims, no other axes, an ``Explicit`` one, or no row dim that no spec
    splits and that the other axes divide."""
    others = [a for a in mesh.axis_names if a != axis_name]
    if row_dims <= 0 or not others:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(types[a] != AxisType.Auto for a in others):
        return None
    split = tuple(a for a in others if int(mesh.shape[a]) > 1)
    if not split:  # other axes of size 1: manual, nothing to split
        return in_specs, out_specs
    size = int(np.prod([int(mesh.shape[a]) for a in split]))
    outs = jax.tree.leaves(out_specs, is_leaf=is_spec)
    x_spec, x = in_specs[0], args[0]

    def free(spec: Any, d: int) -> bool:
        return spec is None or d >= len(spec) or spec[d] is None

    rows = [d for d in range(row_dims) if x.shape[d] % size == 0]
    d = next((d for d in rows if free(x_spec, d) and all(free(s, d) for s in outs)), None)
    if d is None:
        return None
    entry = split[0] if len(split) == 1 else split

    def with_rows(spec: Any) -> P:
        entries = list(spec or ()) + [None] * max(0, d + 1 - len(spec or ()))
        entries[d] = entry
        return P(*entries)

    return (with_rows(x_spec), *in_specs[1:]), jax.tree.map(with_rows, out_specs, is_leaf=is_spec)


def _moved_to_specs(axis_name: str, in_specs: Any, args: tuple) -> tuple:
    """Each array of ``args`` whose type carries its sharding, with its split over
    ``axis_name`` moved to where ``in_specs`` has it. Arrays whose type carries no sharding
    (``Auto`` axes) pass as they are: XLA moves them."""

    def move(spec, a):
        actual = typed_spec(a)
        if spec is None or actual is None:
            return a
        target = replace_axis(actual, spec, axis_name, a.ndim)
        return a if target == actual else jax.sharding.reshard(a, target)

    return tuple(jax.tree.map(move, in_specs, args, is_leaf=is_spec))
