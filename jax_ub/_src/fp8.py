"""fp8 for the overlapped ops: per-tensor scales, the two scaling recipes, and the ops' fp8
forward and backward.

With ``fp8=Fp8Scales(...)`` an op takes high-precision ``x`` and ``w`` (bfloat16, float16 or
float32), quantizes both to ``float8_e4m3fn`` (``x ~ x_q * x_scale``), moves and multiplies
fp8 (the all-gather moves half of bf16's bytes) and returns ``x.dtype``. The backward
quantizes the output gradient to ``float8_e5m2``: the input gradient is the swapped
overlapped op on fp8 operands, the weight gradient an fp8 product of the gathered fp8
activation (or gradient) kept by the forward, which is never gathered twice.
Quantization is transparent to autodiff (straight-through), as in fp8 training recipes.

``x`` or ``w`` (or both) may also come already quantized, ``float8_e4m3fn`` with its scale
in ``Fp8Scales`` (``x ~ x * fp8.x``), e.g. weights stored in fp8 for serving, or an
activation its producer quantized: the op uses it as it is. The result then has the other
operand's dtype (bfloat16 when both are fp8). Its gradient is the op's gradient cast to
fp8, as autodiff treats any cast; its scale gets no gradient (no amax is taken of it).

Scales, per tensor (per local shard for ``w`` and for tensors that are not gathered):
* current scaling: leave a field ``None``; the op uses this step's ``amax / fp8_max``
  (for a tensor that is all-gathered, the amax over the group, so one scale fits all
  its chunks);
* delayed scaling: pass a float32 scalar, e.g. :func:`delayed_scale` of an amax history
  carried in the model state, the same on every rank of the group. The gradient the op
  returns for such a field is this step's amax of its tensor (over the group), which the
  caller records with :func:`update_amax_history` (flax's OVERWRITE_WITH_GRADIENT
  convention). Fields left ``None`` get no gradient.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub._src import options
from jax_ub._src.epilogue import epilogue_grads
from jax_ub._src.primitives import bind_all_gather_matmul, bind_matmul_reduce_scatter
from jax_ub._src.reference import (
    all_gather_matmul_reference,
    dgelu_reference,
    epilogue,
    matmul_reduce_scatter_reference,
    pack_scales,
)
from jax_ub._src.remat import saved_gathered, saved_output
from jax_ub._src.varying import match_varying

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # activations and weights
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """Per-tensor fp8 scales of one op call: ``x ~ quantized(x) * x``; ``None`` for current
    scaling (see the module docstring). ``grad`` scales the output's gradient."""

    x: jax.Array | None = None
    w: jax.Array | None = None
    grad: jax.Array | None = None


def amax(a: jax.Array, axis_name: str | None = None) -> jax.Array:
    """max |a| as float32, over the group of ``axis_name`` too when given."""
    m = jnp.max(jnp.abs(a)).astype(jnp.float32)
    # A group of one needs no reduction (and JAX leaves a size-1 axis automatic, where
    # XLA refuses a cross-device reduction).
    if axis_name is None or lax.axis_size(axis_name) == 1:
        return m
    return lax.pmax(m, axis_name)


def scale_from_amax(a: jax.Array, dtype=E4M3) -> jax.Array:
    """The scale that maps amax ``a`` onto ``dtype``'s largest finite value (1 for 0)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.where(a > 0, a / fmax, 1.0).astype(jnp.float32)


def current_scale(a: jax.Array, dtype=E4M3, axis_name: str | None = None) -> jax.Array:
    """Current scaling: the scale of ``a`` itself (over the group of ``axis_name``)."""
    return scale_from_amax(amax(a, axis_name), dtype)


def delayed_scale(amax_history: jax.Array, dtype=E4M3) -> jax.Array:
    """Delayed scaling: the scale of the largest amax in a history (``[length]`` float32)."""
    return scale_from_amax(jnp.max(amax_history), dtype)


def update_amax_history(amax_history: jax.Array, new_amax: jax.Array) -> jax.Array:
    """The history with ``new_amax`` in front and its oldest entry dropped."""
    return jnp.roll(amax_history, 1).at[0].set(new_amax.astype(amax_history.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def delayed_scale_owg(amax_history: jax.Array, dtype=E4M3) -> jax.Array:
    """:func:`delayed_scale` of ``amax_history`` (``[length]`` float32) whose gradient is
    the history to keep: flax's OVERWRITE_WITH_GRADIENT convention, where a training step
    overwrites such a variable with its "gradient" instead of stepping along it.

    The cotangent arriving for the scale is the tensor's amax this step (what the ops
    return for a given scale); the history's gradient is then
    ``update_amax_history(amax_history, amax)``, or the history unchanged when that amax is
    not finite (as flax keeps its previous scale then). Use the scale once per step:
    cotangents of several uses would add up.
    """
    return delayed_scale(amax_history, dtype)


def _owg_fwd(amax_history, dtype):
    return delayed_scale(amax_history, dtype), amax_history


def _owg_bwd(dtype, amax_history, seen):
    recorded = update_amax_history(amax_history, seen)
    return (jnp.where(jnp.isfinite(seen), recorded, amax_history),)


delayed_scale_owg.defvjp(_owg_fwd, _owg_bwd)


def quantize(a: jax.Array, scale: jax.Array, dtype=E4M3) -> jax.Array:
    """``a / scale`` saturated to ``dtype``'s finite range and rounded to it."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(a.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def is_quantized(a) -> bool:
    """Whether ``a`` (an array or anything with a ``dtype``) is an fp8 operand."""
    dtype = jnp.dtype(a.dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def result_dtype(x, w) -> jnp.dtype:
    """The fp8 op's output dtype: the first operand given in high precision, else bf16."""
    for a in (x, w):
        if not is_quantized(a):
            return jnp.dtype(a.dtype)
    return jnp.dtype(jnp.bfloat16)


def compute_operands(x, w) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """``x`` and ``w`` as the implementation choice sees an fp8 call: both in its result
    dtype (the dtype its partial sums and output move in)."""
    dtype = result_dtype(x, w)
    return jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(w.shape, dtype)


def check_operands(
    op: str, x, w, fp8: object, names: tuple[str, str] = ("x", "w"), scales: str = "fp8"
) -> None:
    """A clear error for an fp8 operand without ``fp8`` scales, without its own scale, or
    in a format other than ``float8_e4m3fn``; ``names`` and ``scales`` name the operands
    and the scales argument in the message."""
    for field, label, a in (("x", names[0], x), ("w", names[1], w)):
        if not is_quantized(a):
            continue
        shapes = f"{names[0]}: {x.shape} {x.dtype}, {names[1]}: {w.shape} {w.dtype}"
        if jnp.dtype(a.dtype) != E4M3:
            raise ValueError(f"{op}: fp8 operands must be float8_e4m3fn, got {label}; {shapes}")
        where = f"fp8=jax_ub.Fp8Scales({field}=...)" if scales == "fp8" else f"{scales}.{field}"
        if fp8 is None:
            raise ValueError(
                f"{op}: {label} is already fp8: pass its scale as {where} ({label} ~ {label} * "
                f"scale); {shapes}"
            )
        if getattr(fp8, field, None) is None:
            raise ValueError(
                f"{op}: {label} is already fp8, so {scales}.{field} must be its scale (current "
                f"scaling needs the high-precision tensor), got None; {shapes}"
            )


def check_scales(op: str, fp8: object) -> None:
    """A clear error for anything but an Fp8Scales of float32 scalars (or None fields)."""
    if not isinstance(fp8, Fp8Scales):
        raise TypeError(f"{op}: fp8 must be a jax_ub.Fp8Scales, got {type(fp8).__name__}")
    for name in ("x", "w", "grad"):
        s = getattr(fp8, name)
        if s is None:
            continue
        shape, dtype = jnp.shape(s), jnp.result_type(s)
        if shape != () or dtype != jnp.float32:
            raise ValueError(
                f"{op}: fp8.{name} must be a float32 scalar scale, got shape={shape} dtype={dtype}"
            )


def _ag(
    x_q, w_t, sx, sw, out_dtype, axis_name, size, fallback, ub, bias=None, gelu=False, dgelu_at=None
):
    """(y, all_gather(x_q), GELU's input or an empty [0, ..., n]), y = gelu?(all_gather(x_q)
    @ w_t.T scaled by sx * sw + bias?), or with ``dgelu_at`` (GELU's input, laid out as y)
    that product times gelu'(dgelu_at), in the epilogue; ``w_t`` is the weight stored
    k-major, ``[n, k]``, as cuBLASLt's fp8 GEMMs read it."""
    scales = pack_scales(sx, sw)
    if ub:
        return bind_all_gather_matmul(
            x_q,
            w_t,
            axis_name,
            size,
            True,
            True,
            fallback,
            scales,
            out_dtype,
            bias,
            gelu,
            gelu,
            dgelu_at,
        )
    activation = "gelu" if gelu else None
    out, gathered, pre = all_gather_matmul_reference(
        x_q, w_t.T, axis_name, True, scales, out_dtype, bias, activation, True
    )
    return (out if dgelu_at is None else dgelu_reference(out, dgelu_at)), gathered, pre


def _rs(x_q, w_t, sx, sw, out_dtype, axis_name, size, fallback, ub):
    """psum_scatter(x_q @ w_t.T scaled by sx * sw); ``w_t`` as for :func:`_ag`."""
    scales = pack_scales(sx, sw)
    if ub:
        return bind_matmul_reduce_scatter(
            x_q, w_t, axis_name, size, True, fallback, scales, out_dtype
        )
    return matmul_reduce_scatter_reference(x_q, w_t.T, axis_name, scales, out_dtype)


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


def _seen(given, local_amax, axis_name):
    """The amax to report for a scale the caller gave (over the group), else None: no
    collective is traced for a gradient nobody asked for, nor for an operand given in fp8
    (``local_amax`` None)."""
    return None if given is None or local_amax is None else lax.pmax(local_amax, axis_name)


def _local_amax(a, axis_name=None):
    """amax of a high-precision operand (over ``axis_name``'s group if given); None for an
    operand given in fp8, whose scale the caller passed."""
    return None if is_quantized(a) else amax(a, axis_name)


def _quantized(a, scale):
    return a if is_quantized(a) else quantize(a, scale)


def _cotangent(d, primal_like):
    """A gradient typed like its primal (cast to fp8 for an operand given in fp8)."""
    return match_varying(d.astype(primal_like.dtype), primal_like)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def fp8_all_gather_matmul(x, w, fp8, bias, axis_name, size, fallback, ub, gelu):
    """gelu?(all_gather(x) @ w + bias?) in fp8 (module docstring); ``ub`` picks the custom
    call or XLA."""
    return ag_forward(x, w, fp8, bias, axis_name, size, fallback, ub, gelu)[0]


def ag_forward(x, w, fp8, bias, axis_name, size, fallback, ub, gelu):
    """fp8_all_gather_matmul's forward: (its result, the residuals its backward takes)."""
    # x is gathered: its current scale is the group's, one scale for every chunk.
    lx = _local_amax(x, axis_name if fp8.x is None else None)
    lw = _local_amax(w)
    sx, sw = _scale_of(fp8.x, lx, E4M3), _scale_of(fp8.w, lw, E4M3)
    w_q = _quantized(w, sw)
    x_q = _quantized(x, sx)
    out_dtype = result_dtype(x, w)
    if out_dtype == jnp.float32:
        # cuBLASLt has no fp8 GEMM with a float32 output, float32 bias and GELU (it answered
        # NOT_SUPPORTED on an H200): with float32 outputs the epilogue runs in XLA after the op.
        out, g_q, _ = _ag(x_q, w_q.T, sx, sw, out_dtype, axis_name, size, fallback, ub)
        out, pre = epilogue(out, bias, "gelu" if gelu else None)
    else:
        args = (x_q, w_q.T, sx, sw, out_dtype, axis_name, size, fallback, ub, bias, gelu)
        out, g_q, pre = _ag(*args)
    seen = (_seen(fp8.x, lx, axis_name), _seen(fp8.w, lw, axis_name))
    epilogue_res = (pre if gelu else None, None if bias is None else bias[:0])
    out, g_q = saved_output(out), saved_gathered(g_q)  # kept under remat (remat.py)
    return out, (x[:0], w[:0], w_q, g_q, sx, sw, fp8.grad, seen, epilogue_res)


def ag_product_grads(res, dp, axis_name, size, fallback, ub):
    """(dx, dw, the amaxes seen) of fp8_all_gather_matmul from ``dp``, the gradient of its
    product (after the epilogue's backward); ``res`` from :func:`ag_forward`."""
    x0, w0, w_q, g_q, sx, sw, given_grad, (ax, aw), _ = res
    lg = amax(dp)  # dp's partials are dequantized by each rank's GEMM: a local scale fits
    sg = _scale_of(given_grad, lg, E5M2)
    dp_q = quantize(dp, sg, E5M2)
    # dx = reduce_scatter(dp @ w.T): w_q [k, n] is w.T stored k-major.
    dx = _rs(dp_q, w_q, sg, sw, dp.dtype, axis_name, size, fallback, ub)
    dw = _weight_grad(g_q, dp_q, sx * sg, dp.dtype)
    seen = Fp8Scales(x=ax, w=aw, grad=_seen(given_grad, lg, axis_name))
    return _cotangent(dx, x0), _cotangent(dw, w0), seen


def _ag_bwd(axis_name, size, fallback, ub, gelu, res, dy):
    pre, bias_like = res[-1]
    dp, dbias = epilogue_grads(dy, pre, bias_like, gelu)
    return (*ag_product_grads(res, dp, axis_name, size, fallback, ub), dbias)


fp8_all_gather_matmul.defvjp(ag_forward, _ag_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def fp8_matmul_reduce_scatter(x, w, fp8, axis_name, size, fallback, ub):
    """psum_scatter(x @ w) in fp8 (module docstring); ``ub`` as above."""
    return rs_forward(x, w, fp8, axis_name, size, fallback, ub)[0]


def rs_forward(x, w, fp8, axis_name, size, fallback, ub):
    """fp8_matmul_reduce_scatter's forward: (its result, the residuals its backward takes)."""
    # Partials are dequantized by each rank's GEMM before they are summed: local scales fit.
    lx, lw = _local_amax(x), _local_amax(w)
    sx, sw = _scale_of(fp8.x, lx, E4M3), _scale_of(fp8.w, lw, E4M3)
    x_q, w_q = _quantized(x, sx), _quantized(w, sw)
    out = _rs(x_q, w_q.T, sx, sw, result_dtype(x, w), axis_name, size, fallback, ub)
    seen = (_seen(fp8.x, lx, axis_name), _seen(fp8.w, lw, axis_name))
    return saved_output(out), (x[:0], w[:0], x_q, w_q, sx, sw, fp8.grad, seen)


def rs_grads(res, dy, axis_name, size, fallback, ub, dgelu_at=None):
    """(dx, dw, the amaxes seen) of fp8_matmul_reduce_scatter (``res`` from
    :func:`rs_forward`); with ``dgelu_at``, dx times gelu'(dgelu_at) (GELU's backward, in
    the dgrad GEMM's epilogue where it can run there)."""
    x0, w0, x_q, w_q, sx, sw, given_grad, (ax, aw) = res
    # dy is gathered: its current scale is the group's, one scale for every chunk.
    lg = amax(dy, axis_name) if given_grad is None else amax(dy)
    sg = _scale_of(given_grad, lg, E5M2)
    # As for the float32 GELU above; and the benchmarks' A/B switch.
    fused = dgelu_at is not None and dy.dtype != jnp.float32 and options.tuning().dgelu_epilogue
    # dx = all_gather(dy) @ w.T, which hands back the gathered fp8 dy for dw.
    dy_q = quantize(dy, sg, E5M2)
    args = (dy_q, w_q, sg, sw, dy.dtype, axis_name, size, fallback, ub)
    dx, dyg_q, _ = _ag(*args, dgelu_at=dgelu_at if fused else None)
    if dgelu_at is not None and not fused:
        dx = dgelu_reference(dx, dgelu_at)
    dw = _weight_grad(x_q, dyg_q, sx * sg, dy.dtype)
    seen = Fp8Scales(x=ax, w=aw, grad=_seen(given_grad, lg, axis_name))
    return _cotangent(dx, x0), _cotangent(dw, w0), seen


def _rs_bwd(axis_name, size, fallback, ub, res, dy):
    return rs_grads(res, dy, axis_name, size, fallback, ub)


fp8_matmul_reduce_scatter.defvjp(rs_forward, _rs_bwd)
