"""Which mesh axes a value varies over (shard_map's ``check_vma`` types), for the
primitives' abstract values and the custom VJPs' cotangents."""

from __future__ import annotations

import jax
from jax.core import AbstractValue

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
