"""Framework-free pieces shared by the nnx and linen layers.

The ``PartitionSpec``s of the sequence-parallel layout, and the
per-shard computations that run inside ``jax.shard_map`` (the checks are in
:mod:`jax_ub.flax._checks`). Activations are laid out
``[seq, *batch, features]``, or with the layer's ``seq_axis`` batch-major
``[batch, seq, ..., features]``; "sequence-sharded" means that dim (0 by default) is split
over the tensor parallel axis, "feature-sharded" means the last dim is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.lowering.unfused import all_reduce
from jax_ub._src.ops import driver, placement
from jax_ub._src.ops.cpu_16bit import Widening
from jax_ub._src.settings.warn_registry import warn_once
from jax_ub.flax import _fp8
from jax_ub.flax._checks import default_axis_hint, without_mesh
from jax_ub.flax._projection import Projection, param_specs
from jax_ub.flax._settings import ParallelConfig

Params = Mapping[str, jax.Array]


# --- sharding layout ---------------------------------------------------------------------


# ``[seq, *batch, features]`` split over the axis on the sequence dim (``seq_axis``, a
# dim index in [0, ndim - 1)).
seq_spec = placement.seq_spec


# --- per-shard computations (run inside shard_map) ---------------------------------------


def promote(dtype: Any, *arrays: jax.Array | None) -> list[jax.Array | None]:
    """Cast to ``dtype``, or to the arrays' common dtype when it is None (like nnx.Linear)."""
    present = [a for a in arrays if a is not None]
    dtype = dtype if dtype is not None else jnp.result_type(*present)
    return [None if a is None else jnp.asarray(a, dtype) for a in arrays]


def _scales(fp8: str | None, params: Params) -> jax_ub.Fp8Scales | None:
    """The ops' ``fp8`` argument for a layer's recipe (``ParallelConfig.fp8_recipe``), from
    the amax histories among its ``params`` for delayed scaling."""
    return _fp8.scales(fp8, params.get("fp8"))


def fused_activation(activation: Callable[[jax.Array], jax.Array]) -> str | None:
    """The ops' ``activation`` name for a callable their epilogue computes, else None."""
    return "gelu" if activation is jax.nn.gelu else None  # flax's gelu is jax.nn.gelu


def linear_local(
    kind: str,
    x: jax.Array,
    params: Params,
    *,
    axis_name: str,
    impl: str,
    dtype: Any,
    fp8: str | None,
    seq_axis: int = 0,
    activation: str | None = None,
) -> jax.Array:
    """A ``kind`` layer on local shards (the sequence at ``seq_axis``). ``"column"``: rows
    ``[seq/tp, *b, k]`` -> ``[seq, *b, n/tp]``, all_gather_matmul with its bias (this
    rank's columns' shard) and ``activation`` applied in the GEMMs' epilogue. ``"row"``:
    ``[seq, *b, k/tp]`` -> ``[seq/tp, *b, n]``, matmul_reduce_scatter with its bias added
    once after the reduction."""
    x, kernel, bias = promote(dtype, x, params["kernel"], params.get("bias"))
    kw = dict(bias=bias, impl=impl, fp8=_scales(fp8, params), seq_axis=seq_axis)
    if kind == "column":
        return jax_ub.all_gather_matmul(x, kernel, axis_name, activation=activation, **kw)
    return jax_ub.matmul_reduce_scatter(x, kernel, axis_name, **kw)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    scales: jax_ub.Fp8Scales | None,
    axis_name: str | None = None,
) -> jax.Array:
    """``x [..., k] @ kernel [k, n]`` in XLA; with ``scales``, in fp8 as the ops compute it,
    forward and backward, the given scales' gradients the amaxes over ``axis_name``'s
    group (:func:`jax_ub.flax._fp8.dense`)."""
    if scales is None:
        return jnp.einsum("...k,kn->...n", x, kernel)
    return _fp8.dense(x, kernel, scales, axis_name)


def linear_replicated(
    kind: str,
    x: jax.Array,
    params: Params,
    *,
    axis_name: str | None,
    dtype: Any,
    fp8: str | None,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    impl: str = "xla",
    seq_axis: int = 0,
) -> jax.Array:
    """A ``kind`` layer with the activations replicated over ``axis_name`` (tensor
    parallelism without sequence parallelism: decoding, or a sequence ``tp`` does not
    divide). ``"column"``: ``x [..., k]`` times this rank's kernel columns, plus its bias
    shard, ``[..., n/tp]``, no communication. ``"row"``: ``x [..., k/tp]`` times this rank's
    kernel rows, summed over the axis, plus the bias: ``[..., n]``, by
    :func:`jax_ub.matmul_all_reduce` (``impl`` and ``seq_axis`` are its).
    With fp8 the GEMM runs in XLA on the operands (and its output gradient) quantized as the
    ops quantize them, delayed scales included (:func:`dense`), and XLA's all-reduce sums
    it. With ``axis_name=None``, on global arrays: the plain layer, which XLA partitions
    itself."""
    x, kernel, bias = promote(dtype, x, params["kernel"], params.get("bias"))
    summed = kind == "row" and axis_name is not None
    if summed and fp8 is None:
        y = jax_ub.matmul_all_reduce(x, kernel, axis_name, impl=impl, seq_axis=seq_axis)
    else:
        y = dense(x, kernel, _scales(fp8, params), axis_name)
        # A group of one sums nothing; JAX leaves a size-1 axis automatic, and XLA refuses
        # an all-reduce outside manual partitioning.
        if summed and jax.lax.axis_size(axis_name) > 1:
            y = all_reduce(y, axis_name)
    if bias is not None:
        y = y + bias
    return y if activation is None else activation(y)


def dropout(x: jax.Array, rate: float, key: jax.Array, axis_name: str | None) -> jax.Array:
    """Inverted dropout of ``x`` (as ``nnx.Dropout``: kept values scaled by ``1 / (1 -
    rate)``). Inside a shard_map over ``axis_name`` (not None), ``x`` is this device's
    shard of features and the key is folded with the device's index, so each shard draws
    its own mask, the same whichever collectives (impl) move the activations."""
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jax.lax.select(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


# --- whole-layer functions, one per configuration ---------------------------------------
#
# Each is cached on the call's settings (``_checks.prepare``'s ParallelConfig) and runs its
# per-shard computation through the driver (:func:`over_axis`): inside the user's
# shard_map over the tensor-parallel axis on local shards, else on global arrays in a
# jit(shard_map) over that axis, every other mesh axis (dp, fsdp, ...) XLA's.


def over_axis(
    config: ParallelConfig,
    f: Callable,
    in_specs: Any,
    out_specs: Any,
    plain: Callable,
    check_vma: bool = True,
    row_dims: int = 0,
) -> Callable:
    """``f`` on local shards, run by :func:`jax_ub._src.ops.driver.over_axis` (as the ops
    run) over ``config``'s axis and mesh. With no mesh known (none given, none set, none in
    the arrays' types: a model jitted on uncommitted arrays, as ``nn.Dense`` allows),
    ``plain`` (the same layer written on global arrays) runs instead, as
    :func:`_checks.without_mesh` says, after one warning that nothing is overlapped."""
    axis_name = config.axis_name

    def without(*args):
        without_mesh("jax_ub.flax", axis_name, config.impl)  # raises for impl="ub"
        hint = default_axis_hint(axis_name)
        message = (
            f"jax_ub.flax: a layer was traced with no mesh set (jax.set_mesh) or given "
            f"(mesh= to the layer or to jax_ub.flax.defaults), on arrays whose types carry "
            f"none (uncommitted arrays; an init, before the params exist), so it runs XLA's "
            f"plain matmuls over axis {axis_name!r}: that call is not overlapped. Calls on "
            f"params sharded over a mesh find it; or trace the step under the mesh: `with "
            f"jax.set_mesh(mesh): state = train_step(state, batch)`{hint}"
        )
        warn_once(message, message)
        return plain(*args)

    widening = Widening(config.dtype)
    return driver.over_axis(
        "jax_ub.flax",
        f,
        axis_name,
        in_specs,
        out_specs,
        mesh=config.mesh,
        without_mesh=without,
        check_vma=check_vma,
        row_dims=row_dims,
        widening=widening,
    )


def activation_spec(ndim: int, config: ParallelConfig) -> P:
    """A block's ``ndim``-dim input and output under a call's settings: sequence-sharded
    (on ``config.seq_axis``), or replicated over the axis."""
    if not config.sequence_parallel:
        return P()
    return seq_spec(ndim, config.axis_name, config.seq_axis)


def projection_local(
    projections: tuple[Projection, ...],
    x: jax.Array,
    params: tuple[Params, ...],
    *,
    sequence_parallel: bool,
    **kw: Any,
) -> Any:
    """Projections of one input on local shards (or, with ``axis_name=None``, on global
    arrays), as :func:`linear_local` (``sequence_parallel``) or :func:`linear_replicated`
    run them, on the operands flattened to its ``[k, n]`` matmul (:mod:`._projection`).
    Column projections of one ``x`` run as one: their kernels' shards side by side, so
    ``x`` is gathered once; the result is each one's ``[..., *features]`` (this rank's
    shard of them), a tuple. A row projection's is its own, reduce-scattered (or summed)."""
    kind, n_in = projections[0].kind, projections[0].n_in
    lead = x.shape[:-n_in]
    flat = [_flat(p, params_p) for p, params_p in zip(projections, params)]
    sizes = [f["kernel"].shape[1] for f in flat]
    merged = flat[0]
    if len(flat) > 1:  # side by side: one GEMM, one gather (no fp8 histories: check_group)
        merged = {"kernel": jnp.concatenate([f["kernel"] for f in flat], axis=1)}
        if any(p.use_bias for p in projections):
            dtype = flat[0]["kernel"].dtype
            biases = [f.get("bias", jnp.zeros((n,), dtype)) for f, n in zip(flat, sizes)]
            merged["bias"] = jnp.concatenate(biases)
    linear = linear_local if sequence_parallel else linear_replicated
    y = linear(kind, x.reshape(*lead, -1), merged, **kw)
    out = []
    for i, (params_p, n) in enumerate(zip(params, sizes)):
        start = sum(sizes[:i])
        shape = params_p["kernel"].shape[n_in:]  # this rank's features (all, on global arrays)
        out.append(y[..., start : start + n].reshape(*y.shape[:-1], *shape))
    return tuple(out) if kind == "column" else out[0]


def _flat(p: Projection, params: Params) -> dict[str, Any]:
    """A projection's params (or their local shards) as a plain linear layer's."""
    kernel = params["kernel"]
    flat = {"kernel": kernel.reshape(math.prod(kernel.shape[: p.n_in]), -1)}
    if params.get("bias") is not None:
        flat["bias"] = params["bias"].reshape(-1)
    if "fp8" in params:
        flat["fp8"] = params["fp8"]
    return flat


@functools.lru_cache(maxsize=256)
def projection_call(
    projections: tuple[Projection, ...], config: ParallelConfig, ndim: int
) -> Callable[[jax.Array, tuple[Params, ...]], Any]:
    """``f(x, params)`` of ``projections`` (column projections of one input, or one row
    projection) on an ``ndim``-dim input, with a call's settings (``_checks.prepare``'s):
    column takes a sequence-sharded ``x`` to outputs feature-sharded on their split dims,
    row a feature-sharded ``x`` (on its split dim) to a sequence-sharded output; without
    ``config.sequence_parallel``, the sequence-sharded side is replicated over the axis
    instead. ``params``: one dict per projection."""
    first, axis, sp = projections[0], config.axis_name, config.sequence_parallel
    lead = ndim - first.n_in
    kw = _kw(config) | {"sequence_parallel": sp}
    local = functools.partial(projection_local, projections, **kw)
    global_kw = kw | {"axis_name": None, "sequence_parallel": False}
    plain = functools.partial(projection_local, projections, **global_kw)
    side = activation_spec(lead + len(first.features), config)

    def split_spec(p: Projection, dim: int) -> P:  # the activation split on ``dim`` of p's
        dims = [None] * (lead + len(p.features) if p.kind == "column" else ndim)
        dims[lead + dim] = axis
        return P(*dims)

    if first.kind == "column":
        x_spec = activation_spec(ndim, config)
        out_specs: Any = tuple(split_spec(p, p.split - p.n_in) for p in projections)
    else:
        x_spec, out_specs = split_spec(first, first.split), side
    fp8 = config.fp8_recipe
    in_specs = (x_spec, tuple(p.param_specs(axis, fp8) for p in projections))
    rows = placement.row_dims(lead, fp8 is not None)
    return over_axis(config, local, in_specs, out_specs, plain, row_dims=rows)


def _kw(config: ParallelConfig) -> dict[str, Any]:
    """The per-shard functions' keyword arguments for a call's settings."""
    return dict(
        axis_name=config.axis_name,
        impl=config.impl,
        dtype=config.dtype,
        fp8=config.fp8_recipe,
        seq_axis=config.seq_axis,
    )


@functools.lru_cache(maxsize=256)
def mlp_call(
    config: ParallelConfig,
    activation: Callable[[jax.Array], jax.Array],
    ndim: int,
    use_bias: bool,
    dropout_rate: float = 0.0,
) -> Callable[..., jax.Array]:
    """``f(x, up_params, down_params)``: column -> activation -> row, sequence-sharded (or
    replicated over the axis: ``config.sequence_parallel``). GELU runs in the column GEMMs'
    epilogue and its backward in the row op's dgrad GEMM (``jax_ub.gelu_mlp``, in fp8
    too); other activations in XLA after the column op.

    With ``dropout_rate`` > 0, ``f(x, up_params, down_params, key)``: the hidden
    activations are dropped (:func:`dropout`) before the row projection, so GELU's
    backward is XLA's (``gelu_mlp`` has no place for the mask)."""
    kw, axis, fp8 = _kw(config), config.axis_name, config.fp8_recipe
    fused = fused_activation(activation)

    def hidden(h, key, axis):
        return h if key is None else dropout(h, dropout_rate, key, axis)

    def replicated(x, p_up, p_down, key=None, axis_name=axis):
        kw_axis = kw | {"axis_name": axis_name}
        h = linear_replicated("column", x, p_up, activation=activation, **kw_axis)
        return linear_replicated("row", hidden(h, key, axis_name), p_down, **kw_axis)

    def body(x, p_up, p_down, key=None):
        if key is not None:  # the hidden activations are needed, for the mask
            h = linear_local("column", x, p_up, activation=fused, **kw)
            h = hidden(h if fused else activation(h), key, axis)
            return linear_local("row", h, p_down, **kw)
        if not fused:
            h = linear_local("column", x, p_up, **kw)
            return linear_local("row", activation(h), p_down, **kw)
        x, k_up, b_up, k_down, b_down = promote(
            config.dtype, x, p_up["kernel"], p_up.get("bias"), p_down["kernel"], p_down.get("bias")
        )
        scales = None if not fp8 else (_scales(fp8, p_up), _scales(fp8, p_down))
        return jax_ub.gelu_mlp(
            x,
            k_up,
            k_down,
            axis,
            up_bias=b_up,
            down_bias=b_down,
            impl=config.impl,
            fp8=scales,
            seq_axis=config.seq_axis,
        )

    col = param_specs("column", axis, use_bias, fp8)
    row = param_specs("row", axis, use_bias, fp8)
    spec = activation_spec(ndim, config)
    in_specs = (spec, col, row) + ((P(),) if dropout_rate > 0 else ())
    f = body if config.sequence_parallel else replicated
    plain = functools.partial(replicated, axis_name=None)
    return over_axis(config, f, in_specs, spec, plain)
