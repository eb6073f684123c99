"""gelu_mlp: a sequence-parallel GELU MLP whose backward runs GELU's gradient in a GEMM epilogue.

Written with the two ops, the block's backward would compute the down-projection's input
gradient ``dh = all_gather(dy) @ w_down.T``, then ``dp = dh * gelu'(pre)`` in a pass of its
own over ``[seq, ffn/tp]`` (read dh and pre, write dp). Here that all-gather GEMM ends with
cuBLASLt's DGELU epilogue instead, reading GELU's input (kept by the forward) and writing
``dp`` directly.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ub._src.lowering.unfused import dgelu_reference
from jax_ub._src.lowering.varying import match_varying
from jax_ub._src.ops import driver, placement
from jax_ub._src.ops.all_gather_matmul import gathered_product
from jax_ub._src.ops.epilogue import bias_grad, check_epilogue
from jax_ub._src.ops.fp8_mlp import fp8_gelu_mlp
from jax_ub._src.ops.group import Group
from jax_ub._src.ops.kept_input import KeptInput
from jax_ub._src.ops.matmul_reduce_scatter import scattered_product
from jax_ub._src.ops.path import Path
from jax_ub._src.ops.weight_grad import contract_rows, weight_grad_with
from jax_ub._src.settings import checks, options
from jax_ub._src.settings.fp8 import Fp8Scales, result_dtype

_OP = "gelu_mlp"


def gelu_mlp(
    x: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    axis_name: str,
    *,
    up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    impl: str = "auto",
    fp8: tuple[Fp8Scales, Fp8Scales] | None = None,
    seq_axis: int = 0,
) -> jax.Array:
    """``matmul_reduce_scatter(gelu(all_gather_matmul(x, w_up) + up_bias), w_down) + down_bias``.

    A tensor-parallel MLP block on sequence-parallel activations, with GELU's tanh
    approximation: the up-projection's bias and GELU run in its GEMMs' epilogue, and the
    backward's GELU gradient in the epilogue of the GEMM that computes it (see the module
    docstring). Equal to writing the block with :func:`all_gather_matmul` and
    :func:`matmul_reduce_scatter`, which is what runs where the userbuffer path does not
    (``impl="xla"``, or ``"auto"`` choosing XLA for either projection). Called inside
    ``jax.shard_map`` or on global arrays under ``jax.set_mesh``, as the ops.

    Args:
      x: local rows ``[m, ..., k]``, sequence-sharded over ``axis_name``.
      w_up: ``[k, f]``, the up-projection's column shard.
      w_down: ``[f, n]``, the down-projection's row shard.
      axis_name: the tensor-parallel mesh axis, of size ``tp``.
      up_bias: ``[f]``, sharded like ``w_up``'s columns.
      down_bias: ``[n]``, the same on every rank, added once after the reduction.
      impl: ``"ub"``, ``"xla"`` or ``"auto"``, as for :func:`all_gather_matmul`.
      fp8: ``(up, down)``, two :class:`jax_ub.Fp8Scales`: both projections in fp8, as
        :func:`all_gather_matmul` with ``fp8=up`` and :func:`matmul_reduce_scatter` with
        ``fp8=down`` run them (``down.x`` scales the hidden activation); GELU's gradient
        runs in the epilogue of the fp8 GEMM that computes it.
      seq_axis: the sequence dim of ``x`` (and of the result): 0 for ``[m, ..., k]``, 1 for
        batch-major ``[batch, m, ..., k]``, as for :func:`all_gather_matmul`. Other than 0
        no rows move: the hidden activation stays in the gather's rank-major order, which
        GELU and the reduce-scatter take as it is.

    Returns:
      ``[m, ..., n]``, sequence-sharded like ``x``.

    Example::

        f = jax.jit(jax.shard_map(
            lambda x, w1, w2: jax_ub.gelu_mlp(x, w1, w2, "tp"),
            mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp")))
        y = f(x, w1, w2)  # == jax.nn.gelu(x @ w1) @ w2, row-sharded over tp
    """
    checks.check_impl(_OP, impl)
    checks.check_matmul_shapes(_OP, x, w_up)
    seq_axis = placement.check_seq_axis(_OP, x, seq_axis)
    if w_down.ndim != 2 or w_down.shape[0] != w_up.shape[1]:
        raise ValueError(
            f"{_OP}: w_down must be [f, n] with f = w_up.shape[1] = {w_up.shape[1]}; "
            f"{w_up.shape=} {w_down.shape=}"
        )
    check_epilogue(_OP, x, w_up, up_bias, "gelu")
    check_epilogue(_OP, x, w_down, down_bias, None)
    up, down = checks.check_fp8_pair(_OP, fp8, "(up, down)")
    dtype = x.dtype if fp8 is None else result_dtype(x, w_up)  # of the hidden activation
    checks.check_fp8_operands(_OP, x, w_up, up, ("x", "w_up"), "fp8[0]")
    hidden_rows = jax.ShapeDtypeStruct((*x.shape[:-1], w_up.shape[1]), dtype)
    checks.check_fp8_operands(
        _OP, hidden_rows, w_down, down, ("the hidden activation", "w_down"), "fp8[1]"
    )
    call = driver.Call(
        _OP,
        driver.BLOCK,
        axis_name,
        impl,
        seq_axis,
        fp8=fp8 is not None,
        divides=(("columns of w_up", w_up.shape[1]),),
    )
    extra = driver.Extra(bias=up_bias, fp8=fp8, w_down=w_down, down_bias=down_bias)
    # up_bias's columns are w_up's, w_down's rows too; down_bias and the scales replicated.
    specs = driver.Extra.specs(bias=P(axis_name), w_down=P(axis_name, None))
    return driver.run(call, _block, _route, x, w_up, extra, specs)


def _route(call: driver.Call, x, w_up, extra: driver.Extra) -> tuple[Path, Path]:
    """The paths of the up- and the down-projection, each as its own op would decide (the
    rule counts each op's bytes), on a rank's rows ``x [m, *batch, k]``."""
    w_down, fp8 = extra.w_down, extra.fp8
    up, down = (None, None) if fp8 is None else fp8
    dtype = x.dtype if fp8 is None else result_dtype(x, w_up)
    hidden = jax.ShapeDtypeStruct((call.size * x.shape[0], *x.shape[1:-1], w_up.shape[1]), dtype)
    return (
        call.choose(x, w_up, up, op="all_gather_matmul"),
        call.choose(hidden, w_down, down, op="matmul_reduce_scatter"),
    )


def _block(call: driver.Call, x, w_up, extra: driver.Extra):
    """The block on a rank's rows ``x [m, *batch, k]``: fused where both projections run
    the userbuffer op, else the two ops, each on its own path."""
    up_bias, fp8, w_down, down_bias = extra
    up, down = (None, None) if fp8 is None else fp8
    if call.paths[0] != call.paths[1] or not call.paths[0].calls_ub:  # the two ops
        up_path, down_path = call.paths
        ag = call.on("all_gather_matmul", driver.GATHER, up_path)
        h = gathered_product(ag, x, w_up, up_bias, up, activation="gelu")
        rs = call.on("matmul_reduce_scatter", driver.SCATTER, down_path)
        return scattered_product(rs, h, w_down, down_bias, down)
    if up_bias is not None:
        up_bias = jnp.asarray(up_bias, x.dtype if fp8 is None else result_dtype(x, w_up))
    group = call.group()
    if fp8 is None:
        y = _gelu_mlp(x, w_up, up_bias, w_down, group)
    else:
        y = fp8_gelu_mlp(x, w_up, up_bias, w_down, up, down, group)
    return y if down_bias is None else y + jnp.asarray(down_bias, y.dtype)


class _Residuals(NamedTuple):
    x_like: jax.Array  # an empty slice of x: its dtype and the mesh axes it varies over
    x_kept: KeptInput  # all_gather(x) or x's shard, for w_up's gradient
    w_up: jax.Array
    pre_gelu: jax.Array  # GELU's input
    h: jax.Array  # GELU's output, for w_down's gradient
    w_down: jax.Array
    bias_like: jax.Array | None  # an empty slice of up_bias, where there is one


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gelu_mlp(x, w_up, up_bias, w_down, group: Group):
    return _fwd(x, w_up, up_bias, w_down, group)[0]


def _fwd(x, w_up, up_bias, w_down, group: Group):
    h, gathered, pre = group.all_gather_matmul(
        x,
        w_up,
        return_gathered=KeptInput.keeps_gathered(),
        bias=up_bias,
        gelu=True,
        keep_pre_gelu=True,
    )
    y = group.matmul_reduce_scatter(h, w_down)
    bias_like = None if up_bias is None else up_bias[:0]
    return y, _Residuals(x[:0], KeptInput.of(x, gathered), w_up, pre, h, w_down, bias_like)


def _bwd(group: Group, res: _Residuals, dy):
    # dp = (all_gather(dy) @ w_down.T) * gelu'(pre): the down-projection's input gradient
    # with GELU's backward in its epilogue; the gathered dy is the down weight's gradient's.
    fused_dgelu = options.tuning().dgelu_epilogue
    dp, dy_gathered = group.gather_times_w_t(
        dy, res.w_down, gelu_input=res.pre_gelu if fused_dgelu else None
    )
    if not fused_dgelu:
        dp = dgelu_reference(dp, res.pre_gelu)
    dw_down = contract_rows(res.h, dy_gathered)
    dp, dw_down = weight_grad_with(dp, dw_down)
    dx, x_gathered = res.x_kept.input_grad_and_gathered(group, dp, res.w_up)
    dx, dw_up = weight_grad_with(dx, contract_rows(x_gathered, dp))
    return (
        match_varying(dx, res.x_like),
        match_varying(dw_up, res.w_up),
        bias_grad(dp, res.bias_like),
        match_varying(dw_down, res.w_down),
    )


_gelu_mlp.defvjp(_fwd, _bwd)
