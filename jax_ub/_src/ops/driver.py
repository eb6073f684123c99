"""The one driver every public op runs through.

An op's front end checks its arguments once into a :class:`Call` and hands :func:`run`
its body: the op on one rank's rows, ``x [rows, *batch, k]`` whose rows (dim 0) are the
ones split over the axis. The driver does the rest, the same way for every op:

1. global arrays (no shard_map binds the axis) -> the layout checked, one shard_map
   (:func:`placement.global_call`);
2. the rank's shard -> the body's rows (a batch-major shard becomes one block of rows,
   without moving data where the op allows it);
3. the path of each GEMM the body runs, resolved once from the call's ``impl`` on those
   rows (the op's :data:`Route`, asking :func:`impl_choice.choose_path`), into the call
   record with the axis's size; the body reads them (``call.path``, ``call.group()``);
4. the body, then the result back in the caller's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jax_ub._src.ops import impl_choice, placement
from jax_ub._src.ops.cpu_16bit import INPUTS_DTYPE, Widening
from jax_ub._src.ops.group import Group, SoloGroup
from jax_ub._src.ops.layout import ALL_REDUCE, BLOCK, GATHER, SCATTER, Layout, Rows, Split
from jax_ub._src.ops.path import Path
from jax_ub._src.settings import checks
from jax_ub._src.settings.fp8 import compute_operands
from jax_ub._src.settings.options import traced_settings

# The ops' layouts (layout.py) are the front ends' to name: driver.GATHER, ...
__all__ = [
    "ALL_REDUCE",
    "BLOCK",
    "GATHER",
    "SCATTER",
    "Call",
    "Extra",
    "Layout",
    "over_axis",
    "run",
]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of an op, its arguments checked: what its body and the driver read.

    Attributes:
      op: the public op's name, for messages and the impl rule.
      layout: the op's :class:`Layout`.
      axis_name: the tensor-parallel mesh axis.
      impl: ``"auto"``, ``"ub"``, ``"xla"`` or ``"none"``.
      seq_axis: the caller's sequence dim of ``x``, normalised (``>= 0``).
      fp8: the call runs in fp8 (on global arrays the other mesh axes then stay XLA's:
        the amaxes are the whole batch's).
      divides: ``(what, size)`` of the other dims the axis must divide (w's split dim).
      shard_map_only: the arguments given that work only inside a shard_map (on global
        arrays the call raises, naming them).
      size: the axis's size, once bound (the body sees it set).
      paths: the path of each GEMM the body runs, in the order of the op's :data:`Route`,
        resolved by the driver (the body sees them set).
    """

    op: str
    layout: Layout
    axis_name: str
    impl: str
    seq_axis: int
    fp8: bool = False
    divides: tuple[tuple[str, int], ...] = ()
    shard_map_only: tuple[str, ...] = ()
    size: int | None = None
    paths: tuple[Path, ...] = ()

    @property
    def path(self) -> Path:
        """The path of the call's (first) GEMM."""
        return self.paths[0]

    def group(self) -> Group:
        """The collective of the call's (first) GEMM, on its path."""
        if self.path is Path.NONE_UB:
            return SoloGroup(self.axis_name, self.size, self.path)
        fallback = impl_choice.falls_back_at_lowering(self.impl)
        return Group(self.axis_name, self.size, self.path, fallback)

    def choose(self, x: Any, w: Any, fp8: Any = None, op: str | None = None) -> Path:
        """The path of the GEMM ``x @ w`` (the rank's operands; in fp8 with ``fp8``, its
        scales) that ``op`` (default: this call's) runs: :func:`impl_choice.choose_path`
        for this call's impl and group size. For routes only: the driver asks them once."""
        operands = (x, w) if fp8 is None else compute_operands(x, w)
        kw = dict(fp8=fp8 is not None, axis_size=self.size)
        return impl_choice.choose_path(op or self.op, self.impl, *operands, **kw)

    def on(self, op: str, layout: Layout, path: Path) -> Call:
        """This call's settings for another op run inside its body (an MLP's projections)
        on ``path`` (one of this call's), on rows already the body's (``seq_axis`` 0)."""
        return dataclasses.replace(
            self, op=op, layout=layout, seq_axis=0, divides=(), paths=(path,)
        )


class Extra(NamedTuple):
    """An op's operands besides ``x`` and ``w``: one record for every op, each field None
    where the op has none. Its body takes it as it is; on global arrays a record of
    specs says how each is laid out (:meth:`specs`).

    Attributes:
      bias: ``[n]`` (a block's up-projection's, ``[f]``).
      fp8: the op's :class:`Fp8Scales`, or a block's ``(up, down)`` pair.
      w_down: a block's down-projection ``[f, n]``.
      down_bias: a block's down-projection's bias ``[n]``.
    """

    bias: Any = None
    fp8: Any = None
    w_down: Any = None
    down_bias: Any = None

    @classmethod
    def specs(cls, **split: P) -> Extra:
        """The operands' specs on global arrays: replicated, but those ``split`` names."""
        return cls(*(P(),) * len(cls._fields))._replace(**split)


Body = Callable[[Call, Any, Any, Extra], Any]
# ``route(call, rows, w, extra)``: the path of each GEMM the body runs on these operands
# (``call.size`` set), in the body's order, each decided as its own op would decide it.
Route = Callable[[Call, Any, Any, Extra], tuple[Path, ...]]


def one_gemm(call: Call, x: Any, w: Any, extra: Extra) -> tuple[Path, ...]:
    """The :data:`Route` of an op whose body runs ``x @ w`` alone (in fp8 with
    ``extra.fp8``)."""
    return (call.choose(x, w, extra.fp8),)


def run(
    call: Call,
    body: Body,
    route: Route,
    x: Any,
    w: Any,
    extra: Extra,
    extra_spec: Extra | None = None,
) -> Any:
    """``body(call, rows, w, extra)`` on the rank's rows, from a call inside a shard_map
    binding ``call.axis_name`` or on global arrays, the paths ``route`` picks in the call;
    returns the result in the caller's layout. ``extra``: the op's other operands, laid
    out on global arrays as ``extra_spec`` says (all replicated by default)."""
    size = checks.bound_axis_size(call.op, call.axis_name)
    if size is None:
        return _on_global_arrays(call, body, route, x, w, extra, extra_spec)
    if call.axis_name not in jax.sharding.get_abstract_mesh().axis_names:
        # Bound, but by jax.vmap(axis_name=) or pmap: lax's collectives run over it, the
        # userbuffers only over a mesh's devices.
        if call.impl == "ub":
            raise ValueError(
                f"{call.op}: impl='ub' runs over a mesh axis (a shard_map's, or under "
                f"jax.set_mesh), but {call.axis_name!r} is bound by jax.vmap or jax.pmap "
                "here; impl='xla' or 'auto' runs lax's collectives over it"
            )
        call = dataclasses.replace(call, impl="xla")
    return _on_shards(dataclasses.replace(call, size=size), body, route, x, w, extra)


def _on_shards(call: Call, body: Body, route: Route, x: Any, w: Any, extra: Any) -> Any:
    s, size, rows = call.seq_axis, call.size, call.layout.rows
    if rows is Rows.SCATTER:
        what = "rows of x" if s == 0 else f"rows of x (dim {s})"
        checks.check_divisible(call.op, what, x.shape[s], size, call.axis_name, f"{x.shape=}")
    if s == 0 or rows is Rows.WHOLE:
        into_rows, back = (lambda x, s, size: x), (lambda y, s: y)
    else:
        into_rows, back = _ROWS[rows]
    x = into_rows(x, s, size)
    call = dataclasses.replace(call, paths=route(call, x, w, extra))
    return back(body(call, x, w, extra), s)


# Each Layout.rows: (a shard split on its dim s as the body's rows, the body's result back).
_ROWS = {
    Rows.GATHER: (lambda x, s, _: placement.as_rank_block(x, s), placement.from_rank_blocks),
    Rows.SCATTER: (placement.to_rank_blocks, placement.from_rank_block),
    Rows.KEEP: (lambda x, s, _: placement.as_rank_block(x, s), placement.from_rank_block),
}


def _on_global_arrays(
    call: Call, body: Body, route: Route, x: Any, w: Any, extra: Any, extra_spec: Any
) -> Any:
    """The op on global arrays: checked against the mesh in context (or the arrays'), then
    one shard_map that hands each rank its shards."""
    op, axis, s, layout = call.op, call.axis_name, call.seq_axis, call.layout
    mesh = placement.context_mesh(op, axis, x, w)
    if call.shard_map_only:
        names = " and ".join(call.shard_map_only)
        raise ValueError(
            f"{op}: {names} is for calls inside shard_map, not on global arrays "
            f"({x.shape=} {w.shape=})"
        )
    size = int(mesh.shape[axis])
    spec = {
        Split.ROWS: placement.seq_spec(x.ndim, axis, s),
        Split.FEATURES: P(*([None] * (x.ndim - 1)), axis),
        Split.REPLICATED: P(),
    }
    x_spec, out_spec = spec[layout.x], spec[layout.out]
    w_spec = P(*(axis if d == layout.w_dim % w.ndim else None for d in range(w.ndim)))
    divides = dict(call.divides)
    if layout.x is Split.FEATURES:
        divides = {"features of x (last dim)": x.shape[-1], **divides}
    if layout.x is Split.ROWS or layout.rows is Rows.SCATTER:
        divides = {f"rows of x (dim {s})": x.shape[s], **divides}
    shapes = f"{x.shape=} {w.shape=}"
    for what, value in divides.items():
        checks.check_divisible(op, what, value, size, axis, shapes)
    placement.check_global_layout(op, mesh, {"x": (x, x_spec), "w": (w, w_spec)})

    has_extra = bool(jax.tree.leaves(extra))  # else Extra(None, ...) passes as it is

    def local(x, w, more=None):
        bound = dataclasses.replace(call, size=int(jax.lax.axis_size(axis)))
        return _on_shards(bound, body, route, x, w, more if has_extra else extra)

    specs = (x_spec, w_spec)
    if has_extra:
        specs = (*specs, Extra.specs() if extra_spec is None else extra_spec)
    # [rows, *batch, k]: every dim but the features may carry the other axes' split.
    row_dims = placement.row_dims(x.ndim - 1, call.fp8)
    f = placement.global_call(local, mesh, axis, specs, out_spec, row_dims=row_dims)
    return f(x, w, extra) if has_extra else f(x, w)


def over_axis(
    owner: str,
    body: Callable,
    axis_name: str,
    in_specs: Any,
    out_specs: Any,
    *,
    mesh: Any = None,
    without_mesh: Callable | None = None,
    check_vma: bool = True,
    row_dims: int = 0,
    widening: Widening = INPUTS_DTYPE,
) -> Callable:
    """``body`` (a computation on the rank's shards, e.g. a Flax layer's ops) as a function
    callable as the ops are: inside a shard_map binding ``axis_name``, ``body`` itself, on
    the local shards; else on global arrays laid out as ``in_specs`` say, under the mesh
    :func:`placement.find_mesh` finds (``mesh``: the caller's own, where none is set), in a
    jit of :func:`placement.global_call` compiled once per mesh (and whether it is set) and
    per value of the settings read at trace time (an eager call compiles once per shape;
    under an outer jit it is inlined).

    Where no mesh is known, ``without_mesh`` (the same computation on global arrays, or
    what raises) runs instead; with None, the ops' ValueError."""
    mapped: dict[Any, Callable] = {}

    def call(*args: Any) -> Any:
        if axis_name in placement.manual_axes():
            return body(*args)
        found = placement.find_mesh(axis_name, *args, given=mesh)
        if found is None and without_mesh is not None:
            return without_mesh(*args)
        if found is None:
            found = placement.context_mesh(owner, axis_name)  # raises
        checks.check_axis_in_mesh(owner, axis_name, found)
        # A jit's trace keeps the settings it was traced with, and global_call binds the
        # mesh to its shard_map only where none is set (an abstract one equals the set one).
        key = found, jax.sharding.get_abstract_mesh().empty, traced_settings()
        if key not in mapped:
            kw = dict(row_dims=row_dims, widening=widening)
            run = placement.global_call(
                body, found, axis_name, in_specs, out_specs, check_vma, **kw
            )
            mapped[key] = jax.jit(run)
        return mapped[key](*args)

    return call
