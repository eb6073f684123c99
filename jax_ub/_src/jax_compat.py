"""Every use of JAX's private modules (``jax._src``) in jax_ub, in one place.

JAX changes its private modules without notice, so the rest of jax_ub imports what it needs
from here and never from ``jax._src``; a JAX release that moves something then breaks this
file alone. Each entry names the public API that would replace it, or says that none exists
yet. Workarounds for bugs of particular JAX releases live here too, each with the versions
it was seen in.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import jax
from jax._src import config as _config
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh
from jax._src import sharding_impls as _sharding_impls
from jax._src import xla_bridge as _xla_bridge
from jax.extend.mlir.dialects import stablehlo as _stablehlo
from jax.interpreters import mlir as _mlir

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)


def concrete_mesh():
    """The concrete mesh of the enclosing ``jax.set_mesh`` (an empty mesh outside one).

    Public replacement: ``jax.sharding.get_mesh()`` returns the same, but refuses to run
    while a trace is active, and the lowering rules that need it run under one."""
    return _mesh.get_concrete_mesh()


def use_concrete_mesh(mesh):
    """Context manager: `mesh` as the concrete mesh, the abstract mesh left as it is.

    No public replacement: ``jax.set_mesh`` sets the abstract mesh as well (to one with no
    manual axes), which a lowering nested in a partly manual shard_map must not do."""
    return _sharding_impls._internal_use_concrete_mesh(mesh)


def check_vma() -> bool:
    """Whether the shard_map being traced tracks which axes values vary over
    (``check_vma=True``); True where this JAX has no such switch.

    No public replacement: shard_map's ``check_vma`` argument is not readable from inside
    its body."""
    state = getattr(_config, "_check_vma", None)
    return bool(state.value) if state is not None else True


def distributed_client():
    """The key-value store client of ``jax.distributed.initialize()``, or None before it.

    No public replacement: ``jax.distributed`` offers initialize/shutdown/is_initialized,
    not the client."""
    return _distributed.global_state.client


def backend_registry() -> tuple[dict, dict]:
    """(the backends JAX has created, by platform; the factories it creates them with).

    No public replacement: JAX has no hook around the creation of a backend; jax_ub wraps
    the CPU factory to size the client's worker pool (``cpu_runtime.install``), and
    ``share_gpu`` must run before the GPU backend exists."""
    return getattr(_xla_bridge, "_backends", {}), getattr(_xla_bridge, "_backend_factories", {})


def backend_errors() -> dict[str, str]:
    """Why each backend that failed to start did so, by platform (e.g. ``{"cuda": ...}``).

    No public replacement: JAX logs a plugin's failure and then only knows no such
    backend ("Unknown backend"); the tests' N-ranks mode reports the reason."""
    return dict(getattr(_xla_bridge, "_backend_errors", {}))


_ENCLOSING_MANUAL: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "jax_ub_enclosing_manual_axes", default=frozenset()
)


def manual_axes(axis_ctx) -> frozenset:
    """The mesh axes that are manual where a lowering rule runs (``axis_ctx``: its module
    context's ``SPMDAxisContext``), those of enclosing shard_maps included.

    JAX 0.9.2 lowers the body of a shard_map nested in another with the inner one's axes
    alone as manual, 0.10.2 with both; ``enclosing_manual_axes`` supplies the outer ones.
    Public: ``SPMDAxisContext.manual_axes`` itself."""
    return frozenset(axis_ctx.manual_axes) | _ENCLOSING_MANUAL.get()


@contextlib.contextmanager
def enclosing_manual_axes(axes: frozenset):
    """While lowering a shard_map nested in one that made `axes` manual (see manual_axes)."""
    token = _ENCLOSING_MANUAL.set(_ENCLOSING_MANUAL.get() | frozenset(axes))
    try:
        yield
    finally:
        _ENCLOSING_MANUAL.reset(token)


def reshape(ctx, value, aval):
    """`value` reshaped to `aval`'s (static) shape, inside a lowering rule.

    Public already (stablehlo and ``aval_to_ir_type``); it stands in for the private
    ``jax._src.interpreters.mlir.reshape``, which ``jax.interpreters.mlir`` does not export."""
    if _IR_TYPE_TAKES_CONTEXT:
        ir_type = _mlir.aval_to_ir_type(ctx.module_context, aval)
    else:
        ir_type = _mlir.aval_to_ir_type(aval)
    return _stablehlo.reshape(ir_type, value)


# aval_to_ir_type(aval) in JAX 0.9.2, aval_to_ir_type(module_context, aval) in 0.10.2 on.
_IR_TYPE_TAKES_CONTEXT = len(inspect.signature(_mlir.aval_to_ir_type).parameters) > 1


# lax.psum_scatter fails to lower inside a shard_map whose mesh still has Explicit axes
# ("Length of sharding.spec (3) must be equal to aval's ndim (0)": its reducer's scalar type
# keeps the operand's sharding). Seen in JAX 0.11.2 and 0.12.0.1, not in 0.10.2; lax.psum
# and lax.all_to_all lower there. Public replacement: lax.psum_scatter, once fixed.
PSUM_SCATTER_BREAKS_UNDER_EXPLICIT_AXES = JAX_VERSION >= (0, 11)


# XLA's CPU compiler aborts the whole process ("hlo_instruction.cc: Invalid binary
# instruction opcode copy", in its AllReducePromotion pass) on a 16-bit float all-reduce
# inside a shard_map that leaves other mesh axes automatic: a psum of a bfloat16 value, or
# the psum JAX's transpose puts on the cotangent of a bfloat16 input replicated over the
# manual axis. Seen in jaxlib 0.9.2 to 0.12.0.1; tests/test_cpu_bf16_all_reduce.py runs
# the plain-JAX reproducer and fails once a JAX release no longer aborts, so that this
# workaround can go. jax_ub sums such values in float32 on CPU devices (as XLA's pass
# itself would), and its partly manual shard_maps take them across in float32.
CPU_16BIT_ALL_REDUCE_ABORTS = True


def cpu_16bit(a, platform: str | None = None) -> bool:
    """Whether ``a`` is a 16-bit float on CPU devices (``platform``, else JAX's default
    backend): a value whose all-reduce XLA's CPU compiler may abort on (see above)."""
    platform = jax.default_backend() if platform is None else platform
    dtype = getattr(a, "dtype", None)
    return (
        CPU_16BIT_ALL_REDUCE_ABORTS
        and platform == "cpu"
        and dtype is not None
        and dtype in (jax.numpy.bfloat16, jax.numpy.float16)
    )


def all_gather_invariant(x, axis_name: str):
    """``all_gather(x, axis_name, axis=0, tiled=True)`` typed as the same on every rank of
    the axis (not varying over it), as ``psum``'s result is; its transpose takes each
    rank's own block of the cotangent, with no communication.

    Public from JAX 0.12: ``lax.all_gather(..., to="invarying")`` (0.9-0.11 take ``to``
    but not that value). Before it, the private
    ``jax._src.lax.parallel.all_gather_invariant``."""
    from jax._src.lax import parallel as _parallel

    private = getattr(_parallel, "all_gather_invariant", None)
    if private is not None:
        return private(x, axis_name, axis=0, tiled=True)
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=True, to="invarying")


def lowering_needs_devices(prim) -> None:
    """Make JAX lower programs that contain ``prim`` with their device assignment
    (``ShardingContext.device_assignment``), which it otherwise leaves out.

    No public replacement: ``jax._src.dispatch.prim_requires_devices_during_lowering``
    is the registry JAX's own callbacks and ``custom_partitioning`` use (0.9.2 to 0.12)."""
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.add(prim)


def lowering_for_export(ctx) -> bool:
    """Whether ``ctx`` lowers for ``jax.export`` (``LoweringParameters.for_export``, 0.9.2 to
    0.12), whose programs run elsewhere: without this process's communicators."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(params, "for_export", False))


def set_user_context_global(context, value) -> None:
    """The global value of ``context`` (a ``jax.make_user_context``), which keys JAX's
    trace caches. Public from JAX 0.10: ``context.set_global(value)``; 0.9 has no method
    for it, only that of the private config object it wraps."""
    if hasattr(context, "set_global"):
        context.set_global(value)
    else:
        context._obj.set_global(value)


def register_uncached_lowering(prim, rule) -> None:
    """``mlir.register_lowering`` for a primitive whose every equation must run `rule`:
    JAX otherwise lowers equal equations once and copies the result (``cacheable``, newer
    JAX), which would give two jax_ub calls one site (lowering/call_site.py)."""
    if "cacheable" in inspect.signature(_mlir.register_lowering).parameters:
        _mlir.register_lowering(prim, rule, cacheable=False)
    else:
        _mlir.register_lowering(prim, rule)
