"""How the primitives (``primitives.py``) become the userbuffer FFI custom calls.

Lowering is where the concrete mesh is known, so that is where the communicator is looked
up or created and its id baked into the custom call. The custom call sees ``x`` and the
outputs flattened to 2-D (a free reshape of the local buffer).

Partial-auto shard_map (the op's axis manual, other mesh axes left to XLA): XLA's SPMD
partitioner refuses to partition a side-effecting custom call over the automatic axes
("Side-effect ops cannot be replicated"). So lowering wraps the call in a nested
shard_map that makes the remaining axes manual too; its in/out specs keep the batch dims
sharded over them (see ``batch_layout.batch_spec``), so each device runs the call on its own
batch shard and nothing is gathered over data-parallel axes.

Why every device of a group runs the same calls: the custom call is marked as having a
side effect, so XLA neither CSEs two identical calls nor drops one whose result is
unused; and every device runs the same SPMD program. The nested shard_map changes
neither. Their order is the data's where one consumes another's result. Calls with no data
path between them run in program order on a GPU (one stream); on CPU devices XLA's runtime
starts them as their inputs become ready, in an order that may differ between devices, so
each CPU call carries a key, its site (``call_site.call_site``) and the number of its copy
where XLA copied it (src/bindings/ffi_cpu.h), and the ranks of a group run their calls in
the order the group's rank 0 runs them, matched by key (src/host/ordered_runner.h).
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
from jax.interpreters import mlir
from jax.interpreters.mlir import SPMDAxisContext
from jax.sharding import AxisType, Mesh, use_abstract_mesh
from jax.sharding import PartitionSpec as P

from jax_ub._src import jax_compat
from jax_ub._src.lowering import batch_layout, device_probe
from jax_ub._src.lowering.call_site import call_site
from jax_ub._src.runtime import communicator, extension
from jax_ub._src.settings import checks

# The axis of a group of one on every device, which no mesh has: the calls of impl="none"
# on jax_ub's GEMMs (config.bound_gemms), lowered on the mesh with this axis added last.
SOLO_AXIS = "jax_ub_solo"


def _solo_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with a last axis of size one, :data:`SOLO_AXIS`: each device a group."""
    return Mesh(mesh.devices[..., np.newaxis], (*mesh.axis_names, SOLO_AXIS))


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
        abstract = mesh
        # shard_map without mesh= under jax.set_mesh: the concrete mesh is the context's;
        # with no mesh set, the devices the program is compiled for (device_probe).
        mesh = jax_compat.concrete_mesh()
        if not isinstance(mesh, Mesh) or mesh.empty:
            mesh = device_probe.concrete_mesh(ctx, abstract)
    if not isinstance(mesh, Mesh) or mesh.empty:
        raise ValueError(
            "jax_ub's userbuffer path needs the concrete mesh at lowering time, which only "
            "an abstract one stands for here: call under jax.set_mesh(mesh) (inside a "
            "shard_map over other axes, the mesh= it was given does not reach the op), or "
            "pass mesh=<a jax.sharding.Mesh> to the jax.shard_map over the op's axis (or "
            "use impl='xla')"
        )
    if axis_name != SOLO_AXIS:
        checks.check_axis_in_mesh("", axis_name, mesh)
    return mesh, jax_compat.manual_axes(axis_ctx)


def _platform(ctx: mlir.LoweringRuleContext) -> str:
    platforms = ctx.module_context.platforms
    if len(platforms) != 1:
        raise ValueError(f"jax_ub lowers for one platform at a time, got {platforms=}")
    return platforms[0]


def _lower_nested(prim, batched, ctx, mesh: Mesh, manual: frozenset, *operands, **params):
    """Lower `prim` inside a shard_map over the mesh axes that are still automatic here.

    Each device then runs the custom call on its own shard of the batch dims, which keep
    their sharding over those axes (``batch_layout.batch_spec``); the weight is replicated over
    them (XLA gathers an fsdp-sharded weight, as it would for a plain dot).

    No empty array (an absent bias or GELU input, an unrequested result) crosses the
    shard_map: empty operands are made inside it and empty results outside. XLA's GPU
    compiler replaces empty values with constants before Shardy partitions the module,
    which leaves the manual computation with unused inputs, and Shardy's pass that drops
    them then crashes the process (jaxlib 0.11.2; tests/test_gpu_layouts.py has the
    reproducer).
    """
    auto = tuple(a for a in mesh.axis_names if a not in manual)
    spec = batch_layout.batch_spec(ctx.avals_in[0], mesh, auto)
    types = {a: AxisType.Manual for a in manual}
    abstract = mesh.abstract_mesh.update_axis_types(types) if types else mesh.abstract_mesh
    in_specs = [spec if i in batched else P() for i in range(len(ctx.avals_in))]
    empty_in = [is_empty(a) for a in ctx.avals_in]
    avals_out = ctx.avals_out if prim.multiple_results else [ctx.avals_out[0]]
    kept_out = [i for i, a in enumerate(avals_out) if not is_empty(a)]

    def body(*passed):
        it = iter(passed)
        args = [
            jnp.zeros(batch_layout.local_shape(a.shape, s, mesh), a.dtype) if e else next(it)
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


def is_empty(aval) -> bool:
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


def lowering_rule(
    prim: Primitive,
    op: str,
    chunk_aval: Callable,
    unfused: Callable,
    batched: tuple[int, ...],
    attrs: tuple = (),
    also_gathers: Callable = lambda ctx: False,
):
    """The lowering rule of `prim`: nested in a shard_map where mesh axes are still
    automatic (see the module docstring); else the custom call on the communicator for
    the mesh, or `unfused` (XLA's collectives) where impl="auto" finds the group's devices
    cannot share memory. `chunk_aval(ctx)` is one rank's chunk and `also_gathers(ctx)`
    whether the call all-gathers a second input beside it, which with x's k size the buffer;
    `batched` are the operands laid out like x's batch dims, which a nested shard_map keeps
    split over the automatic axes; `attrs` names the params the custom call gets besides
    comm_id and transpose_w."""

    def unfused_rule(ctx, *operands, **params):
        lower = mlir.lower_fun(
            functools.partial(unfused, **params), multiple_results=prim.multiple_results
        )
        return lower(ctx, *operands)

    def rule(ctx, *operands, **params):
        if jax_compat.lowering_for_export(ctx):
            # An exported program runs in another process, on devices (and platforms) it
            # names then: it cannot carry this process's communicator. impl="auto" exports
            # XLA's collectives.
            if not params["fallback"]:
                raise ValueError(
                    f"{op}: impl='ub' cannot be exported (jax.export): its call runs on a "
                    "communicator of this process's devices, which an exported program cannot "
                    "carry; impl='auto' exports the same math on XLA's collectives"
                )
            return unfused_rule(ctx, *operands, **params)
        axis_name = params["axis_name"]
        mesh, manual = _mesh_and_manual_axes(ctx, axis_name)
        if set(mesh.axis_names) - manual:
            return _lower_nested(prim, batched, ctx, mesh, manual, *operands, **params)
        if axis_name == SOLO_AXIS:
            mesh = _solo_mesh(mesh)
        platform = _platform(ctx)
        aval = chunk_aval(ctx)
        chunk = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        rows = int(np.prod(aval.shape[:-1]))  # a rank's: its chunk's (x's or the output's)
        k = int(ctx.avals_in[0].shape[-1])  # x [..., k]
        needed = communicator.required_bytes(
            platform, op, chunk, params["axis_size"], also_gathers(ctx), rows, k
        )
        comm = communicator.for_lowering(op, mesh, axis_name, platform, needed, params["fallback"])
        if comm is None:
            return unfused_rule(ctx, *operands, **params)
        extra = {name: bool(params[name]) for name in ("transpose_w", *attrs)}
        if platform == "cpu":
            extension.register_cpu_handlers()
            site, lowering = call_site(ctx, op)
            extra["site"], extra["lowering"] = np.int64(site), np.int64(lowering)
        return _ffi_call_flat(ctx, f"jax_ub_{op}", *operands, comm_id=comm.id, **extra)

    return rule
