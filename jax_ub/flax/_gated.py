"""The gated MLP block's pieces shared by the nnx and linen layers: its params' and amax
histories' names, and the per-configuration function that runs :func:`jax_ub.gated_mlp`
(or, on a sequence ``tp`` does not divide, the same math with replicated activations)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.ops.gated_mlp import activation_function
from jax_ub.flax import _axes, _fp8
from jax_ub.flax._core import (
    _kw,
    _scales,
    activation_spec,
    dropout,
    linear_local,
    linear_replicated,
    over_axis,
    promote,
)
from jax_ub.flax._projection import param_names
from jax_ub.flax._settings import ParallelConfig


def unboxed(value: Any) -> Any:
    """An initializer's value out of the box flax's ``with_partitioning`` wrappers put it in
    (linen's ``.value``, NNX's ``.raw_value``): the gated block names its kernels itself,
    from ``kernel_axes`` or the box's names read as they are (``box_names``), else with
    tensor-parallel names."""
    if isinstance(value, jax.Array):
        return value
    for attr in ("raw_value", "value"):
        if hasattr(value, attr):
            return getattr(value, attr)
    return value


def gated_kernel_names(owner: str, axis_name: str, other_axes: Any) -> dict[str, tuple]:
    """Sharding names of a gated MLP's ``gate_up`` kernel ``[in, 2, hidden]`` (hidden split
    over ``axis_name``, ``other_axes`` on ``in``) and its row-parallel ``down_proj``."""
    row = param_names(owner, "row", axis_name, False, other_axes)
    return {"gate_up": (other_axes, None, axis_name), "down_proj": row["kernel"]}


def logical_kernel_names(owner: str, kernel_axes: Any, param_axes: Any) -> dict[str, tuple]:
    """The kernels' logical names from ``kernel_axes`` ``(model dim, split dim)``, which
    the user's logical_axis_rules map to mesh axes."""
    model, split = _axes.block_kernel_axes(owner, kernel_axes, param_axes)
    return {"gate_up": (model, None, split), "down_proj": (split, model)}


# fp8="delayed": each projection's three amax histories (_fp8's), as variables named
# f"{projection}_{flax's name}", e.g. "gate_up_input_amax_history".
PROJECTIONS = ("gate_up", "down_proj")
HISTORY_NAMES = {
    p: {k: f"{p}_{name}" for k, name in _fp8.HISTORY_NAMES.items()} for p in PROJECTIONS
}


def histories(fp8: Any, read: Callable[[str], jax.Array]) -> dict | None:
    """The :func:`gated_mlp_call` operand of the amax histories, ``{projection: {"x", "w",
    "grad"}}`` from ``read(variable name)``, for ``fp8="delayed"``; else None."""
    if _fp8.recipe(fp8) != "delayed":
        return None
    return {p: {k: read(n) for k, n in names.items()} for p, names in HISTORY_NAMES.items()}


@functools.lru_cache(maxsize=256)
def gated_mlp_call(
    config: ParallelConfig, activation: Any, ndim: int, dropout_rate: float = 0.0
) -> Callable[..., jax.Array]:
    """``f(x, gate_up, down, hist, key)``: :func:`jax_ub.gated_mlp`, sequence-sharded (or
    with the activations replicated over the axis, as :func:`linear_replicated`: without
    ``config.sequence_parallel``), with a call's settings (``_checks.prepare``'s).
    ``hist``: with ``fp8="delayed"``, the amax histories of :func:`histories`, replicated
    (their gradients are the histories with this step's amaxes rolled in front), else
    None. ``key``: with ``dropout_rate`` > 0, the dropout key of the gated hidden
    activations (:func:`jax_ub.flax._core.dropout`), which then run through the two
    projections of :func:`linear_local` (``gated_mlp`` has no place for the mask), else
    None."""
    gate, axis, fp8 = activation_function(activation), config.axis_name, config.fp8_recipe

    def projections(x, gate_up, down, hist, key, linear, axis_name):
        k, _, f = gate_up.shape  # f: this device's hidden units
        kw = _kw(config) | {"axis_name": axis_name}
        # [k, 2, f] -> [k, 2f]: the gate's columns, then the up projection's.
        gu = linear("column", x, _params("gate_up", gate_up.reshape(k, 2 * f), hist), **kw)
        hidden = gate(gu[..., :f]) * gu[..., f:]
        if key is not None:
            hidden = dropout(hidden, dropout_rate, key, axis_name)
        return linear("row", hidden, _params("down_proj", down, hist), **kw)

    def replicated(x, gate_up, down, hist=None, key=None, axis_name=axis):
        return projections(x, gate_up, down, hist, key, linear_replicated, axis_name)

    def body(x, gate_up, down, hist=None, key=None):
        if key is not None:
            return projections(x, gate_up, down, hist, key, linear_local, axis)
        x, gate_up, down = promote(config.dtype, x, gate_up, down)
        scales = None
        if fp8 is not None:  # (gate_up's, down_proj's)
            scales = tuple(_scales(fp8, _params(p, None, hist)) for p in PROJECTIONS)
        return jax_ub.gated_mlp(
            x,
            gate_up,
            down,
            axis,
            activation=activation,
            impl=config.impl,
            fp8=scales,
            seq_axis=config.seq_axis,
        )

    spec = activation_spec(ndim, config)
    kernels = (P(None, None, axis), P(axis, None))
    # The histories, replicated: P() for each.
    hist = None
    if fp8 == "delayed":
        hist = {p: _fp8.history_specs(fp8)["fp8"] for p in PROJECTIONS}
    key = P() if dropout_rate > 0 else None
    in_specs = (spec, *kernels, hist, key)
    f = body if config.sequence_parallel else replicated
    plain = functools.partial(replicated, axis_name=None)
    return over_axis(config, f, in_specs, spec, plain)


def _params(projection: str, kernel: jax.Array | None, hist: dict | None) -> dict[str, Any]:
    """A projection's params as the layers' functions take them: its kernel and, with
    delayed scaling, its histories under ``"fp8"``."""
    return {"kernel": kernel} | ({} if hist is None else {"fp8": hist[projection]})
