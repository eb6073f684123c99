"""JAX primitives that lower to the userbuffer FFI custom calls.

Operands are 2-D here (the public ops flatten leading dims). Lowering is where the
concrete mesh is known, so that is where the communicator is looked up or created and
its id baked into the custom call.
"""

from __future__ import annotations

import jax
import jax._src.config
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.interpreters import batching, mlir
from jax._src.sharding_impls import SPMDAxisContext
from jax.sharding import Mesh

from jax_ub._src import communicator, extension
from jax_ub._src.reference import all_gather_matmul_reference, matmul_reduce_scatter_reference

all_gather_matmul_p = core.Primitive("jax_ub_all_gather_matmul")
all_gather_matmul_p.multiple_results = True
matmul_reduce_scatter_p = core.Primitive("jax_ub_matmul_reduce_scatter")


def _varying(aval: core.AbstractValue) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def _check_vma() -> bool:
    state = getattr(jax._src.config, "_check_vma", None)
    return bool(state.value) if state is not None else True


def match_varying(ct, like):
    """Cotangent `ct` cast to vary over exactly the mesh axes `like` varies over.

    Under shard_map(check_vma=True) the reference's autodiff sums a weight's gradient over
    the axes the weight is replicated on (the transpose of the implicit pvary); the custom
    VJPs do the same here. Without vma tracking there is nothing to match.
    """
    if not _check_vma():
        return ct
    have, want = _varying(jax.typeof(ct)), _varying(jax.typeof(like))
    if have - want:
        ct = jax.lax.psum(ct, tuple(sorted(have - want)))
    if want - have:
        ct = jax.lax.pcast(ct, tuple(sorted(want - have)), to="varying")
    return ct


def _result(x, shape, *operands, extra: frozenset = frozenset()):
    """x's aval with `shape`, varying over every mesh axis any operand varies over.

    Under shard_map(check_vma=True) that is what the lax reference would produce; the
    attribute holding it moved between JAX versions, hence the two spellings.
    """
    if not _check_vma():
        return x.update(shape=shape)
    varying = frozenset(extra).union(*(_varying(a) for a in operands))
    mat = getattr(x, "manual_axis_type", None)
    if mat is not None:
        return x.update(shape=shape, manual_axis_type=mat.update(varying=varying))
    if hasattr(x, "vma"):
        return x.update(shape=shape, vma=varying)
    return x.update(shape=shape)


def _columns(w, transpose_w: bool) -> int:
    """n of a weight that is [k, n], or [n, k] when passed transposed."""
    return w.shape[0] if transpose_w else w.shape[1]


def _all_gather_matmul_abstract(
    x, w, *, axis_name, axis_size, return_gathered, transpose_w, fallback
):
    m, k = x.shape
    out = _result(x, (axis_size * m, _columns(w, transpose_w)), x, w)
    gathered = _result(x, (axis_size * m, k) if return_gathered else (0, k), x)
    return out, gathered


def _matmul_reduce_scatter_abstract(x, w, *, axis_name, axis_size, transpose_w, fallback):
    shape = (x.shape[0] // axis_size, _columns(w, transpose_w))
    return _result(x, shape, x, w, extra=frozenset([axis_name]))


all_gather_matmul_p.def_abstract_eval(_all_gather_matmul_abstract)
matmul_reduce_scatter_p.def_abstract_eval(_matmul_reduce_scatter_abstract)


def _concrete_mesh(ctx: mlir.LoweringRuleContext, axis_name: str) -> Mesh:
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None) if isinstance(axis_ctx, SPMDAxisContext) else None
    if not isinstance(mesh, Mesh):
        raise ValueError(
            "jax_ub impl='ub' needs the concrete mesh at lowering time: call the op inside "
            "jax.shard_map(..., mesh=<a jax.sharding.Mesh>) (or use impl='xla')"
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not in the mesh; {mesh.axis_names=}")
    return mesh


def _platform(ctx: mlir.LoweringRuleContext) -> str:
    platforms = ctx.module_context.platforms
    if len(platforms) != 1:
        raise ValueError(f"jax_ub lowers for one platform at a time, got {platforms=}")
    return platforms[0]


def required_bytes(platform: str, op: str, chunk_bytes: int, group_size: int) -> int:
    """Symmetric buffer bytes one call of ``op`` needs per device, as the C++ side sizes it."""
    return int(extension.module_for(platform).required_bytes(op, chunk_bytes, group_size))


def _communicator_or_fallback(op, mesh, axis_name, platform, needed, fallback):
    """The communicator, or None where impl="auto" may use XLA's collectives instead: the
    group's devices cannot share memory (different hosts, no peer access)."""
    try:
        return communicator.get_communicator(mesh, axis_name, platform, needed)
    except communicator.PeersUnreachable as e:
        if not fallback:
            raise ValueError(f"{op}: impl='ub' cannot run on this mesh: {e}") from None
        communicator.warn_fallback(axis_name, e)
        return None


def _weight(w, transpose_w: bool):
    return w.T if transpose_w else w


def _all_gather_matmul_lowering(
    ctx, x, w, *, axis_name, axis_size, return_gathered, transpose_w, fallback
):
    platform = _platform(ctx)
    mesh = _concrete_mesh(ctx, axis_name)
    x_aval, w_aval = ctx.avals_in
    chunk = x_aval.shape[0] * x_aval.shape[1] * np.dtype(x_aval.dtype).itemsize
    needed = required_bytes(platform, "all_gather_matmul", chunk, axis_size)
    comm = _communicator_or_fallback(
        "all_gather_matmul", mesh, axis_name, platform, needed, fallback
    )
    if comm is None:

        def unfused(x, w):
            out, gathered = all_gather_matmul_reference(
                x, _weight(w, transpose_w), axis_name, return_gathered=True
            )
            return out, gathered if return_gathered else gathered[:0]

        return mlir.lower_fun(unfused, multiple_results=True)(ctx, x, w)
    rule = jax.ffi.ffi_lowering("jax_ub_all_gather_matmul", has_side_effect=True)
    return rule(ctx, x, w, comm_id=np.int64(comm.id), transpose_w=bool(transpose_w))


def _matmul_reduce_scatter_lowering(ctx, x, w, *, axis_name, axis_size, transpose_w, fallback):
    platform = _platform(ctx)
    mesh = _concrete_mesh(ctx, axis_name)
    (out_aval,) = ctx.avals_out
    chunk = out_aval.shape[0] * out_aval.shape[1] * np.dtype(out_aval.dtype).itemsize
    needed = required_bytes(platform, "matmul_reduce_scatter", chunk, axis_size)
    comm = _communicator_or_fallback(
        "matmul_reduce_scatter", mesh, axis_name, platform, needed, fallback
    )
    if comm is None:

        def unfused(x, w):
            return matmul_reduce_scatter_reference(x, _weight(w, transpose_w), axis_name)

        return mlir.lower_fun(unfused, multiple_results=False)(ctx, x, w)
    rule = jax.ffi.ffi_lowering("jax_ub_matmul_reduce_scatter", has_side_effect=True)
    return rule(ctx, x, w, comm_id=np.int64(comm.id), transpose_w=bool(transpose_w))


mlir.register_lowering(all_gather_matmul_p, _all_gather_matmul_lowering)
mlir.register_lowering(matmul_reduce_scatter_p, _matmul_reduce_scatter_lowering)


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


def bind_all_gather_matmul(
    x,
    w,
    axis_name: str,
    axis_size: int,
    return_gathered: bool,
    transpose_w: bool = False,
    fallback: bool = False,
):
    """2-D x [m, k], w [k, n] -> (all_gather(x) @ w, all_gather(x) or an empty [0, k]).

    With ``transpose_w``, ``w`` is passed as its transpose [n, k] and read in place (the
    backward passes multiply by ``w.T`` without materialising it). With ``fallback``
    (impl="auto"), a group whose devices cannot share memory lowers to XLA's collectives.
    """
    return all_gather_matmul_p.bind(
        x,
        w,
        axis_name=axis_name,
        axis_size=axis_size,
        return_gathered=return_gathered,
        transpose_w=transpose_w,
        fallback=fallback,
    )


def bind_matmul_reduce_scatter(
    x, w, axis_name: str, axis_size: int, transpose_w: bool = False, fallback: bool = False
):
    """2-D x [M, k], w [k, n] -> psum_scatter(x @ w) of shape [M / axis_size, n].

    With ``transpose_w``, ``w`` is passed as its transpose [n, k] and read in place; with
    ``fallback``, as for :func:`bind_all_gather_matmul`.
    """
    return matmul_reduce_scatter_p.bind(
        x, w, axis_name=axis_name, axis_size=axis_size, transpose_w=transpose_w, fallback=fallback
    )
