"""The gated MLP block's pieces shared by the nnx and linen layers: its params' names, its
fp8 check, and the per-configuration function that runs :func:`jax_ub.gated_mlp` (or, on a
sequence ``tp`` does not divide, the same math with replicated activations)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.gated_mlp import activation_function
from jax_ub.flax import _fp8
from jax_ub.flax._core import (
    _over_tp,
    _promote,
    _scales,
    activation_spec,
    linear_replicated,
    param_names,
)


def gated_kernel_names(owner: str, axis_name: str, other_axes: Any) -> dict[str, tuple]:
    """Sharding names of a gated MLP's ``gate_up`` kernel ``[in, 2, hidden]`` (hidden split
    over ``axis_name``, ``other_axes`` on ``in``) and its row-parallel ``down_proj``."""
    row = param_names(owner, "row", axis_name, False, other_axes)
    return {"gate_up": (other_axes, None, axis_name), "down_proj": row["kernel"]}


def check_gated_fp8(owner: str, fp8: Any) -> None:
    if _fp8.recipe(fp8) == "delayed":
        raise ValueError(
            f"{owner}: fp8='delayed' is not available for the gated MLP yet; use fp8=True "
            "(current scaling)"
        )


@functools.lru_cache(maxsize=256)
def gated_mlp_call(
    mesh: Mesh | None,
    axis_name: str,
    impl: str,
    dtype: Any,
    fp8: str | None,
    seq_axis: int,
    activation: Any,
    ndim: int,
    sequence_parallel: bool = True,
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``f(x, gate_up, down)``: :func:`jax_ub.gated_mlp`, sequence-sharded (or with the
    activations replicated over the axis, as :func:`linear_replicated`)."""
    seq = seq_axis % ndim

    def replicated(x, gate_up, down, axis_name=axis_name):
        k, _, f = gate_up.shape
        kw = dict(axis_name=axis_name, dtype=dtype, fp8=fp8)
        gu = linear_replicated("column", x, {"kernel": gate_up.reshape(k, 2 * f)}, **kw)
        act = activation_function(activation)
        return linear_replicated("row", act(gu[..., :f]) * gu[..., f:], {"kernel": down}, **kw)

    def body(x, gate_up, down):
        x, gate_up, down = _promote(dtype, x, gate_up, down)
        scales = None if fp8 is None else (_scales(fp8, {}), _scales(fp8, {}))
        return jax_ub.gated_mlp(
            x,
            gate_up,
            down,
            axis_name,
            activation=activation,
            impl=impl,
            fp8=scales,
            seq_axis=seq,
        )

    spec = activation_spec(ndim, axis_name, seq, sequence_parallel)
    kernels = (P(None, None, axis_name), P(axis_name, None))
    f = body if sequence_parallel else replicated
    plain = functools.partial(replicated, axis_name=None)
    return _over_tp(f, mesh, axis_name, (spec, *kernels), spec, plain, impl)
