"""all_gather_matmul: all_gather(x) @ w with the gather overlapped with the matmul."""

from __future__ import annotations

from functools import partial

import jax
from jax import lax

from jax_ub._src import checks
from jax_ub._src.primitives import (
    bind_all_gather_matmul,
    bind_matmul_reduce_scatter,
    match_varying,
)
from jax_ub._src.reference import all_gather_matmul_reference

_OP = "all_gather_matmul"


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    impl: str = "auto",
    return_gathered: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """All-gather the rows of ``x`` over ``axis_name`` and multiply by ``w``, overlapped.

    Call inside ``jax.shard_map`` (under ``jit`` or not), like a ``lax`` collective.

    Args:
      x: local row shard ``[m, ..., k]``; gathered along axis 0 (sequence-parallel input).
      w: local weight ``[k, n]`` (typically the column shard of a larger weight).
      axis_name: the mesh axis to gather over, of size ``tp``.
      impl: ``"ub"`` (userbuffer custom call), ``"xla"`` (lax reference), or ``"auto"``
        (``"ub"`` where this platform and dtype are supported, else ``"xla"``).
      return_gathered: also return ``all_gather(x)``, e.g. to keep it for a backward pass.

    Returns:
      ``all_gather(x, axis_name, tiled=True) @ w`` of shape ``[tp * m, ..., n]`` and, with
      ``return_gathered``, the gathered ``x`` of shape ``[tp * m, ..., k]``.

    The gradient is overlapped too: ``dx = matmul_reduce_scatter(dy, w.T)`` and
    ``dw = all_gather(x).T @ dy`` from the gathered ``x`` kept by the forward pass.

    Example::

        mesh = jax.sharding.Mesh(jax.devices()[:4], ("tp",))
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"),
            mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
        y = f(x, w)  # == x @ w, with the all-gather of x hidden behind the matmul
    """
    checks.check_impl(_OP, impl)
    checks.check_matmul_shapes(_OP, x, w)
    size = checks.bound_axis_size(_OP, axis_name)
    if not checks.use_ub(_OP, impl, x, w):
        return all_gather_matmul_reference(x, w, axis_name, return_gathered)
    x2 = x.reshape(-1, x.shape[-1])
    fallback = impl == "auto"  # to XLA's collectives if the group's GPUs cannot share memory
    if return_gathered:
        out, gathered = _all_gather_matmul_with_gathered(x2, w, axis_name, size, fallback)
        lead = (size * x.shape[0],) + x.shape[1:-1]
        return out.reshape(lead + (w.shape[1],)), gathered.reshape(lead + (x.shape[-1],))
    out = _all_gather_matmul(x2, w, axis_name, size, fallback)
    return out.reshape((size * x.shape[0],) + x.shape[1:-1] + (w.shape[1],))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _all_gather_matmul(x, w, axis_name, size, fallback):
    out, _ = bind_all_gather_matmul(x, w, axis_name, size, False, fallback=fallback)
    return out


def _fwd(x, w, axis_name, size, fallback):
    out, gathered = bind_all_gather_matmul(x, w, axis_name, size, True, fallback=fallback)
    # The backward needs only x's type (the mesh axes it varies over), not its values: an
    # empty slice carries that type without keeping the activation alive.
    return out, (x[:0], gathered, w)


def _bwd(axis_name, size, fallback, res, dy):
    x, gathered, w = res
    # dx = reduce_scatter(dy @ w.T): the overlapped GEMM+RS, reading w transposed in place.
    dx = bind_matmul_reduce_scatter(dy, w, axis_name, size, transpose_w=True, fallback=fallback)
    dw = gathered.T @ dy
    return match_varying(dx, x), match_varying(dw, w)


_all_gather_matmul.defvjp(_fwd, _bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _all_gather_matmul_with_gathered(x, w, axis_name, size, fallback):
    return tuple(bind_all_gather_matmul(x, w, axis_name, size, True, fallback=fallback))


def _fwd_gathered(x, w, axis_name, size, fallback):
    out, gathered = bind_all_gather_matmul(x, w, axis_name, size, True, fallback=fallback)
    return (out, gathered), (x[:0], gathered, w)


def _bwd_gathered(axis_name, size, fallback, res, cts):
    x, gathered, w = res
    dy, dgathered = cts
    dx = bind_matmul_reduce_scatter(dy, w, axis_name, size, transpose_w=True, fallback=fallback)
    dx = match_varying(dx, x) + match_varying(
        lax.psum_scatter(dgathered, axis_name, scatter_dimension=0, tiled=True), x
    )
    return dx, match_varying(gathered.T @ dy, w)


_all_gather_matmul_with_gathered.defvjp(_fwd_gathered, _bwd_gathered)
