"""JAX primitives that lower to the userbuffer FFI custom calls (``custom_call.py``).

Operands are ``x [rows, *batch, k]``, ``w [k, n]``, ``scales`` (``wire_format.pack_scales``: the
scales multiplying the product when x and w are fp8; ones otherwise); for the all-gather,
the epilogue's ``bias`` (``[n]``, or ``[0]`` for none) and ``gelu_input`` (DGELU's, laid out as
the output, or ``[0, ..., n]`` for none); for the reduce-scatter, ``gather_src`` (laid out as
its output, or ``[0, ..., n]`` for none), all-gathered beside it. Each primitive's unfused
math on XLA's collectives is its fallback where a group's devices cannot share memory.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from jax_ub._src import jax_compat
from jax_ub._src.lowering.custom_call import SOLO_AXIS, is_empty, lowering_rule
from jax_ub._src.lowering.unfused import (
    all_gather_matmul_reference,
    all_gather_rows,
    dgelu_reference,
    matmul_reduce_scatter_reference,
)
from jax_ub._src.lowering.varying import result_aval
from jax_ub._src.lowering.wire_format import unit_scales

all_gather_matmul_p = Primitive("jax_ub_all_gather_matmul")
all_gather_matmul_p.multiple_results = True
matmul_reduce_scatter_p = Primitive("jax_ub_matmul_reduce_scatter")
matmul_reduce_scatter_p.multiple_results = True


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
    # Its rows vary over the axis even where x does not, as lax.all_gather's do (it casts an
    # x the same on every rank to varying first): the custom VJP's reduce-scatter of the
    # cotangent then sums each rank's own block, not tp copies of one.
    varies = frozenset([axis_name]) - {SOLO_AXIS}
    out = result_aval(x, (axis_size * m, *batch, n), x, w, bias, extra=varies)
    out = out.update(dtype=jnp.dtype(out_dtype))
    gathered = result_aval(x, (axis_size * m if return_gathered else 0, *batch, k), x)
    pre_gelu = out.update(shape=(axis_size * m if keep_pre_gelu else 0, *batch, n))
    return out, gathered, pre_gelu


def _matmul_reduce_scatter_abstract(
    x, w, scales, gather_src, *, axis_name, axis_size, transpose_w, out_dtype, fallback
):
    shape = (x.shape[0] // axis_size, *x.shape[1:-1], _columns(w, transpose_w))
    # Its rows differ by rank (no axis: a group of one on every device, SOLO_AXIS).
    out = result_aval(x, shape, x, w, extra=frozenset([axis_name]) - {SOLO_AXIS})
    gathered = result_aval(gather_src, (axis_size * gather_src.shape[0], *shape[1:]), gather_src)
    return out.update(dtype=jnp.dtype(out_dtype)), gathered.update(dtype=jnp.dtype(out_dtype))


all_gather_matmul_p.def_abstract_eval(_all_gather_matmul_abstract)
matmul_reduce_scatter_p.def_abstract_eval(_matmul_reduce_scatter_abstract)


def _weight(w, transpose_w: bool):
    return w.T if transpose_w else w


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
    x, w, scales, gather_src, *, axis_name, transpose_w, out_dtype, **_
):
    out = matmul_reduce_scatter_reference(
        x, _weight(w, transpose_w), axis_name, scales=scales, out_dtype=out_dtype
    )
    if is_empty(gather_src):
        return out, jnp.zeros(gather_src.shape, out.dtype)
    return out, all_gather_rows(gather_src, axis_name).astype(out.dtype)


jax_compat.register_uncached_lowering(
    all_gather_matmul_p,
    lowering_rule(
        all_gather_matmul_p,
        "all_gather_matmul",
        lambda ctx: ctx.avals_in[0],  # x
        _all_gather_matmul_unfused,
        # Laid out like x's batch dims: x, and gelu_input (as the output). The weight,
        # scales and bias are replicated over the axes a nested shard_map leaves to XLA.
        batched=(0, 4),
        attrs=("gelu", "dgelu"),
    ),
)
jax_compat.register_uncached_lowering(
    matmul_reduce_scatter_p,
    lowering_rule(
        matmul_reduce_scatter_p,
        "matmul_reduce_scatter",
        lambda ctx: ctx.avals_out[0],  # the output block
        _matmul_reduce_scatter_unfused,
        batched=(0, 3),  # x, and gather_src (laid out as the output)
        also_gathers=lambda ctx: not is_empty(ctx.avals_in[3]),  # gather_src
    ),
)
# Lowering bakes the group's communicator, and with it the mesh's devices in order, into the
# module: JAX must lower a program again for another device assignment (a mesh of the same
# shape on other devices, or on the same devices in another order) instead of reusing it.
for _prim in (all_gather_matmul_p, matmul_reduce_scatter_p):
    jax_compat.lowering_needs_devices(_prim)


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


def _no_second_derivative(op: str):
    """The primitives' JVP rule: the ops differentiate once, through their custom VJPs,
    whose backward calls the primitives again; differentiating that backward (grad of
    grad, a Hessian) reaches this rule."""

    def rule(primals, tangents, **params):
        raise NotImplementedError(
            "jax_ub: the ops with impl='ub' differentiate once, through their custom VJPs; "
            "a second derivative (grad of grad, jax.hessian, a Hessian-vector product) "
            f"would differentiate the {op} in a backward: use impl='xla' there"
        )

    return rule


ad.primitive_jvps[all_gather_matmul_p] = _no_second_derivative("all_gather_matmul")
ad.primitive_jvps[matmul_reduce_scatter_p] = _no_second_derivative("matmul_reduce_scatter")


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
    # A group of one: all_gather(x) is x, given back as it is, not copied in the call (a
    # pass over x per call, e.g. in every backward of a tp=1 model).
    copies = return_gathered and axis_size > 1
    out, gathered, pre = all_gather_matmul_p.bind(
        x,
        w,
        scales,
        bias,
        gelu_input,
        axis_name=axis_name,
        axis_size=axis_size,
        return_gathered=copies,
        transpose_w=transpose_w,
        out_dtype=out_dtype,
        fallback=fallback,
        gelu=bool(gelu),
        keep_pre_gelu=bool(keep_pre_gelu and gelu),
        dgelu=dgelu,
    )
    return out, (x if return_gathered and not copies else gathered), pre


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
    if gather is not None and (gather.shape != shape or gather.dtype != out_dtype):
        raise ValueError(
            f"matmul_reduce_scatter: the array to all-gather beside it must be laid out as its "
            f"result, {shape} of {out_dtype}; got {gather.shape=} of {gather.dtype}"
        )
    # A group of one: all_gather(gather) is gather, given back as it is, not copied in the call.
    copies = gather is not None and axis_size > 1
    gather_src = gather if copies else jnp.zeros((0, *shape[1:]), out_dtype)
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
    if gather is None:
        return out
    return out, (gathered if copies else gather)
