"""Framework-free pieces shared by the nnx and linen layers.

Argument checks, the ``PartitionSpec``s of the sequence-parallel layout, and the
per-shard computations that run inside ``jax.shard_map``. Activations are laid out
``[seq, *batch, features]``, or with the layer's ``seq_axis`` batch-major
``[batch, seq, ..., features]``; "sequence-sharded" means that dim (0 by default) is split
over the tensor parallel axis, "feature-sharded" means the last dim is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import checks, layout
from jax_ub.flax import _fp8

Params = Mapping[str, jax.Array]


# --- argument checks ---------------------------------------------------------------------


def group_size(
    owner: str, mesh: Any, axis_name: Any, *, required: bool = True, impl: str | None = None
) -> int | None:
    """Size of the tensor-parallel axis, from where it is known, in this order: a shard_map
    over it being traced, the layer's ``mesh``, the mesh set by ``jax.set_mesh``.

    When none of them is known: None if ``required`` is False (a layer built before any
    mesh is set checks its sizes when it is called); 1 for a call with ``impl`` other than
    ``"ub"``, which then runs XLA's plain matmuls (:func:`_over_tp`); a ValueError
    otherwise. A ValueError too when the axis is not in the mesh.
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(
            f"{owner}: mesh must be a concrete jax.sharding.Mesh or None (then the mesh set by "
            f"jax.set_mesh is used), got {type(mesh).__name__}"
        )
    if not isinstance(axis_name, str):
        raise ValueError(f"{owner}: axis_name must be a mesh axis name (str), got {axis_name!r}")
    if axis_name in layout.manual_axes():
        return int(jax.lax.axis_size(axis_name))
    known = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if known.empty:
        if not required:
            return None
        if impl is not None and impl != "ub":
            return 1
        raise ValueError(
            f"{owner}: no mesh to run over: call the layer under `with jax.set_mesh(mesh):`, "
            f"pass mesh=..., or call it inside a shard_map over axis {axis_name!r} (impl="
            f"'auto' runs XLA's plain matmuls when no mesh is known; impl={impl!r} does not)"
        )
    if axis_name not in known.axis_names:
        raise ValueError(
            f"{owner}: axis_name {axis_name!r} is not an axis of the mesh; "
            f"mesh.axis_names={known.axis_names}"
        )
    return int(known.shape[axis_name])


def global_features(features: int, tp: int, axis_name: str, split: bool) -> int:
    """The layer's feature count from an input's (the inverse of :func:`local_features`)."""
    return features * tp if split and axis_name in layout.manual_axes() else features


def local_features(features: int, tp: int, axis_name: str, split: bool) -> int:
    """Features an input has where the layer sees it: the local shard inside a shard_map
    over ``axis_name`` when they are ``split`` over it, else all of them."""
    return features // tp if split and axis_name in layout.manual_axes() else features


# One spelling of the impl check for the ops and the layers.
check_impl = checks.check_impl


def check_fp8(owner: str, fp8: Any, amax_history_length: Any) -> None:
    """A layer's ``fp8`` is False, True (= ``"current"``), ``"current"`` or ``"delayed"``;
    see :mod:`jax_ub.flax._fp8`."""
    _fp8.check(owner, fp8, amax_history_length)


def check_divisible(owner: str, what: str, value: int, tp: int, axis_name: str) -> None:
    if value <= 0 or value % tp != 0:
        raise ValueError(
            f"{owner}: {what}={value} must be a positive multiple of the size of axis "
            f"{axis_name!r} ({tp})"
        )


# A layer's seq_axis is an int, checked when it is built (against its input's dims when
# it is called, by check_input).
check_seq_axis = layout.check_seq_axis_type


def check_input(
    owner: str, x: Any, in_features: int | None, tp: int, axis_name: str, seq_axis: int = 0
) -> bool:
    """Check that x is ``[seq, *batch, in_features]`` (the sequence at ``seq_axis``) and
    return whether the call runs sequence-parallel.

    Inside a shard_map over ``axis_name`` the layers take sequence shards (True). On global
    arrays they run sequence-parallel where ``tp`` divides the sequence; otherwise (one
    token being decoded, a prompt of any length) with the activations replicated over the
    axis (False): see :func:`linear_replicated`. ``in_features=None`` accepts any feature
    count (linen infers it from the input).
    """
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(f"{owner}: input must be [seq, *batch, features], got shape {shape}")
    if in_features is not None and shape[-1] != in_features:
        raise ValueError(
            f"{owner}: input has {shape[-1]} features (last dim) but the layer expects "
            f"{in_features}; input shape {shape}"
        )
    seq = layout.check_seq_axis(owner, x, seq_axis)
    return axis_name in layout.manual_axes() or shape[seq] % tp == 0


# --- sharding layout ---------------------------------------------------------------------


# ``[seq, *batch, features]`` split over the axis on the sequence dim (``seq_axis``, a
# dim index in [0, ndim - 1)).
seq_spec = layout.seq_spec


def feature_spec(ndim: int, axis_name: str, seq_axis: int = 0) -> P:
    """``[seq, *batch, features]`` split over ``axis_name`` on the feature dim, wherever
    the sequence is."""
    del seq_axis
    return P(*([None] * (ndim - 1)), axis_name)


def param_specs(kind: str, axis_name: str, use_bias: bool, fp8: str | None = None) -> dict:
    """How the ops need a ``kind`` (``"column"``, ``"row"``) layer's params split over
    ``axis_name`` (with ``fp8="delayed"``, its amax histories too, replicated)."""
    names = param_names("", kind, axis_name, use_bias, None)
    return {k: P(*v) for k, v in names.items()} | _fp8.history_specs(fp8)


def param_names(
    owner: str, kind: str, axis_name: str, use_bias: bool, other_axes: Any
) -> dict[str, tuple]:
    """The sharding names a layer's params carry as metadata (``nnx.get_partition_spec``,
    ``nn.get_partition_spec``): the tensor-parallel split, plus ``other_axes`` (a mesh
    axis name, a tuple of them, or None) on the kernel's other dim, e.g. an FSDP axis.

    Only initial placement and the user's view: the ops take the params in whatever layout
    they arrive and XLA gathers what is not split over ``axis_name`` (an FSDP gather).
    """
    if other_axes is not None and (
        other_axes == axis_name or (isinstance(other_axes, tuple) and axis_name in other_axes)
    ):
        raise ValueError(
            f"{owner}: param_axes={other_axes!r} names the tensor-parallel axis "
            f"{axis_name!r}; it names the axes that split the kernel's other dim"
        )
    if kind == "column":
        names = {"kernel": (other_axes, axis_name), "bias": (axis_name,)}
    else:
        names = {"kernel": (axis_name, other_axes), "bias": (None,)}  # added after the sum
    if not use_bias:
        del names["bias"]
    return names


# --- per-shard computations (run inside shard_map) ---------------------------------------


def _promote(dtype: Any, *arrays: jax.Array | None) -> list[jax.Array | None]:
    """Cast to ``dtype``, or to the arrays' common dtype when it is None (like nnx.Linear)."""
    present = [a for a in arrays if a is not None]
    dtype = dtype if dtype is not None else jnp.result_type(*present)
    return [None if a is None else jnp.asarray(a, dtype) for a in arrays]


def _scales(fp8: str | None, params: Params) -> jax_ub.Fp8Scales | None:
    """The ops' ``fp8`` argument for a layer's recipe (``op_settings``'), from the amax
    histories among its ``params`` for delayed scaling."""
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
    x, kernel, bias = _promote(dtype, x, params["kernel"], params.get("bias"))
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
    **_: Any,
) -> jax.Array:
    """A ``kind`` layer with the activations replicated over ``axis_name`` (tensor
    parallelism without sequence parallelism: decoding, or a sequence ``tp`` does not
    divide). ``"column"``: ``x [..., k]`` times this rank's kernel columns, plus its bias
    shard, ``[..., n/tp]``, no communication. ``"row"``: ``x [..., k/tp]`` times this rank's
    kernel rows, summed over the axis (XLA's all-reduce), plus the bias: ``[..., n]``.
    With fp8 the GEMM runs in XLA on the operands (and its output gradient) quantized as the
    ops quantize them, delayed scales included (:func:`dense`). With ``axis_name=None``, on
    global arrays: the plain layer, which XLA partitions itself."""
    x, kernel, bias = _promote(dtype, x, params["kernel"], params.get("bias"))
    y = dense(x, kernel, _scales(fp8, params), axis_name)
    # A group of one sums nothing; JAX leaves a size-1 axis automatic, and XLA refuses an
    # all-reduce outside manual partitioning.
    if kind == "row" and axis_name is not None and jax.lax.axis_size(axis_name) > 1:
        y = jax.lax.psum(y, axis_name)
    if bias is not None:
        y = y + bias
    return y if activation is None else activation(y)


def op_settings(layer: Any) -> tuple:
    """``(mesh, axis_name, impl, dtype, fp8, seq_axis)`` of a layer or block (nnx or
    linen): the leading arguments of every ``*_call`` below, the settings of the ops it
    runs; ``fp8`` is the recipe's name (``"current"``, ``"delayed"``) or None."""
    fp8 = _fp8.recipe(layer.fp8)
    # linen modules resolve their axis (tp_axis) when called; nnx ones when built.
    axis = layer.resolved_axis() if hasattr(layer, "resolved_axis") else layer.axis_name
    return (layer.mesh, axis, layer.impl, layer.dtype, fp8, layer.seq_axis)


# --- whole-layer functions, one per configuration ---------------------------------------
#
# Inside a shard_map over the tensor-parallel axis (the user's own), the per-shard
# computation runs as it is, on local shards. Otherwise it runs in a jit(shard_map) over
# that axis alone, under the layer's mesh or the one set by jax.set_mesh: every other mesh
# axis (dp, fsdp, ...) stays XLA's, so a batch sharded over them stays sharded. Cached so
# that eager calls compile once per shape; under an outer jit the inner jit is inlined.


def _over_tp(
    f: Callable,
    mesh: Mesh | None,
    axis_name: str,
    in_specs: Any,
    out_specs: Any,
    plain: Callable | None = None,
    impl: str = "ub",
    check_vma: bool = True,
):
    """``f`` on local shards, run as described above (``check_vma``: as
    ``layout.over_axis``). With no mesh known (none given, none set: a model jitted on
    sharded arrays, as ``nn.Dense`` allows), ``plain`` (the same layer written on global
    arrays) runs instead where ``impl`` is not ``"ub"``, after one
    warning that nothing is overlapped: XLA partitions its matmuls from the operands'
    shardings."""
    # One jit(shard_map) per mesh it runs under: shard_map binds its mesh when built.
    mapped: dict[Any, Callable] = {}

    def call(*args):
        if axis_name in layout.manual_axes():
            return f(*args)
        context = jax.sharding.get_abstract_mesh()
        if mesh is None and context.empty:
            if plain is None or impl == "ub":
                raise ValueError(
                    f"no mesh to run over axis {axis_name!r}: call the layer under "
                    "`with jax.set_mesh(mesh):`, pass mesh=..., or call it inside a shard_map"
                )
            message = (
                f"jax_ub.flax: no mesh is set (jax.set_mesh) or given (mesh=), so the layers "
                f"run XLA's plain matmuls over axis {axis_name!r}: nothing is overlapped"
            )
            checks.warn_once(message, message)
            return plain(*args)
        key = mesh if context.empty else context  # the layer's mesh only when none is set
        if key not in mapped:
            # A size-1 axis stays automatic in JAX, where XLA refuses the psum that would
            # type a replicated output as such: nothing to check over a group of one.
            checked = check_vma and key.shape[axis_name] > 1
            mapped[key] = jax.jit(
                layout.over_axis(f, mesh, axis_name, in_specs, out_specs, checked)
            )
        return mapped[key](*_resharded_explicit(axis_name, in_specs, args))

    return call


def _resharded_explicit(axis_name: str, in_specs: Any, args: tuple) -> tuple:
    """Under ``Explicit`` axes shard_map takes inputs only already split as its in_specs
    say: move each array's split over ``axis_name`` to where the layer needs it, keeping
    its other axes. Arrays whose type carries no sharding (``Auto``) pass as they are."""

    def move(spec, a):
        actual = layout.typed_spec(a)
        if spec is None or actual is None:
            return a
        target = layout.replace_axis(actual, spec, axis_name, a.ndim)
        return a if target == actual else jax.sharding.reshard(a, target)

    is_spec = lambda s: s is None or isinstance(s, P)  # noqa: E731
    return tuple(jax.tree.map(move, in_specs, args, is_leaf=is_spec))


# Per layer kind: the specs of its input and output.
def replicated_spec(ndim: int, axis_name: str, seq_axis: int = 0) -> P:
    """``[seq, *batch, features]`` replicated over ``axis_name`` (other axes XLA's)."""
    del ndim, axis_name, seq_axis
    return P()


# Per layer kind: the specs of its input and output, sequence-parallel (True) or not.
_LINEAR = {
    ("column", True): (seq_spec, feature_spec),  # sequence- -> feature-sharded
    ("row", True): (feature_spec, seq_spec),  # feature- -> sequence-sharded
    ("column", False): (replicated_spec, feature_spec),
    ("row", False): (feature_spec, replicated_spec),
}


def activation_spec(ndim: int, axis_name: str, seq_axis: int, sequence_parallel: bool) -> P:
    """A block's input and output: sequence-sharded, or replicated over the axis."""
    return (seq_spec if sequence_parallel else replicated_spec)(ndim, axis_name, seq_axis)


@functools.lru_cache(maxsize=256)
def linear_call(
    kind: str,
    mesh: Mesh | None,
    axis_name: str,
    impl: str,
    dtype: Any,
    fp8: str | None,
    seq_axis: int,
    ndim: int,
    use_bias: bool,
    sequence_parallel: bool = True,
) -> Callable[[jax.Array, Params], jax.Array]:
    """``f(x, params)`` of a ``kind`` layer: ``"column"`` takes sequence-sharded ``x`` to a
    feature-sharded output, ``"row"`` the reverse; without ``sequence_parallel``, the
    sequence-sharded side is replicated over the axis instead."""
    x_spec, out_spec = _LINEAR[kind, sequence_parallel]
    seq = seq_axis % ndim
    kw = dict(axis_name=axis_name, impl=impl, dtype=dtype, fp8=fp8, seq_axis=seq)
    local = functools.partial(linear_local if sequence_parallel else linear_replicated, kind, **kw)
    plain = functools.partial(linear_replicated, kind, **(kw | {"axis_name": None}))
    in_specs = (x_spec(ndim, axis_name, seq), param_specs(kind, axis_name, use_bias, fp8))
    out_specs = out_spec(ndim, axis_name, seq)
    return _over_tp(local, mesh, axis_name, in_specs, out_specs, plain, impl)


@functools.lru_cache(maxsize=256)
def mlp_call(
    mesh: Mesh | None,
    axis_name: str,
    impl: str,
    dtype: Any,
    fp8: str | None,
    seq_axis: int,
    activation: Callable[[jax.Array], jax.Array],
    ndim: int,
    use_bias: bool,
    sequence_parallel: bool = True,
) -> Callable[[jax.Array, Params, Params], jax.Array]:
    """``f(x, up_params, down_params)``: column -> activation -> row, sequence-sharded. GELU
    runs in the column GEMMs' epilogue and its backward in the row op's dgrad GEMM
    (``jax_ub.gelu_mlp``, in fp8 too); other activations in XLA after the column op."""
    seq = seq_axis % ndim
    kw = dict(axis_name=axis_name, impl=impl, dtype=dtype, fp8=fp8, seq_axis=seq)
    fused = fused_activation(activation)

    def replicated(x, p_up, p_down, axis_name=axis_name):
        kw_axis = kw | {"axis_name": axis_name}
        h = linear_replicated("column", x, p_up, activation=activation, **kw_axis)
        return linear_replicated("row", h, p_down, **kw_axis)

    def body(x, p_up, p_down):
        if fused:
            x, k_up, b_up, k_down, b_down = _promote(
                dtype, x, p_up["kernel"], p_up.get("bias"), p_down["kernel"], p_down.get("bias")
            )
            scales = None if not fp8 else (_scales(fp8, p_up), _scales(fp8, p_down))
            return jax_ub.gelu_mlp(
                x,
                k_up,
                k_down,
                axis_name,
                up_bias=b_up,
                down_bias=b_down,
                impl=impl,
                fp8=scales,
                seq_axis=seq,
            )
        h = linear_local("column", x, p_up, activation=fused, **kw)
        return linear_local("row", h if fused else activation(h), p_down, **kw)

    col = param_specs("column", axis_name, use_bias, fp8)
    row = param_specs("row", axis_name, use_bias, fp8)
    spec = activation_spec(ndim, axis_name, seq, sequence_parallel)
    f = body if sequence_parallel else replicated
    plain = functools.partial(replicated, axis_name=None)
    return _over_tp(f, mesh, axis_name, (spec, col, row), spec, plain, impl)
