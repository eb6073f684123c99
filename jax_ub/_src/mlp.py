"""gelu_mlp: a sequence-parallel GELU MLP whose backward runs GELU's gradient in a GEMM epilogue.

Written with the two ops, the block's backward would compute the down-projection's input
gradient ``dh = all_gather(dy) @ w_down.T``, then ``dp = dh * gelu'(pre)`` in a pass of its
own over ``[seq, ffn/tp]`` (read dh and pre, write dp). Here that all-gather GEMM ends with
cuBLASLt's DGELU epilogue instead, reading GELU's input (kept by the forward) and writing
``dp`` directly.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_ub._src import checks, options
from jax_ub._src.all_gather_matmul import all_gather_matmul, contract_rows
from jax_ub._src.epilogue import bias_grad, check_epilogue
from jax_ub._src.matmul_reduce_scatter import matmul_reduce_scatter
from jax_ub._src.primitives import bind_all_gather_matmul, bind_matmul_reduce_scatter
from jax_ub._src.reference import dgelu_reference
from jax_ub._src.varying import match_varying

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
) -> jax.Array:
    """``matmul_reduce_scatter(gelu(all_gather_matmul(x, w_up) + up_bias), w_down) + down_bias``.

    A tensor-parallel MLP block on sequence-parallel activations, with GELU's tanh
    approximation: the up-projection's bias and GELU run in its GEMMs' epilogue, and the
    backward's GELU gradient in the epilogue of the GEMM that computes it (see the module
    docstring). Equal to writing the block with :func:`all_gather_matmul` and
    :func:`matmul_reduce_scatter`, which is what runs where the userbuffer path does not
    (``impl="xla"``, ``"auto"`` choosing XLA, global arrays outside ``shard_map``).

    Args:
      x: local rows ``[m, ..., k]``, sequence-sharded over ``axis_name``.
      w_up: ``[k, f]``, the up-projection's column shard.
      w_down: ``[f, n]``, the down-projection's row shard.
      axis_name: the tensor-parallel mesh axis, of size ``tp``.
      up_bias: ``[f]``, sharded like ``w_up``'s columns.
      down_bias: ``[n]``, the same on every rank, added once after the reduction.
      impl: ``"ub"``, ``"xla"`` or ``"auto"``, as for :func:`all_gather_matmul`.

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
    if w_down.ndim != 2 or w_down.shape[0] != w_up.shape[1]:
        raise ValueError(
            f"{_OP}: w_down must be [f, n] with f = w_up.shape[1] = {w_up.shape[1]}; "
            f"{w_up.shape=} {w_down.shape=}"
        )
    check_epilogue(_OP, x, w_up, up_bias, "gelu")
    check_epilogue(_OP, x, w_down, down_bias, None)
    size = checks.bound_axis_size(_OP, axis_name)
    fused = size is not None
    if fused:
        hidden = jax.ShapeDtypeStruct((size * x.shape[0], *x.shape[1:-1], w_up.shape[1]), x.dtype)
        # Each projection as its own op would decide (the rule counts each op's bytes).
        fused = checks.use_ub("all_gather_matmul", impl, x, w_up, axis_size=size)
        fused = fused and checks.use_ub(
            "matmul_reduce_scatter", impl, hidden, w_down, axis_size=size
        )
    if not fused:  # the same block from the two ops, each taking its own path
        h = all_gather_matmul(x, w_up, axis_name, bias=up_bias, activation="gelu", impl=impl)
        return matmul_reduce_scatter(h, w_down, axis_name, bias=down_bias, impl=impl)
    if up_bias is not None:
        up_bias = jnp.asarray(up_bias, x.dtype)
    y = _gelu_mlp(x, w_up, up_bias, w_down, axis_name, size, impl == "auto")
    return y if down_bias is None else y + jnp.asarray(down_bias, y.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gelu_mlp(x, w_up, up_bias, w_down, axis_name, size, fallback):
    return _fwd(x, w_up, up_bias, w_down, axis_name, size, fallback)[0]


def _fwd(x, w_up, up_bias, w_down, axis_name, size, fallback):
    h, gathered, pre = bind_all_gather_matmul(
        x,
        w_up,
        axis_name,
        size,
        True,
        fallback=fallback,
        bias=up_bias,
        gelu=True,
        keep_pre_gelu=True,
    )
    y = bind_matmul_reduce_scatter(h, w_down, axis_name, size, fallback=fallback)
    bias_like = None if up_bias is None else up_bias[:0]
    return y, (x[:0], gathered, w_up, pre, h, w_down, bias_like)


def _bwd(axis_name, size, fallback, res, dy):
    x, gathered, w_up, pre, h, w_down, bias_like = res
    # dp = (all_gather(dy) @ w_down.T) * gelu'(pre): the down-projection's input gradient
    # with GELU's backward in its epilogue; the gathered dy is the down weight's gradient's.
    fused_dgelu = options.tuning().dgelu_epilogue
    w_t, in_place = options.weight_transposed(w_down)
    dp, dy_gathered, _ = bind_all_gather_matmul(
        dy,
        w_t,
        axis_name,
        size,
        True,
        transpose_w=in_place,
        fallback=fallback,
        gelu_input=pre if fused_dgelu else None,
    )
    if not fused_dgelu:
        dp = dgelu_reference(dp, pre)
    w_t, in_place = options.weight_transposed(w_up)
    dx = bind_matmul_reduce_scatter(
        dp, w_t, axis_name, size, transpose_w=in_place, fallback=fallback
    )
    return (
        match_varying(dx, x),
        match_varying(contract_rows(gathered, dp), w_up),
        bias_grad(dp, bias_like),
        match_varying(contract_rows(h, dy_gathered), w_down),
    )


_gelu_mlp.defvjp(_fwd, _bwd)
