"""The overlapped ops' fp8 forward and backward (the scales and recipes they take are
:mod:`jax_ub._src.settings.fp8`).

With ``fp8=Fp8Scales(...)`` an op takes high-precision ``x`` and ``w`` (bfloat16, float16 or
float32), quantizes both to ``float8_e4m3fn`` (``x ~ x_q * x_scale``), moves and multiplies
fp8 (the all-gather moves half of bf16's bytes) and returns ``x.dtype``. The backward
quantizes the output gradient to ``float8_e5m2``: the input gradient is the swapped
overlapped op on fp8 operands, the weight gradient an fp8 product of the gathered fp8
activation (or gradient) kept by the forward, which is never gathered twice.
Quantization is transparent to autodiff (straight-through), as in fp8 training recipes.

An operand given already quantized (``float8_e4m3fn`` with its scale in ``Fp8Scales``,
e.g. weights stored in fp8 for serving, or an activation its producer quantized) is used
as it is. Its gradient is the op's gradient cast to fp8, as autodiff treats any cast; its
scale gets no gradient (no amax is taken of it).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub._src import jax_compat
from jax_ub._src.lowering.unfused import (
    all_gather_matmul_reference,
    all_max,
    dgelu_reference,
    epilogue,
    matmul_reduce_scatter_reference,
)
from jax_ub._src.lowering.varying import (
    counted_once,
    match_varying,
    summed_axes,
    varying_axes,
)
from jax_ub._src.lowering.wire_format import pack_scales
from jax_ub._src.ops.checkpoint_policy import saved_gathered, saved_output
from jax_ub._src.ops.epilogue import epilogue_grads
from jax_ub._src.ops.group import Group
from jax_ub._src.ops.weight_grad import weight_grad_with
from jax_ub._src.settings import options
from jax_ub._src.settings.fp8 import (
    E4M3,
    E5M2,
    Fp8Scales,
    amax,
    is_quantized,
    quantize,
    result_dtype,
    scale_from_amax,
)


class AgResiduals(NamedTuple):
    """What fp8_all_gather_matmul's forward keeps for its backward."""

    x_like: jax.Array  # an empty slice of x: its dtype and the mesh axes it varies over
    w_like: jax.Array  # the same of w
    w_q: jax.Array  # w in fp8, [k, n]: w.T read k-major by the dgrad GEMM
    gathered_q: jax.Array  # all_gather(x) in fp8, for the weight gradient
    x_scale: jax.Array
    w_scale: jax.Array
    grad_scale: jax.Array | None  # the caller's scale for the output's gradient, if given
    seen_x: jax.Array | None  # x's amax over the group where the caller gave its scale
    seen_w: jax.Array | None  # the same of w
    pre_gelu: jax.Array | None  # GELU's input, with activation="gelu"
    bias_like: jax.Array | None  # an empty slice of the bias, where there is one


class RsResiduals(NamedTuple):
    """What fp8_matmul_reduce_scatter's forward keeps for its backward."""

    x_like: jax.Array  # an empty slice of x: its dtype and the mesh axes it varies over
    w_like: jax.Array  # the same of w
    x_q: jax.Array  # x in fp8, for the weight gradient
    w_q: jax.Array  # w in fp8, [k, n]: w.T read k-major by the dgrad GEMM
    x_scale: jax.Array
    w_scale: jax.Array
    grad_scale: jax.Array | None  # the caller's scale for the output's gradient, if given
    seen_x: jax.Array | None  # x's amax over the group where the caller gave its scale
    seen_w: jax.Array | None  # the same of w


class QuantizedForward(NamedTuple):
    """The residual fields :class:`AgResiduals` and :class:`RsResiduals` share, as the
    forward's operand quantization makes them (see those classes)."""

    x_like: jax.Array
    w_like: jax.Array
    w_q: jax.Array
    x_scale: jax.Array
    w_scale: jax.Array
    grad_scale: jax.Array | None
    seen_x: jax.Array | None
    seen_w: jax.Array | None


def _ag(
    x_q,
    w_t,
    sx,
    sw,
    *,
    out_dtype,
    group: Group,
    bias=None,
    gelu: bool = False,
    dgelu_at=None,
):
    """(y, all_gather(x_q), GELU's input or an empty [0, ..., n]), y = gelu?(all_gather(x_q)
    @ w_t.T scaled by sx * sw + bias?), or with ``dgelu_at`` (GELU's input, laid out as y)
    that product times gelu'(dgelu_at), in the epilogue; ``w_t`` is the weight stored
    k-major, ``[n, k]``, as cuBLASLt's fp8 GEMMs read it."""
    scales = pack_scales(sx, sw)
    if group.path.calls_ub:
        return group.all_gather_matmul(
            x_q,
            w_t,
            return_gathered=True,
            transpose_w=True,
            scales=scales,
            out_dtype=out_dtype,
            bias=bias,
            gelu=gelu,
            keep_pre_gelu=gelu,
            gelu_input=dgelu_at,
        )
    out, gathered, pre = all_gather_matmul_reference(
        x_q,
        w_t.T,
        group.axis_name,
        return_gathered=True,
        scales=scales,
        out_dtype=out_dtype,
        bias=bias,
        activation="gelu" if gelu else None,
        return_pre_activation=True,
        collectives=group.path.collectives,
    )
    return (out if dgelu_at is None else dgelu_reference(out, dgelu_at)), gathered, pre


def _rs(x_q, w_t, sx, sw, *, out_dtype, group: Group):
    """psum_scatter(x_q @ w_t.T scaled by sx * sw); ``w_t`` as for :func:`_ag`."""
    scales = pack_scales(sx, sw)
    if group.path.calls_ub:
        return group.matmul_reduce_scatter(
            x_q, w_t, transpose_w=True, scales=scales, out_dtype=out_dtype
        )
    return matmul_reduce_scatter_reference(
        x_q,
        w_t.T,
        group.axis_name,
        scales=scales,
        out_dtype=out_dtype,
        collectives=group.path.collectives,
    )


def _weight_grad(a_q, b_q, scale, dtype):
    """``a^T b`` over the rows (and batch dims) of fp8 ``a_q``, ``b_q``, times ``scale``, in
    ``dtype`` (high precision)."""
    lead = tuple(range(a_q.ndim - 1))
    wide = jnp.dtype(dtype)
    out = lax.dot_general(
        a_q.astype(wide),
        b_q.astype(wide),
        ((lead, lead), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return (out * scale).astype(wide)


def _scale_of(given, observed_amax, dtype):
    return given if given is not None else scale_from_amax(observed_amax, dtype)


def reported_amax(local_amax, axis_name: str | None, scale):
    """A tensor's amax (this device's ``local_amax``, max over ``axis_name``'s group too
    where given) reported as the cotangent of its given ``scale``: it must come out of
    shard_map as the max over every device the tensor is split over. shard_map sums a
    replicated input's cotangents: with ``check_vma``, over the axes the cotangent still
    varies over, so the max is taken over all of them and none is left; without, over
    every manual axis, so after the max one device reports it and the others 0."""
    m = local_amax if axis_name is None else all_max(local_amax, axis_name)
    if jax_compat.check_vma():
        rest = varying_axes(m) - varying_axes(scale)
        return lax.pmax(m, tuple(sorted(rest))) if rest else m
    split = summed_axes()
    return counted_once(lax.pmax(m, split), split) if split else m


def _seen(given, local_amax, axis_name):
    """The amax to report for a scale the caller gave (``reported_amax``), else None: no
    collective is traced for a gradient nobody asked for, nor for an operand given in fp8
    (``local_amax`` None)."""
    if given is None or local_amax is None:
        return None
    return reported_amax(local_amax, axis_name, given)


def _local_amax(a, axis_name=None):
    """amax of a high-precision operand (over ``axis_name``'s group if given); None for an
    operand given in fp8, whose scale the caller passed."""
    return None if is_quantized(a) else amax(a, axis_name)


def _quantized(a, scale):
    return a if is_quantized(a) else quantize(a, scale)


def _cotangent(d, primal_like):
    """A gradient typed like its primal (cast to fp8 for an operand given in fp8)."""
    return match_varying(d.astype(primal_like.dtype), primal_like)


def _quantize_operands(x, w, fp8: Fp8Scales, group: Group, x_gathered: bool):
    """``(x_q, w_q, QuantizedForward)``: an fp8 op's forward operands in e4m3 with the
    scales ``fp8`` gives or current ones, and the residual fields both ops keep.

    An ``x`` that is gathered (``x_gathered``) takes the group's amax for its current
    scale, one scale for every chunk; partials dequantized by each rank's GEMM before they
    are summed (the reduce-scatter's) fit local scales."""
    axis_name = group.axis_name
    lx = _local_amax(x, axis_name if x_gathered and fp8.x is None else None)
    lw = _local_amax(w)
    sx, sw = _scale_of(fp8.x, lx, E4M3), _scale_of(fp8.w, lw, E4M3)
    w_q = _quantized(w, sw)
    shared = QuantizedForward(
        x_like=x[:0],
        w_like=w[:0],
        w_q=w_q,
        x_scale=sx,
        w_scale=sw,
        grad_scale=fp8.grad,
        seen_x=_seen(fp8.x, lx, axis_name),
        seen_w=_seen(fp8.w, lw, axis_name),
    )
    return _quantized(x, sx), w_q, shared


def _quantize_grad(d, grad_scale, gathered_over: str | None = None):
    """``(d_q, its scale, d's amax)``: an output gradient in e5m2 with ``grad_scale`` or a
    current one. A ``d`` gathered over ``gathered_over`` takes the group's amax for its
    current scale, one scale for every chunk; a ``d`` whose partials each rank's GEMM
    dequantizes fits a local one (``gathered_over`` None)."""
    local_amax = amax(d, gathered_over if grad_scale is None else None)
    scale = _scale_of(grad_scale, local_amax, E5M2)
    return quantize(d, scale, E5M2), scale, local_amax


def _op_grads(res: AgResiduals | RsResiduals, dx, dw, grad_amax, axis_name: str):
    """``(dx, dw, the amaxes seen)`` as the fp8 ops' backward returns them: the gradients
    typed like their primals, the output gradient's amax reported where its scale was
    given."""
    seen = Fp8Scales(x=res.seen_x, w=res.seen_w, grad=_seen(res.grad_scale, grad_amax, axis_name))
    dx, dw = weight_grad_with(dx, dw)
    return _cotangent(dx, res.x_like), _cotangent(dw, res.w_like), seen


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fp8_all_gather_matmul(x, w, fp8: Fp8Scales, bias, group: Group, gelu: bool):
    """gelu?(all_gather(x) @ w + bias?) in fp8 (module docstring); ``group.path`` picks the
    custom call or XLA."""
    return ag_forward(x, w, fp8, bias, group, gelu)[0]


def ag_forward(x, w, fp8: Fp8Scales, bias, group: Group, gelu: bool):
    """fp8_all_gather_matmul's forward: (its result, its :class:`AgResiduals`)."""
    x_q, w_q, shared = _quantize_operands(x, w, fp8, group, x_gathered=True)
    sx, sw = shared.x_scale, shared.w_scale
    out_dtype = result_dtype(x, w)
    if out_dtype == jnp.float32:
        # cuBLASLt has no fp8 GEMM with a float32 output, float32 bias and GELU (it answered
        # NOT_SUPPORTED on an H200): with float32 outputs the epilogue runs in XLA after the op.
        out, g_q, _ = _ag(x_q, w_q.T, sx, sw, out_dtype=out_dtype, group=group)
        out, pre = epilogue(out, bias, "gelu" if gelu else None)
    else:
        out, g_q, pre = _ag(
            x_q, w_q.T, sx, sw, out_dtype=out_dtype, group=group, bias=bias, gelu=gelu
        )
    out, g_q = saved_output(out), saved_gathered(g_q)  # kept under remat (checkpoint_policy.py)
    res = AgResiduals(
        **shared._asdict(),
        gathered_q=g_q,
        pre_gelu=pre if gelu else None,
        bias_like=None if bias is None else bias[:0],
    )
    return out, res


def ag_product_grads(res: AgResiduals, dp, group: Group):
    """(dx, dw, the amaxes seen) of fp8_all_gather_matmul from ``dp``, the gradient of its
    product (after the epilogue's backward); ``res`` from :func:`ag_forward`."""
    dp_q, sg, lg = _quantize_grad(dp, res.grad_scale)  # dp's partials: a local scale
    # dx = reduce_scatter(dp @ w.T): w_q [k, n] is w.T stored k-major.
    dx = _rs(dp_q, res.w_q, sg, res.w_scale, out_dtype=dp.dtype, group=group)
    dw = _weight_grad(res.gathered_q, dp_q, res.x_scale * sg, dp.dtype)
    return _op_grads(res, dx, dw, lg, group.axis_name)


def _ag_bwd(group: Group, gelu: bool, res: AgResiduals, dy):
    dp, dbias = epilogue_grads(dy, res.pre_gelu, res.bias_like, gelu)
    return (*ag_product_grads(res, dp, group), dbias)


fp8_all_gather_matmul.defvjp(ag_forward, _ag_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_matmul_reduce_scatter(x, w, fp8: Fp8Scales, group: Group):
    """psum_scatter(x @ w) in fp8 (module docstring); ``group.path`` as above."""
    return rs_forward(x, w, fp8, group)[0]


def rs_forward(x, w, fp8: Fp8Scales, group: Group):
    """fp8_matmul_reduce_scatter's forward: (its result, its :class:`RsResiduals`)."""
    # Partials are dequantized by each rank's GEMM before they are summed: local scales fit.
    x_q, w_q, shared = _quantize_operands(x, w, fp8, group, x_gathered=False)
    sx, sw = shared.x_scale, shared.w_scale
    out = _rs(x_q, w_q.T, sx, sw, out_dtype=result_dtype(x, w), group=group)
    return saved_output(out), RsResiduals(**shared._asdict(), x_q=x_q)


def rs_grads(res: RsResiduals, dy, group: Group, dgelu_at=None):
    """(dx, dw, the amaxes seen) of fp8_matmul_reduce_scatter (``res`` from
    :func:`rs_forward`); with ``dgelu_at``, dx times gelu'(dgelu_at) (GELU's backward, in
    the dgrad GEMM's epilogue where it can run there)."""
    # dy is gathered: its current scale is the group's, one scale for every chunk.
    dy_q, sg, lg = _quantize_grad(dy, res.grad_scale, gathered_over=group.axis_name)
    # As for the float32 GELU above; and the benchmarks' A/B switch.
    fused = dgelu_at is not None and dy.dtype != jnp.float32 and options.tuning().dgelu_epilogue
    # dx = all_gather(dy) @ w.T, which hands back the gathered fp8 dy for dw.
    dx, dyg_q, _ = _ag(
        dy_q,
        res.w_q,
        sg,
        res.w_scale,
        out_dtype=dy.dtype,
        group=group,
        dgelu_at=dgelu_at if fused else None,
    )
    if dgelu_at is not None and not fused:
        dx = dgelu_reference(dx, dgelu_at)
    dw = _weight_grad(res.x_q, dyg_q, res.x_scale * sg, dy.dtype)
    return _op_grads(res, dx, dw, lg, group.axis_name)


def _rs_bwd(group: Group, res: RsResiduals, dy):
    return rs_grads(res, dy, group)


fp8_matmul_reduce_scatter.defvjp(rs_forward, _rs_bwd)
