"""matmul_reduce_scatter: psum_scatter(x @ w) with the scatter overlapped with the matmul."""

from __future__ import annotations

from functools import partial

import jax

from jax_ub._src import checks
from jax_ub._src.primitives import (
    bind_all_gather_matmul,
    bind_matmul_reduce_scatter,
    match_varying,
)
from jax_ub._src.reference import matmul_reduce_scatter_reference

_OP = "matmul_reduce_scatter"


def matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, axis_name: str, *, impl: str = "auto"
) -> jax.Array:
    """Multiply ``x @ w`` and reduce-scatter the rows over ``axis_name``, overlapped.

    Call inside ``jax.shard_map`` (under ``jit`` or not), like a ``lax`` collective.

    Args:
      x: local input ``[M, ..., k]`` (typically activations with ``k`` sharded over the
        axis); ``M`` must be divisible by the axis size ``tp``.
      w: local weight ``[k, n]`` (typically the row shard of a larger weight).
      axis_name: the mesh axis to reduce over.
      impl: ``"ub"``, ``"xla"`` or ``"auto"``, as for :func:`all_gather_matmul`.

    Returns:
      ``psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`` of shape
      ``[M / tp, ..., n]``: each rank keeps its block of rows of the summed product.

    The gradient is overlapped too: ``dx = all_gather_matmul(dy, w.T)`` and
    ``dw = x.T @ all_gather(dy)``, the gathered ``dy`` coming from that same op.

    Example::

        f = jax.jit(jax.shard_map(
            lambda h, w: jax_ub.matmul_reduce_scatter(h, w, "tp"),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
        y = f(h, w)  # == h @ w, row-sharded over tp
    """
    checks.check_impl(_OP, impl)
    checks.check_matmul_shapes(_OP, x, w)
    size = checks.bound_axis_size(_OP, axis_name)
    if x.shape[0] % size != 0:
        raise ValueError(
            f"{_OP}: rows of x ({x.shape[0]}) are not divisible by the size of axis "
            f"{axis_name!r} ({size}); {x.shape=}"
        )
    if not checks.use_ub(_OP, impl, x, w):
        return matmul_reduce_scatter_reference(x, w, axis_name)
    # impl="auto" falls back to XLA's collectives if the group's GPUs cannot share memory.
    out = _matmul_reduce_scatter(x.reshape(-1, x.shape[-1]), w, axis_name, size, impl == "auto")
    return out.reshape((x.shape[0] // size,) + x.shape[1:-1] + (w.shape[1],))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_reduce_scatter(x, w, axis_name, size, fallback):
    return bind_matmul_reduce_scatter(x, w, axis_name, size, fallback=fallback)


def _fwd(x, w, axis_name, size, fallback):
    return bind_matmul_reduce_scatter(x, w, axis_name, size, fallback=fallback), (x, w)


def _bwd(axis_name, size, fallback, res, dy):
    x, w = res
    # dx = all_gather(dy) @ w.T: the overlapped AG+GEMM, which also hands back the
    # gathered dy that dw needs, so dy is gathered exactly once.
    dx, dy_gathered = bind_all_gather_matmul(
        dy, w, axis_name, size, True, transpose_w=True, fallback=fallback
    )
    return match_varying(dx, x), match_varying(x.T @ dy_gathered, w)


_matmul_reduce_scatter.defvjp(_fwd, _bwd)
