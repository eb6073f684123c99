"""An op's weight gradient: its product (XLA's dot) and its place in the backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_ub._src.lowering.batch_layout import spec_axes
from jax_ub._src.lowering.varying import varying_axes
from jax_ub._src.settings.config import config


def contract_rows(a, b):
    """``a [rows, *batch, p]``, ``b [rows, *batch, q]`` -> ``a^T b`` of shape ``[p, q]``.

    The weight gradient is XLA's dot, not a custom call, so it follows ``allow_tf32`` here:
    XLA's default float32 dot on GPUs may run in TF32, which the ops' own GEMMs do only
    with ``allow_tf32``. 16-bit operands keep XLA's default: they have no TF32 to avoid,
    and HIGHEST would make XLA's GPU GEMM slower for nothing."""
    lead = tuple(range(a.ndim - 1))
    wide = all(jnp.dtype(t.dtype).itemsize >= 4 for t in (a, b))
    precision = lax.Precision.HIGHEST if wide and not config.allow_tf32 else None
    out_sharding = _summed_over_explicit_axes(a, b)
    if out_sharding is not None:
        return jnp.einsum(
            a,
            (*lead, a.ndim - 1),
            b,
            (*lead, a.ndim),
            (a.ndim - 1, a.ndim),
            precision=precision,
            out_sharding=out_sharding,
        )
    return jnp.tensordot(a, b, axes=(lead, lead), precision=precision)


def _summed_over_explicit_axes(a, b):
    """Where the rows (a batch dim, say) are split over an Explicit mesh axis, JAX asks the
    product for its output's sharding: the sum over that axis is replicated, the columns
    keep theirs. None where no such axis (and JAX needs nothing)."""
    specs = []
    for t in (a, b):
        sharding = getattr(jax.typeof(t), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not mesh.axis_names:
            return None
        specs.append(tuple(sharding.spec) + (None,) * (t.ndim - len(sharding.spec)))
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    rows = {a for spec in specs for e in spec[:-1] for a in spec_axes(e)}
    if not rows & explicit:
        return None
    clash = set(spec_axes(specs[1][-1])) & set(spec_axes(specs[0][-1]))
    return P(specs[0][-1], None if clash else specs[1][-1])


def weight_grad_with(dx, dw):
    """``(dx, dw)`` of an op's backward, dx's consumers made to wait for dw.

    The weight gradient's product reads what only it still needs (the gathered ``dy`` an
    AG+GEMM handed back, the gathered or kept ``x``), and its result is needed only by the
    optimizer at the end of the step. XLA's scheduler, with device memory to spare, may put
    every layer's weight-gradient GEMM there, keeping every layer's gathered operands
    alive until then: 1.5 GiB more at the peak of an 8-layer Llama 3 8B step at seq 8192 on
    2 GPUs (``benchmarks/tools/step_memory.py``). Tied to dx, each runs within its own
    layer's backward, as XLA's own collectives' weight gradients do, at no measurable cost
    in step time.

    Call it before casting either to its input's varying axes: the barrier's result varies
    over the union of both (the same axes here, both being products of ``dy`` with the
    op's operands); where dw would widen dx's, the two are returned untied."""
    if not varying_axes(dw) <= varying_axes(dx):
        return dx, dw
    return lax.optimization_barrier((dx, dw))
