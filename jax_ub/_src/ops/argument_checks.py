"""The checks of a call's arguments that the ops share."""

from __future__ import annotations

from jax_ub._src.ops import placement
from jax_ub._src.ops.epilogue import check_epilogue
from jax_ub._src.settings import checks


def check_arguments(
    op: str, x, w, *, impl: str, seq_axis: int, bias=None, activation=None, fp8=None
) -> int:
    """The checks of a call's arguments that the ops share (each raising with ``op``'s
    name); returns ``seq_axis`` normalised."""
    checks.check_impl(op, impl)
    checks.check_matmul_shapes(op, x, w)
    seq_axis = placement.check_seq_axis(op, x, seq_axis)
    check_epilogue(op, x, w, bias, activation)
    checks.check_fp8_operands(op, x, w, fp8)
    if fp8 is not None:
        checks.check_fp8_scales(op, fp8)
    return seq_axis
