"""gelu_mlp in fp8: the two fp8 ops of the block under one VJP, so that GELU's backward runs
in the epilogue of the fp8 GEMM that computes the down-projection's input gradient.

Forward: ``h = gelu(all_gather(x) @ w_up + up_bias)`` (bias and GELU in the up-projection's
fp8 GEMMs, GELU's input kept), then ``psum_scatter(h @ w_down)``, each quantized as the ops
quantize (:mod:`jax_ub._src.ops.fp8_ops`). Backward: ``dp = (all_gather(dy) @ w_down.T) *
gelu'(pre)`` in one fp8 all-gather GEMM with cuBLASLt's DGELU epilogue (what the two ops
written one after the other do in a pass of their own over ``[seq, ffn/tp]``), then the
up-projection's gradients from ``dp`` exactly as its op computes them.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax

from jax_ub._src.ops.epilogue import bias_grad
from jax_ub._src.ops.fp8_ops import (
    AgResiduals,
    RsResiduals,
    ag_forward,
    ag_product_grads,
    rs_forward,
    rs_grads,
)
from jax_ub._src.ops.group import Group
from jax_ub._src.settings.fp8 import Fp8Scales


class Residuals(NamedTuple):
    """What fp8_gelu_mlp's forward keeps for its backward: each projection's own."""

    up: AgResiduals
    down: RsResiduals


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def fp8_gelu_mlp(x, w_up, up_bias, w_down, up: Fp8Scales, down: Fp8Scales, group: Group):
    """``psum_scatter(gelu(all_gather(x) @ w_up + up_bias) @ w_down)`` in fp8 with the
    up-projection's scales ``up`` and the down-projection's ``down`` (``Fp8Scales``; down.x
    scales the hidden activation)."""
    return _fwd(x, w_up, up_bias, w_down, up, down, group)[0]


def _fwd(x, w_up, up_bias, w_down, up, down, group: Group):
    h, up_res = ag_forward(x, w_up, up, up_bias, group, gelu=True)
    y, down_res = rs_forward(h, w_down, down, group)
    return y, Residuals(up=up_res, down=down_res)


def _bwd(group: Group, res: Residuals, dy):
    # GELU's backward at its input (kept by the up-projection's epilogue), in the epilogue
    # of the GEMM computing the down-projection's input gradient.
    dp, dw_down, seen_down = rs_grads(res.down, dy, group, dgelu_at=res.up.pre_gelu)
    dx, dw_up, seen_up = ag_product_grads(res.up, dp, group)
    return dx, dw_up, bias_grad(dp, res.up.bias_like), dw_down, seen_up, seen_down


fp8_gelu_mlp.defvjp(_fwd, _bwd)
