"""What the ops share: the checks of a call's arguments, and the weight gradient's place in
the backward."""

from __future__ import annotations

from jax import lax

from jax_ub._src.lowering import layout
from jax_ub._src.lowering.varying import varying_axes
from jax_ub._src.ops.epilogue import check_epilogue
from jax_ub._src.settings import checks


def check_arguments(op: str, x, w, impl: str, seq_axis: int, bias, activation, fp8) -> int:
    """The checks of a call's arguments that the ops share (each raising with ``op``'s
    name); returns ``seq_axis`` normalised."""
    checks.check_impl(op, impl)
    checks.check_matmul_shapes(op, x, w)
    seq_axis = layout.check_seq_axis(op, x, seq_axis)
    check_epilogue(op, x, w, bias, activation)
    checks.check_fp8_operands(op, x, w, fp8)
    if fp8 is not None:
        checks.check_fp8_scales(op, fp8)
    return seq_axis


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
