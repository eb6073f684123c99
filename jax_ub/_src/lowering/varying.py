"""Which mesh axes a value varies over (shard_map's ``check_vma`` types), for the
primitives' abstract values and the custom VJPs' cotangents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.core import AbstractValue
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType

from jax_ub._src.jax_compat import check_vma as _check_vma


def _varying(aval: AbstractValue) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over under shard_map (empty outside one, or unchecked)."""
    return _varying(jax.typeof(x)) if _check_vma() else frozenset()


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


def result_aval(x, shape, *operands, extra: frozenset = frozenset()):
    """x's aval with `shape`, varying over every mesh axis any operand varies over.

    Under shard_map(check_vma=True) that is what the lax reference would produce.
    """
    if not _check_vma():
        return x.update(shape=shape)
    varying = frozenset(extra).union(*(_varying(a) for a in operands))
    return _with_varying(x.update(shape=shape), varying)


def _with_varying(aval: AbstractValue, varying: frozenset) -> AbstractValue:
    """``aval`` typed as varying over ``varying`` (the attribute moved between JAX versions,
    hence the two spellings)."""
    sharding = getattr(aval, "sharding", None)
    if varying and sharding is not None and not sharding.mesh.axis_names:
        # A constant's value (x closed over, or NumPy) is typed on no mesh, where no axis
        # can vary: type it on the mesh being traced, as a traced operand is.
        aval = aval.update(sharding=sharding.update(mesh=jax.sharding.get_abstract_mesh()))
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=varying))
    if hasattr(aval, "vma"):
        return aval.update(vma=varying)
    return aval


# A value typed as not varying over some axes (as psum's result is), with nothing computed or
# communicated: the sum over a group of one, or impl="none"'s stand-in for an all-reduce
# (each rank keeps its own value). XLA's psum over a size-1 axis would be a no-op
# all-reduce, which its SPMD partitioner rejects inside a partial-auto shard_map whose
# automatic axes split the operand; this emits nothing.
_invariant_p = Primitive("jax_ub_typed_invariant")
_invariant_p.def_impl(lambda x, *, axes: x)
_invariant_p.def_abstract_eval(lambda x, *, axes: _with_varying(x, _varying(x) - axes))
mlir.register_lowering(_invariant_p, lambda ctx, x, *, axes: [x])
# The transpose, as psum's: the cotangent (the same on every rank) cast back to varying.
ad.deflinear2(
    _invariant_p,
    lambda ct, x, *, axes: [jax.lax.pcast(ct, tuple(sorted(axes)), to="varying")],
)
batching.primitive_batchers[_invariant_p] = lambda args, dims, *, axes: (
    _invariant_p.bind(args[0], axes=axes),
    dims[0],
)


def typed_invariant(y, axis_name: str):
    """``y``, no longer typed as varying over ``axis_name`` (a no-op where it does not vary
    over it, or nothing is checked). Equal to ``psum(y, axis_name)`` only where the axis
    has size 1."""
    axes = frozenset({axis_name}) & varying_axes(y)
    return _invariant_p.bind(y, axes=axes) if axes else y


def summed_axes() -> tuple[str, ...]:
    """The axes over which an unchecked shard_map's transpose sums the cotangent of an input
    it replicates: every manual axis (of size above 1) of the shard_map being traced. None
    where it checks vma: JAX then sums only over the axes the cotangent varies over."""
    if _check_vma():
        return ()
    return tuple(sorted(a for a in manual_axes() if jax.lax.axis_size(a) > 1))


def manual_axes() -> frozenset[str]:
    """The mesh axes that are manual where the caller is being traced."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def counted_once(value, axes: tuple[str, ...]):
    """``value``, the same on every device, on the first device of ``axes`` and 0 on the
    others: what a replicated input's cotangent must be where shard_map sums it over
    ``axes`` (:func:`summed_axes`), so that the sum is ``value`` itself, exactly."""
    if not axes:
        return value
    first = jnp.all(jnp.array([jax.lax.axis_index(a) == 0 for a in axes]))
    return jnp.where(first, value, jnp.zeros_like(value))
