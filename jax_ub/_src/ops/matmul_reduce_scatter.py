"""matmul_reduce_scatter: psum_scatter(x @ w) + bias, the scatter overlapped with the matmul."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_ub._src.lowering.unfused import matmul_reduce_scatter_reference
from jax_ub._src.lowering.varying import match_varying
from jax_ub._src.ops import driver
from jax_ub._src.ops.argument_checks import check_arguments
from jax_ub._src.ops.checkpoint_policy import saved_output
from jax_ub._src.ops.fp8_ops import fp8_matmul_reduce_scatter
from jax_ub._src.ops.group import Group
from jax_ub._src.ops.path import Bodies
from jax_ub._src.ops.weight_grad import contract_rows, weight_grad_with
from jax_ub._src.settings.fp8 import Fp8Scales

_OP = "matmul_reduce_scatter"


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    bias: jax.Array | None = None,
    impl: str = "auto",
    fp8: Fp8Scales | None = None,
    seq_axis: int = 0,
) -> jax.Array:
    """Multiply ``x @ w`` and reduce-scatter the rows over ``axis_name``, overlapped; then
    add ``bias``.

    Called inside ``jax.shard_map`` (partial-auto too) on local shards, or on global arrays
    under ``jax.set_mesh(mesh)``, as :func:`all_gather_matmul`. On global arrays ``x
    [seq, ..., K]`` is sharded ``P(None, ..., axis_name)`` (features), ``w [K, n]``
    ``P(axis_name, None)``, and the result ``x @ w`` comes back sequence-sharded
    ``P(axis_name)`` (``P(None, axis_name)`` with ``seq_axis=1``).

    Args:
      x: local input ``[M, ..., k]`` (typically activations with ``k`` sharded over the
        axis); ``M`` must be divisible by the axis size ``tp``.
      w: local weight ``[k, n]`` (typically the row shard of a larger weight).
      axis_name: the mesh axis to reduce over.
      bias: ``[n]``, the same on every rank (a row-parallel layer's bias), added once to
        the reduced rows; cast to the output's dtype. XLA fuses the add with what
        consumes the result (a residual add, typically): it costs no pass of its own.
      impl: ``"ub"``, ``"xla"`` or ``"auto"``, as for :func:`all_gather_matmul`.
      fp8: run in fp8 with these scales, as for :func:`all_gather_matmul` (operands given
        in fp8 too); the partial sums the scatter moves are the result's dtype.
      seq_axis: the dim of ``x`` (and of the result) scattered over ``axis_name``: 0 for
        ``[M, ..., k]``, 1 for batch-major ``[batch, seq, ..., k]``, as for
        :func:`all_gather_matmul`.

    Returns:
      ``psum_scatter(x @ w, axis_name, scatter_dimension=seq_axis, tiled=True) + bias``, of
      shape ``[M / tp, ..., n]`` for ``seq_axis=0``: each rank keeps its block of rows of
      the summed product.

    The gradient is overlapped too: ``dx = all_gather_matmul(dy, w.T)`` and
    ``dw = x.T @ all_gather(dy)``, the gathered ``dy`` coming from that same op.

    Example::

        f = jax.jit(jax.shard_map(
            lambda h, w: jax_ub.matmul_reduce_scatter(h, w, "tp"),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
        y = f(h, w)  # == h @ w, row-sharded over tp
    """
    seq_axis = check_arguments(_OP, x, w, impl=impl, seq_axis=seq_axis, bias=bias, fp8=fp8)
    call = driver.Call(_OP, driver.SCATTER, axis_name, impl, seq_axis, fp8=fp8 is not None)

    def body(call, x, w, extra):
        return scattered_product(call, x, w, extra.bias, extra.fp8)

    extra = driver.Extra(bias=bias, fp8=fp8)  # replicated
    return driver.run(call, body, driver.one_gemm, x, w, extra)


def scattered_product(call: driver.Call, x, w, bias=None, fp8=None):
    """The op on a rank's rows ``x [M, *batch, k]``: this rank's block of the summed
    product plus ``bias``, ``[M / tp, *batch, n]``, on the call's path."""
    y = _BODIES(call, x, w, fp8)
    return y if bias is None else y + jnp.asarray(bias, y.dtype)


_BODIES = Bodies(
    ub=lambda call, x, w, fp8: _matmul_reduce_scatter(x, w, call.group()),
    unfused=lambda call, x, w, fp8: matmul_reduce_scatter_reference(
        x, w, call.axis_name, collectives=call.path.collectives
    ),
    fp8=lambda call, x, w, fp8: fp8_matmul_reduce_scatter(x, w, fp8, call.group()),
)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, group: Group):
    return group.matmul_reduce_scatter(x, w)


def _fwd(x, w, group: Group):
    out = group.matmul_reduce_scatter(x, w)
    return saved_output(out), (x, w)  # kept under remat (checkpoint_policy.py)


def _bwd(group: Group, res, dy):
    x, w = res
    # dx = all_gather(dy) @ w.T: the overlapped AG+GEMM, which also hands back the
    # gathered dy that dw needs, so dy is gathered exactly once.
    dx, dy_gathered = group.gather_times_w_t(dy, w)
    dx, dw = weight_grad_with(dx, contract_rows(x, dy_gathered))
    return match_varying(dx, x), match_varying(dw, w)


_matmul_reduce_scatter.defvjp(_fwd, _bwd)
