"""The gated MLP block's pieces shared by the nnx and linen layers: its params' and amax
histories' names, and the per-configuration function that runs :func:`jax_ub.gated_mlp`
(or, on a sequence ``tp`` does not divide, the same math with replicated activations)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.gated_mlp import activation_function
from jax_ub.flax import _axes, _fp8
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


def logical_kernel_names(owner: str, kernel_axes: Any, param_axes: Any) -> dict[str, tuple]:
    """The kernels' logical names from ``kernel_axes`` ``(model dim, split dim)``, which
    the user's logical_axis_rules map to mesh axes."""
    model, split = _axes.logical_param_names("column", kernel_axes, owner, param_axes)["kernel"]
    return {"gate_up": (model, None, split), "down_proj": (split, model)}


# fp8="delayed": each projection's three amax histories (_fp8's), as variables named
# f"{projection}_{flax's name}", e.g. "gate_up_input_amax_history".
PROJECTIONS = ("gate_up", "down_proj")
HISTORY_NAMES = {
    p: {k: f"{p}_{name}" for k, name in _fp8.HISTORY_NAMES.items()} for p in PROJECTIONS
}


def histories(fp8: Any, read: Callable[[str], jax.Array]) -> tuple:
    """The :func:`gated_mlp_call` operand of the amax histories, ``{projection: {"x", "w",
    "grad"}}`` from ``read(variable name)``, for ``fp8="delayed"``; else none."""
    if _fp8.recipe(fp8) != "delayed":
        return ()
    return ({p: {k: read(n) for k, n in names.items()} for p, names in HISTORY_NAMES.items()},)


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
) -> Callable[..., jax.Array]:
    """``f(x, gate_up, down)``: :func:`jax_ub.gated_mlp`, sequence-sharded (or with the
    activations replicated over the axis, as :func:`linear_replicated`). With
    ``fp8="delayed"``, ``f(x, gate_up, down, hist)``, ``hist`` the amax histories of
    :func:`histories`, replicated; their gradients are the histories with this step's
    amaxes rolled in front."""
    seq = seq_axis % ndim

    def replicated(x, gate_up, down, hist=None, axis_name=axis_name):
        k, _, f = gate_up.shape
        kw = dict(axis_name=axis_name, dtype=dtype, fp8=fp8)
        p_gate_up = _params("gate_up", gate_up.reshape(k, 2 * f), hist)
        gu = linear_replicated("column", x, p_gate_up, **kw)
        hidden = activation_function(activation)(gu[..., :f]) * gu[..., f:]
        return linear_replicated("row", hidden, _params("down_proj", down, hist), **kw)

    def body(x, gate_up, down, hist=None):
        x, gate_up, down = _promote(dtype, x, gate_up, down)
        scales = None
        if fp8 is not None:  # (gate_up's, down_proj's)
            scales = tuple(_scales(fp8, _params(p, None, hist)) for p in PROJECTIONS)
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
    # The histories, replicated: P() for each.
    hist = {p: _fp8.history_specs(fp8)["fp8"] for p in PROJECTIONS} if fp8 == "delayed" else None
    in_specs = (spec, *kernels) + (() if hist is None else (hist,))
    f = body if sequence_parallel else replicated
    plain = functools.partial(replicated, axis_name=None)
    return _over_tp(f, mesh, axis_name, in_specs, spec, plain, impl)


def _params(projection: str, kernel: jax.Array | None, hist: dict | None) -> dict[str, Any]:
    """A projection's params as the layers' functions take them: its kernel and, with
    delayed scaling, its histories under ``"fp8"``."""
    return {"kernel": kernel} | ({} if hist is None else {"fp8": hist[projection]})
