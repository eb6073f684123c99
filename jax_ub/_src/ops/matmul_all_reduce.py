"""matmul_all_reduce: psum(x @ w) + bias, the reduction's first half overlapped with the
matmul: a row-parallel layer whose activations are replicated over tp (decode, prefill)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_ub._src import jax_compat
from jax_ub._src.lowering.unfused import matmul_all_reduce_reference, reduce_scatter_rows
from jax_ub._src.lowering.varying import match_varying, typed_invariant, varying_axes
from jax_ub._src.ops import driver, impl_choice, placement
from jax_ub._src.ops.argument_checks import check_arguments
from jax_ub._src.ops.group import Group
from jax_ub._src.ops.path import Bodies, Path
from jax_ub._src.ops.weight_grad import contract_rows

_OP = "matmul_all_reduce"


def matmul_all_reduce(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    bias: jax.Array | None = None,
    impl: str = "auto",
    seq_axis: int = 0,
) -> jax.Array:
    """Multiply ``x @ w`` and sum the products over ``axis_name``; then add ``bias``.

    The row-parallel GEMM of tensor parallelism without sequence parallelism: every rank
    holds all rows (tokens) of the activations and a slice of their features, as when
    decoding or where ``tp`` does not divide the sequence.

    Called inside ``jax.shard_map`` on local shards, or on global arrays under
    ``jax.set_mesh(mesh)``: there ``x [..., K]`` is sharded ``P(None, ..., axis_name)``
    (features), ``w [K, n]`` ``P(axis_name, None)``, and the result comes back replicated.

    How ``impl="ub"`` runs it: the rows of ``x`` along ``seq_axis`` (zero rows appended up
    to a multiple of ``tp``) go through :func:`matmul_reduce_scatter`, which sums each
    rank's block of rows while the GEMM runs; an all-gather of the summed blocks (XLA's)
    then hands every rank all rows. So half of the all-reduce's traffic is hidden behind
    the GEMM and half is not.

    Args:
      x: local input ``[rows, ..., k]`` (the features sharded over the axis).
      w: local weight ``[k, n]`` (the row shard of a larger weight).
      axis_name: the mesh axis to sum over, of size ``tp``.
      bias: ``[n]``, the same on every rank, added once to the sum.
      impl: ``"ub"``, ``"xla"`` (XLA's dot then its all-reduce) or ``"auto"``: ub where its
        rows split evenly over the axis and the rule of ``jax_ub.explain_impl`` says it
        pays (on GPUs: an all-reduce of at least 6 x ``config.auto_min_bytes`` per rank, 48
        MiB by default), else
        XLA's; ``"none"``: the local product, unsummed.
      seq_axis: the dim of ``x`` whose rows ub splits over the axis for its reduce-scatter:
        0 for ``[seq, batch, ..., k]``, 1 for batch-major ``[batch, seq, ..., k]`` (the
        other dims before the features stay whole, split over other mesh axes by XLA).

    Returns:
      ``psum(x @ w, axis_name) + bias``, of shape ``[..., n]``, the same on every rank (a
      value that does not vary over the axis, as ``psum``'s).

    The gradient: ``dx = dy @ w.T`` and ``dw = x.T @ dy``, local where ``dy`` is typed the
    same on every rank (``check_vma=True``, plain ``jit``). Inside
    ``shard_map(check_vma=False)`` each rank holds a share of ``dy`` and the true one is
    their sum (as ``psum``'s transpose gives): a reduce-scatter of ``dy``, then an
    all-gather overlapped with ``dx``'s GEMM.

    Example::

        f = jax.jit(jax.shard_map(
            lambda h, w: jax_ub.matmul_all_reduce(h, w, "tp"),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))
        y = f(h, w)  # == h @ w, replicated
    """
    seq_axis = check_arguments(_OP, x, w, impl=impl, seq_axis=seq_axis, bias=bias)
    call = driver.Call(_OP, driver.ALL_REDUCE, axis_name, impl, seq_axis)
    extra = driver.Extra(bias=bias)  # replicated
    return driver.run(call, summed_product, _route, x, w, extra)


def _route(call: driver.Call, x, w, extra: driver.Extra) -> tuple[Path, ...]:
    """The path of the op's GEMM, decided on the rows first (as ub splits them). A group
    of one sums nothing, nor do no rows (an empty sequence): XLA's dot, whatever the impl;
    so does the bound on jax_ub's GEMMs (its ub body's all-gather is XLA's)."""
    s = call.seq_axis
    if impl_choice.all_reduce_sums_nothing(call.size, x.shape[s]):
        return (Path.XLA,)
    rows = jax.ShapeDtypeStruct((x.shape[s], *x.shape[:s], *x.shape[s + 1 :]), x.dtype)
    path = call.choose(rows, w)
    return (Path.NONE if path is Path.NONE_UB else path,)


def summed_product(call: driver.Call, x, w, extra: driver.Extra):
    """The op on a rank's shard ``x [..., k]`` as the caller laid it out (every rank holds
    all rows): ``psum(x @ w) + extra.bias``, on the call's path."""
    y = _BODIES(call, x, w)
    return y if extra.bias is None else y + jnp.asarray(extra.bias, y.dtype)


def _ub(call: driver.Call, x, w):
    """ub splits the rows (the sequence, ``call.seq_axis``, moved first) for its
    reduce-scatter, zero rows appended up to a multiple of the group's size."""
    s = call.seq_axis
    xs = placement.seq_first(x, s)
    rows, pad = xs.shape[0], -xs.shape[0] % call.size
    if pad:
        xs = jnp.pad(xs, ((0, pad),) + ((0, 0),) * (xs.ndim - 1))
    return placement.seq_back(_matmul_all_reduce(xs, w, call.group())[:rows], s)


def _unfused(call: driver.Call, x, w):
    if call.size == 1:  # nothing to sum; the product typed as the sum is
        return typed_invariant(matmul_all_reduce_reference(x, w, None), call.axis_name)
    return matmul_all_reduce_reference(x, w, call.axis_name, call.path.collectives)


_BODIES = Bodies(ub=_ub, unfused=_unfused)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, group: Group):
    # Each rank's block of rows summed during the GEMM, then every block to every rank.
    # The gathered rows are the same on every rank: the all-gather that says so (invariant
    # over the axis), as psum's result is.
    blocks = group.matmul_reduce_scatter(x, w)
    return jax_compat.all_gather_invariant(blocks, group.axis_name)


def _fwd(x, w, group: Group):
    return _matmul_all_reduce(x, w, group), (x, w)


def _bwd(group: Group, res, dy):
    x, w = res
    if jax_compat.check_vma():
        # dy is typed the same on every rank (the output does not vary over the axis):
        # both products are local. Where the output feeds rank-varying math, the cast to
        # varying that JAX inserted there has already summed the ranks' cotangents.
        if group.axis_name not in varying_axes(x) | varying_axes(w):
            # x @ w the same on every rank: psum adds tp equal terms (it casts the product
            # to varying first), so each term's cotangent is tp times dy.
            dy = dy * group.size
        dx = jnp.einsum("...n,kn->...k", dy, w)
    else:
        # Unchecked shard_map: nothing typed the output as replicated, so each rank holds
        # its own share of the cotangent (shard_map's transpose hands an output of spec
        # P() 1/tp of it on each rank, and rank-varying math downstream adds its own
        # part); the true cotangent is their sum, as psum's transpose (a psum) gives the
        # reference. The sum is a reduce-scatter and an all-gather, the gather overlapped
        # with dx's GEMM and handed back for dw: the forward's traffic, mirrored.
        dx, dy = group.gather_times_w_t(reduce_scatter_rows(dy, group.axis_name), w)
    return match_varying(dx, x), match_varying(contract_rows(x, dy), w)


_matmul_all_reduce.defvjp(_fwd, _bwd)
