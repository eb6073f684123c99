"""JAX primitives that lower to the userbuffer FFI custom calls.

Operands are ``x [rows, *batch, k]``, ``w [k, n]``, ``scales`` (``wire_format.pack_scales``: the
scales multiplying the product when x and w are fp8; ones otherwise); for the all-gather,
the epilogue's ``bias`` (``[n]``, or ``[0]`` for none) and ``gelu_input`` (DGELU's, laid out as
the output, or ``[0, ..., n]`` for none); for the reduce-scatter, ``gather_src`` (laid out as
its output, or ``[0, ..., n]`` for none), all-gathered beside it. The custom call sees ``x`` and
the outputs flattened to 2-D (a free reshape of the local buffer). Lowering is where
the concrete mesh is known, so that is where the communicator is looked up or created and its id
baked into the custom call.

Partial-auto shard_map (the op's axis manual, other mesh axes left to XLA): XLA's SPMD
partitioner refuses to partition a side-effecting custom call over the automatic axes
("Side-effect ops cannot be replicated"). So lowering wraps the call in a nested
shard_map that makes the remaining axes manual too; its in/out specs keep the batch dims
sharded over them (see ``layout.batch_spec``), so each device runs the call on its own
batch shard and nothing is gathered over data-parallel axes.

Why every device of a group runs the same calls: the custom call is marked as having a
side effect, so XLA neither CSEs two identical calls nor drops one whose result is
unused; and every device runs the same SPMD program. The nested shard_map changes
neither. Their order is the data's where one consumes another's result. Calls with no data
path between them run in program order on a GPU (one stream); on CPU devices XLA's runtime
starts them as their inputs become ready, in an order that may differ between devices, so
each CPU call carries a key, its site (``call_site.call_site``) and the number of its copy where XLA
copied it (src/bindings/ffi_cpu.h), and the ranks of a group run their calls in the order
the group's rank 0 runs them, matched by key (src/host/ordered_runner.h).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import batching, mlir
from jax.interpreters.mlir import SPMDAxisContext
from jax.sharding import AxisType, Mesh, use_abstract_mesh
from jax.sharding import PartitionSpec as P

from jax_ub._src import jax_compat
from jax_ub._src.lowering import layout
from jax_ub._src.lowering.call_site import call_site
from jax_ub._src.lowering.reference import (
    all_gather_matmul_reference,
    all_gather_rows,
    dgelu_reference,
    matmul_reduce_scatter_reference,
)
from jax_ub._src.lowering.varying import result_aval
from jax_ub._src.lowering.wire_format import unit_scales
from jax_ub._src.runtime import communicator, extension

all_gather_matmul_p = Primitive("jax_ub_all_gather_matmul")
all_gather_matmul_p.multiple_results = True
matmul_reduce_scatter_p = Primitive("jax_ub_matmul_reduce_scatter")
matmul_reduce_scatter_p.multiple_results = True
# The operands laid out like x's batch dims (which a nested shard_map keeps split over the
# mesh's automatic axes): x, the all-gather's gelu_input and the reduce-scatter's
# gather_src (laid out as their outputs). The weight, scales and bias are replicated over
# those axes.
_BATCHED = {all_gather_matmul_p: (0, 4), matmul_reduce_scatter_p: (0, 3)}


def _columns(w, transpose_w: bool) -> int:
    """n of a weight that is [k, n], or [n, k] when passed transposed."""
    return w.shape[0] if transpose_w else w.shape[1]


def _all_gather_matmul_abstract(
    x,
    w,
    scales,
    bias,
    gelu_input,
    *,
    axis_name,
    axis_size,
    return_gathered,
    transpose_w,
    out_dtype,
    fallback,
    gelu,
    keep_pre_gelu,
    dgelu,
):
    m, batch, k = x.shape[0], x.shape[1:-1], x.shape[-1]
    n = _columns(w, transpose_w)
    out = result_aval(x, (axis_size * m, *batch, n), x, w, bias).update(dtype=jnp.dtype(out_dtype))
    gathered = result_aval(x, (axis_size * m if return_gathered else 0, *batch, k), x)
    pre_gelu = out.update(shape=(axis_size * m if keep_pre_gelu else 0, *batch, n))
    return out, gathered, pre_gelu


def _matmul_reduce_scatter_abstract(
    x, w, scales, gather_src, *, axis_name, axis_size, transpose_w, out_dtype, fallback
):
    shape = (x.shape[0] // axis_size, *x.shape[1:-1], _columns(w, transpose_w))
    out = result_aval(x, shape, x, w, extra=frozenset([axis_name]))
    gathered = result_aval(gather_src, (axis_size * gather_src.shape[0], *shape[1:]), gather_src)
    return out.update(dtype=jnp.dtype(out_dtype)), gathered.update(dtype=jnp.dtype(out_dtype))


all_gather_matmul_p.def_abstract_eval(_all_gather_matmul_abstract)
matmul_reduce_scatter_p.def_abstract_eval(_matmul_reduce_scatter_abstract)


def _mesh_and_manual_axes(ctx: mlir.LoweringRuleContext, axis_name: str):
    """The concrete mesh being lowered for, and which of its axes are manual here."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        raise ValueError(
            "jax_ub impl='ub' runs over a mesh axis: call the op inside jax.shard_map, or "
            "on global arrays under jax.set_mesh (or use impl='xla')"
        )
    mesh = axis_ctx.mesh
    if not isinstance(mesh, Mesh):
        # shard_map without mesh= under jax.set_mesh: the concrete mesh is the context's.
        mesh = jax_compat.concrete_mesh()
    if not isinstance(mesh, Mesh) or mesh.empty:
        raise ValueError(
            "jax_ub impl='ub' needs the concrete mesh at lowering time: pass "
            "mesh=<a jax.sharding.Mesh> to jax.shard_map or call under jax.set_mesh(mesh) "
            "(or use impl='xla')"
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not in the mesh; {mesh.axis_names=}")
    return mesh, jax_compat.manual_axes(axis_ctx)


def _platform(ctx: mlir.LoweringRuleContext) -> str:
    platforms = ctx.module_context.platforms
    if len(platforms) != 1:
        raise ValueError(f"jax_ub lowers for one platform at a time, got {platforms=}")
    return platforms[0]


def _weight(w, transpose_w: bool):
    return w.T if transpose_w else w


def _lower_nested(prim, ctx, mesh: Mesh, manual: frozenset, *operands, **params):
    """Lower `prim` inside a shard_map over the mesh axes that are still automatic here.

    Each device then runs the custom call on its own shard of the batch dims, which keep
    their sharding over those axes (``layout.batch_spec``); the weight is replicated over
    them (XLA gathers an fsdp-sharded weight, as it would for a plain dot).

    No empty array (an absent bias or GELU input, an unrequested result) crosses the
    shard_map: empty operands are made inside it and empty results outside. XLA's GPU
    compiler replaces empty values with constants before Shardy partitions the module,
    which leaves the manual computation with unused inputs, and Shardy's pass that drops
    them then crashes the process (jaxlib 0.11.2; tests/test_gpu_layouts.py has the
    reproducer).
    """
    auto = tuple(a for a in mesh.axis_names if a not in manual)
    spec = layout.batch_spec(ctx.avals_in[0], mesh, auto)
    types = {a: AxisType.Manual for a in manual}
    abstract = mesh.abstract_mesh.update_axis_types(types) if types else mesh.abstract_mesh
    in_specs = [spec if i in _BATCHED[prim] else P() for i in range(len(ctx.avals_in))]
    empty_in = [_is_empty(a) for a in ctx.avals_in]
    avals_out = ctx.avals_out if prim.multiple_results else [ctx.avals_out[0]]
    kept_out = [i for i, a in enumerate(avals_out) if not _is_empty(a)]

    def body(*passed):
        it = iter(passed)
        args = [
            jnp.zeros(layout.local_shape(a.shape, s, mesh), a.dtype) if e else next(it)
            for a, s, e in zip(ctx.avals_in, in_specs, empty_in)
        ]
        outs = prim.bind(*args, **params)
        outs = outs if prim.multiple_results else [outs]
        return [outs[i] for i in kept_out]

    def nested(*operands):
        outs = jax.shard_map(
            body,
            mesh=abstract,
            in_specs=tuple(s for s, e in zip(in_specs, empty_in) if not e),
            out_specs=[spec] * len(kept_out),
            axis_names=frozenset(auto),
            check_vma=False,
        )(*(o for o, e in zip(operands, empty_in) if not e))
        full = [jnp.zeros(a.shape, a.dtype) for a in avals_out]
        for i, o in zip(kept_out, outs):
            full[i] = o
        return full if prim.multiple_results else full[0]

    # The nested shard_map is traced against the partly manual mesh of this context and
    # lowered for its concrete devices.
    with (
        use_abstract_mesh(abstract),
        jax_compat.use_concrete_mesh(mesh),
        jax_compat.enclosing_manual_axes(manual),
    ):
        return mlir.lower_fun(nested, multiple_results=prim.multiple_results)(ctx, *operands)


def _is_empty(aval) -> bool:
    return 0 in aval.shape


def _flat(aval: ShapedArray) -> ShapedArray:
    """[rows, *batch, cols] -> [rows * prod(batch), cols]: what the custom call sees."""
    return aval.update(shape=(int(np.prod(aval.shape[:-1])), aval.shape[-1]))


def _ffi_call_flat(ctx, target: str, x, *operands, comm_id: int, **attrs):
    """The custom call on x flattened to 2-D; results reshaped back to their avals.

    Its operands pass an optimization barrier first. Where one is a slice of a larger
    array (a layer's weight in a scan's stacked params, a residual saved by the scan),
    XLA's GPU compiler would otherwise move the call into a "dynamic-slice fusion" that
    reads the slice in place; for a call with several results (the all-gather's) it keeps
    the original call too, which cannot be removed because it has a side effect, so the
    op ran twice (jaxlib 0.11.2: every all-gather of a scanned Llama's forward, +10% of its
    step). The barrier (expanded only after that pass) keeps the slice a plain operand.
    The results pass one too: where a result is written into a larger array (a residual a
    rolled scan stacks over its iterations), the same pass would move a copy of the call
    into a fusion that writes its slice in place, keeping the original for the result's
    other users (a rolled scan's forward ran three of its four calls twice, +13% of its
    step)."""
    x_aval, *others = ctx.avals_in
    flat_outs = [_flat(a) for a in ctx.avals_out]
    x, *operands = hlo.OptimizationBarrierOp([x, *operands]).results
    x2 = jax_compat.reshape(ctx, x, _flat(x_aval))
    flat_ctx = ctx.replace(avals_in=[_flat(x_aval), *others], avals_out=flat_outs)
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True)
    outs = rule(flat_ctx, x2, *operands, comm_id=np.int64(comm_id), **attrs)
    outs = hlo.OptimizationBarrierOp(outs).results
    return [jax_compat.reshape(ctx, o, a) for o, a in zip(outs, ctx.avals_out)]


def _lowering(
    prim: Primitive,
    op: str,
    chunk_aval: Callable,
    unfused: Callable,
    attrs: tuple = (),
    also_gathers: Callable = lambda ctx: False,
):
    """The lowering rule of `prim`: nested in a shard_map where mesh axes are still
    automatic (see the module docstring); else the custom call on the communicator for
    the mesh, or `unfused` (XLA's collectives) where impl="auto" finds the group's devices
    cannot share memory. `chunk_aval(ctx)` is one rank's chunk and `also_gathers(ctx)`
    whether the call all-gathers a second input beside it, which together size the buffer;
    `attrs` names the params the custom call gets besides comm_id and transpose_w."""

    def rule(ctx, *operands, **params):
        axis_name = params["axis_name"]
        mesh, manual = _mesh_and_manual_axes(ctx, axis_name)
        if set(mesh.axis_names) - manual:
            return _lower_nested(prim, ctx, mesh, manual, *operands, **params)
        platform = _platform(ctx)
        aval = chunk_aval(ctx)
        chunk = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        needed = communicator.required_bytes(
            platform, op, chunk, params["axis_size"], also_gathers(ctx)
        )
        comm = communicator.for_lowering(op, mesh, axis_name, platform, needed, params["fallback"])
        if comm is None:
            lower = mlir.lower_fun(
                functools.partial(unfused, **params), multiple_results=prim.multiple_results
            )
            return lower(ctx, *operands)
        extra = {name: bool(params[name]) for name in ("transpose_w", *attrs)}
        if platform == "cpu":
            extension.register_cpu_handlers()
            extra["site"] = np.int64(call_site(ctx, op))
        return _ffi_call_flat(ctx, f"jax_ub_{op}", *operands, comm_id=comm.id, **extra)

    return rule


def _all_gather_matmul_unfused(
    x,
    w,
    scales,
    bias,
    gelu_input,
    *,
    axis_name,
    transpose_w,
    return_gathered,
    out_dtype,
    gelu,
    keep_pre_gelu,
    dgelu,
    **_,
):
    out, gathered, pre_gelu = all_gather_matmul_reference(
        x,
        _weight(w, transpose_w),
        axis_name,
        return_gathered=True,
        scales=scales,
        out_dtype=out_dtype,
        bias=bias if bias.shape[0] else None,
        activation="gelu" if gelu else None,
        return_pre_activation=True,
    )
    if dgelu:
        out = dgelu_reference(out, gelu_input)
    return (
        out,
        gathered if return_gathered else gathered[:0],
        pre_gelu if keep_pre_gelu else pre_gelu[:0],
    )


def _matmul_reduce_scatter_unfused(
    x, w, scales, gather_src, *, axis_name, axis_size, transpose_w, out_dtype, **_
):
    out = matmul_reduce_scatter_reference(
        x, _weight(w, transpose_w), axis_name, scales=scales, out_dtype=out_dtype
    )
    if _is_empty(gather_src):
        return out, jnp.zeros(gather_src.shape, out.dtype)
    return out, all_gather_rows(gather_src, axis_name).astype(out.dtype)


jax_compat.register_uncached_lowering(
    all_gather_matmul_p,
    _lowering(
        all_gather_matmul_p,
        "all_gather_matmul",
        lambda ctx: ctx.avals_in[0],  # x
        _all_gather_matmul_unfused,
        attrs=("gelu", "dgelu"),
    ),
)
jax_compat.register_uncached_lowering(
    matmul_reduce_scatter_p,
    _lowering(
        matmul_reduce_scatter_p,
        "matmul_reduce_scatter",
        lambda ctx: ctx.avals_out[0],  # the output block
        _matmul_reduce_scatter_unfused,
        also_gathers=lambda ctx: not _is_empty(ctx.avals_in[3]),  # gather_src
    ),
)


# Spelled `not_mapped` in older JAX; None in newer.
_NOT_MAPPED = getattr(batching, "not_mapped", None)


def _batched(prim, args, dims, **params):
    """vmap by calling the op once per batch element: every rank loops over the same batch,
    so the collective calls still pair up across the group."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    args = [
        jnp.broadcast_to(a, (size,) + a.shape) if d is _NOT_MAPPED else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    outs = [prim.bind(*(a[i] for a in args), **params) for i in range(size)]
    if prim.multiple_results:
        return [jnp.stack(o) for o in zip(*outs)], [0] * len(outs[0])
    return jnp.stack(outs), 0


batching.primitive_batchers[all_gather_matmul_p] = lambda args, dims, **kw: _batched(
    all_gather_matmul_p, args, dims, **kw
)
batching.primitive_batchers[matmul_reduce_scatter_p] = lambda args, dims, **kw: _batched(
    matmul_reduce_scatter_p, args, dims, **kw
)


def _scales_and_type(x, scales, out_dtype):
    """The scales operand (ones unless given) and the output dtype (x's unless given)."""
    if scales is None:
        scales = unit_scales()
    return scales, jnp.dtype(out_dtype if out_dtype is not None else x.dtype)


def bind_all_gather_matmul(
    x,
    w,
    axis_name: str,
    axis_size: int,
    *,
    return_gathered: bool,
    transpose_w: bool = False,
    fallback: bool = False,
    scales=None,
    out_dtype=None,
    bias=None,
    gelu: bool = False,
    keep_pre_gelu: bool = False,
    gelu_input=None,
):
    """x [m, *b, k], w [k, n] -> (y, all_gather(x) or an empty [0, *b, k], the pre-GELU
    product or an empty [0, *b, n]), y = gelu?(all_gather(x) @ w + bias?).

    With ``transpose_w``, ``w`` is passed as its transpose [n, k] and read in place (the
    backward passes multiply by ``w.T`` without materialising it). With ``fallback``
    (impl="auto"), a group whose devices cannot share memory lowers to XLA's collectives.
    fp8 ``x`` and ``w`` (``w`` transposed) come with ``scales`` (``wire_format.pack_scales``) and an
    ``out_dtype``: the product is ``x_scale * w_scale * (x @ w)``. The epilogue (``bias``
    ``[n]`` of the output's dtype, ``gelu``) runs in the GEMMs; ``keep_pre_gelu`` (with
    ``gelu``) also returns GELU's input, for the backward. With ``gelu_input`` (GELU's input,
    laid out as y; no other epilogue) instead, y = (all_gather(x) @ w) * gelu'(gelu_input):
    GELU's backward in the epilogue (cuBLASLt's DGELU).
    """
    scales, out_dtype = _scales_and_type(x, scales, out_dtype)
    if bias is None:
        bias = jnp.zeros((0,), out_dtype)
    dgelu = gelu_input is not None
    if not dgelu:
        gelu_input = jnp.zeros((0, *x.shape[1:-1], _columns(w, transpose_w)), out_dtype)
    return all_gather_matmul_p.bind(
        x,
        w,
        scales,
        bias,
        gelu_input,
        axis_name=axis_name,
        axis_size=axis_size,
        return_gathered=return_gathered,
        transpose_w=transpose_w,
        out_dtype=out_dtype,
        fallback=fallback,
        gelu=bool(gelu),
        keep_pre_gelu=bool(keep_pre_gelu and gelu),
        dgelu=dgelu,
    )


def bind_matmul_reduce_scatter(
    x,
    w,
    axis_name: str,
    axis_size: int,
    *,
    transpose_w: bool = False,
    fallback: bool = False,
    scales=None,
    out_dtype=None,
    gather=None,
):
    """x [M, *b, k], w [k, n] -> psum_scatter(x @ w) of shape [M / axis_size, *b, n]; with
    ``gather`` (laid out and typed as that result), ``(psum_scatter(x @ w),
    all_gather(gather))``, the gather moving on the copy engines beside the GEMMs.

    With ``transpose_w``, ``w`` is passed as its transpose [n, k] and read in place; with
    ``fallback``, ``scales`` and ``out_dtype`` as for :func:`bind_all_gather_matmul`.
    """
    scales, out_dtype = _scales_and_type(x, scales, out_dtype)
    shape = (x.shape[0] // axis_size, *x.shape[1:-1], _columns(w, transpose_w))
    if gather is None:
        gather_src = jnp.zeros((0, *shape[1:]), out_dtype)
    elif gather.shape != shape or gather.dtype != out_dtype:
        raise ValueError(
            f"matmul_reduce_scatter: the array to all-gather beside it must be laid out as its "
            f"result, {shape} of {out_dtype}; got {gather.shape=} of {gather.dtype}"
        )
    else:
        gather_src = gather
    out, gathered = matmul_reduce_scatter_p.bind(
        x,
        w,
        scales,
        gather_src,
        axis_name=axis_name,
        axis_size=axis_size,
        transpose_w=transpose_w,
        out_dtype=out_dtype,
        fallback=fallback,
    )
    return out if gather is None else (out, gathered)
