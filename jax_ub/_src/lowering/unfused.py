"""The unfused ops: a GEMM and a ``lax`` collective, one after the other.

The production path of ``impl="xla"`` (and of ``"auto"`` where it does not pick the
userbuffer op), the primitives' fallback where a group's devices cannot share memory, the
oracle the tests compare the overlapped ops with, and the benchmarks' baseline; with the
collectives removed (:data:`NONE`, ``impl="none"``), the no-communication bound. The public
``jax_ub.*_reference`` functions are defined here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from jax_ub._src import jax_compat
from jax_ub._src.lowering.varying import typed_invariant
from jax_ub._src.lowering.wire_format import product_scale


def scaled_matmul(x: jax.Array, w: jax.Array, scales=None, out_dtype=None) -> jax.Array:
    """``x @ w``; with fp8 operands, ``x_scale * w_scale * (x @ w)`` (``scales`` laid out by
    :func:`jax_ub._src.lowering.wire_format.pack_scales`) accumulated in float32 and cast to
    ``out_dtype``: XLA's dequantize-then-dot pattern, which its GPU compiler turns into an
    fp8 GEMM."""
    if scales is None or jnp.dtype(x.dtype).itemsize > 1:
        out = x @ w
        return out if out_dtype is None else out.astype(out_dtype)
    wide = jnp.dtype(out_dtype)
    out = lax.dot_general(
        x.astype(wide),
        w.astype(wide),
        (((x.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return (out * product_scale(scales)).astype(wide)


ACTIVATIONS = (None, "gelu")


def gelu(y: jax.Array) -> jax.Array:
    """GELU's tanh approximation (``jax.nn.gelu``'s default), as cuBLASLt's epilogue computes it."""
    return jax.nn.gelu(y, approximate=True)


def dgelu_reference(dy: jax.Array, pre: jax.Array) -> jax.Array:
    """``dy * gelu'(pre)``: GELU's backward, from its output's gradient and its input."""
    return jax.vjp(gelu, pre)[1](dy)[0]


def epilogue(y: jax.Array, bias=None, activation: str | None = None):
    """``(activation(y + bias), y + bias)``: the epilogue's output and the activation's input."""
    pre = y if bias is None else y + bias.astype(y.dtype)
    return (gelu(pre) if activation == "gelu" else pre), pre


def all_gather_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    return_gathered: bool = False,
    scales=None,
    out_dtype=None,
    bias=None,
    activation: str | None = None,
    return_pre_activation: bool = False,
    collectives: Collectives | None = None,
):
    """``activation(all_gather(x, axis_name, tiled=True) @ w + bias)``; fp8 operands scaled by
    ``scales``, as :func:`scaled_matmul`. Returns the result, then the gathered ``x`` with
    ``return_gathered``, then the activation's input with ``return_pre_activation``. The
    gather is ``collectives``' (XLA's by default)."""
    gathered = (collectives or XLA).gather_rows(x, axis_name)
    out, pre = epilogue(scaled_matmul(gathered, w, scales, out_dtype), bias, activation)
    extra = (gathered,) * return_gathered + (pre,) * return_pre_activation
    return (out, *extra) if extra else out


def matmul_reduce_scatter_reference(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    scales=None,
    out_dtype=None,
    collectives: Collectives | None = None,
) -> jax.Array:
    """psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True); fp8 operands
    scaled by ``scales``, as :func:`scaled_matmul`. The scatter is ``collectives'``."""
    y = scaled_matmul(x, w, scales, out_dtype)
    return (collectives or XLA).scatter_rows(y, axis_name)


def matmul_all_reduce_reference(
    x: jax.Array, w: jax.Array, axis_name: str | None, collectives: Collectives | None = None
) -> jax.Array:
    """``psum(x @ w, axis_name)`` (``x @ w`` with ``axis_name=None``: a group of one). The
    sum is ``collectives'``."""
    y = x @ w
    return y if axis_name is None else (collectives or XLA).all_reduce(y, axis_name)


def all_reduce(y: jax.Array, axis_name: str) -> jax.Array:
    """``psum(y, axis_name)``; a 16-bit float sum runs in float32 on CPU devices, where
    XLA's CPU compiler would abort on it (``jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS``).
    Over a group of one it is ``y``, typed as psum's result: XLA's SPMD partitioner rejects
    an all-reduce over a size-1 axis of a partly manual shard_map ("Cross-partition
    allreduce must be in (partial) manual partitioning mode"; e.g. tp=1 beside dp=2)."""
    if lax.axis_size(axis_name) == 1:
        return typed_invariant(y, axis_name)
    if _cpu_16bit(y):
        return lax.psum(y.astype(jnp.float32), axis_name).astype(y.dtype)
    return lax.psum(y, axis_name)


def all_max(y: jax.Array, axis_name: str) -> jax.Array:
    """``pmax(y, axis_name)``; over a group of one ``y``, typed as pmax's result (XLA's
    partitioner rejects that reduction as it does ``all_reduce``'s)."""
    if lax.axis_size(axis_name) == 1:
        return typed_invariant(y, axis_name)
    return lax.pmax(y, axis_name)


def all_gather_rows(x: jax.Array, axis_name: str) -> jax.Array:
    """``all_gather(x, axis_name, axis=0, tiled=True)``, whose transpose is
    :func:`reduce_scatter_rows` (where that differs from psum_scatter, see there)."""
    if _cpu_16bit(x) or not _psum_scatter_lowers():
        return _all_gather_rows_custom(x, axis_name)
    return lax.all_gather(x, axis_name, axis=0, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_gather_rows_custom(x, axis_name):
    return lax.all_gather(x, axis_name, axis=0, tiled=True)


def _all_gather_rows_fwd(x, axis_name):
    return _all_gather_rows_custom(x, axis_name), None


def _all_gather_rows_bwd(axis_name, _, ct):
    return (reduce_scatter_rows(ct, axis_name),)


_all_gather_rows_custom.defvjp(_all_gather_rows_fwd, _all_gather_rows_bwd)


_cpu_16bit = jax_compat.cpu_16bit


def _psum_scatter_lowers() -> bool:
    """False where this JAX's psum_scatter would fail to lower: under a mesh that still has
    Explicit axes, in the releases ``jax_compat`` names."""
    if not jax_compat.PSUM_SCATTER_BREAKS_UNDER_EXPLICIT_AXES:
        return True
    return AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types


def reduce_scatter_rows(y: jax.Array, axis_name: str) -> jax.Array:
    """``psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)``.

    On the CPU backend a 16-bit float sum runs in float32, as XLA's CPU compiler would
    run it anyway: its pass that promotes such reductions crashes the process on the
    reduction JAX builds inside a shard_map over some of the mesh's axes
    (``jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS``)."""
    if _cpu_16bit(y):
        return _reduce_scatter(y.astype(jnp.float32), axis_name).astype(y.dtype)
    return _reduce_scatter(y, axis_name)


def _reduce_scatter(y: jax.Array, axis_name: str) -> jax.Array:
    if _psum_scatter_lowers():
        return lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
    # An all-to-all moves the same bytes as a reduce-scatter; each rank then sums the blocks
    # of its rows that the others sent.
    n = lax.axis_size(axis_name)
    blocks = lax.all_to_all(y, axis_name, split_axis=0, concat_axis=0, tiled=True)
    return jnp.sum(blocks.reshape((n, y.shape[0] // n, *y.shape[1:])), axis=0)


# --- which collectives: XLA's, or none --------------------------------------------------

# The named scope of impl="none"'s stand-ins for the collectives (profiles time it).
NO_COMMUNICATION_SCOPE = "bound_stand_in"


def copies_of_rows(x: jax.Array, axis_name: str) -> jax.Array:
    """An all-gather's shapes without its communication: ``tp`` copies of ``x``'s rows
    stacked on dim 0, ``tp`` the size of ``axis_name``."""
    with jax.named_scope(NO_COMMUNICATION_SCOPE):
        return jnp.concatenate([x] * lax.axis_size(axis_name), axis=0)


def sum_row_blocks(y: jax.Array, axis_name: str) -> jax.Array:
    """A reduce-scatter's shapes without its communication: the sum of ``y``'s ``tp``
    blocks of rows (dim 0), ``tp`` the size of ``axis_name``."""
    with jax.named_scope(NO_COMMUNICATION_SCOPE):
        blocks = y.reshape(lax.axis_size(axis_name), -1, *y.shape[1:])
        return blocks.sum(axis=0)


def _kept(y: jax.Array, axis_name: str) -> jax.Array:
    """An all-reduce's shapes and type without its communication: ``y`` itself, typed as
    the same on every rank (as psum's result is, so ``out_specs`` may replicate it)."""
    return typed_invariant(y, axis_name)


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The collectives an unfused op is built from, over the rows (dim 0) of its operands:
    ``gather_rows(x, axis_name)``, ``scatter_rows(y, axis_name)``, ``all_reduce(y,
    axis_name)``."""

    gather_rows: Callable[[jax.Array, str], jax.Array]
    scatter_rows: Callable[[jax.Array, str], jax.Array]
    all_reduce: Callable[[jax.Array, str], jax.Array]


# XLA's collectives: the unfused ops (impl="xla").
XLA = Collectives(all_gather_rows, reduce_scatter_rows, all_reduce)
# None: the same GEMMs and shapes, nothing communicated (impl="none"; wrong numbers, for
# timing a model's no-communication bound).
NONE = Collectives(copies_of_rows, sum_row_blocks, _kept)


def collectives_of(impl: str) -> Collectives:
    """The collectives of an impl's unfused path: none for ``"none"``, else XLA's."""
    return NONE if impl == "none" else XLA
