"""Tensor-parallel linear layers for Flax linen, overlapped through jax_ub."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.core import meta
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.typing import Dtype, Initializer
from jax.sharding import Mesh

from jax_ub._src.ops import placement
from jax_ub.flax import _axes, _checks, _core, _fp8, _projection, _settings
from jax_ub.flax._projection import Projection, check_group
from jax_ub.flax._settings import ParallelConfig

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()


def _setting(default: Any = None) -> Any:
    """A keyword-only attribute: the layers' own attributes stay positional, first."""
    return dataclasses.field(default=default, kw_only=True)


class SettingsModule(nn.Module):
    """A linen layer's settings: its :class:`~jax_ub.flax.ParallelConfig` from its
    attributes (those not None) over its ``config`` or else the model defaults
    (:func:`jax_ub.flax.defaults`, read when the layer is called), the tensor-parallel
    axis resolved (``_axes.tp_axis``).

    The attributes every layer shares, keyword-only (documented by
    :class:`ColumnParallelLinear`)."""

    config: ParallelConfig | None = _setting()
    mesh: Mesh | None = _setting()
    axis_name: str | None = _setting()
    param_axes: str | tuple[str, ...] | None = _setting()
    kernel_axes: tuple[str | None, str | None] | None = _setting()
    impl: str | None = _setting()
    sequence_parallel: bool | None = _setting()
    fp8: bool | str | None = _setting()
    amax_history_length: int | None = _setting()
    seq_axis: int | None = _setting()
    dtype: Dtype | None = _setting()
    param_dtype: Dtype | None = _setting()
    kernel_init: Initializer = _setting(default_kernel_init)

    @nn.nowrap
    def resolved_config(self) -> ParallelConfig:
        owner = type(self).__name__
        given = {name: getattr(self, name) for name in _settings.FIELDS}
        config = _settings.resolve(owner, self.config, **given)
        axis = self._tp_axis(owner, config.axis_name, config.mesh)
        config = dataclasses.replace(config, axis_name=axis, owner=owner)
        if config.impl == "ub" and self.scope is not None and self.is_initializing():
            if config.mesh is None and jax.sharding.get_abstract_mesh().empty:
                if axis not in placement.manual_axes():
                    # An init traced with no mesh anywhere (a loop's jit(init,
                    # out_shardings=...)) runs the plain layer (_checks.without_mesh): the
                    # params' shapes do not depend on the collectives, and the steps on
                    # them find the mesh in their shardings. Said here, in the settings:
                    # only linen's scope knows it is initializing, and the settings are
                    # what reaches the checks and the runner (driver.over_axis, cached on
                    # them); a flag beside them would be a second key of every call.
                    config = dataclasses.replace(config, impl="xla")
        return config

    @nn.nowrap
    def _tp_axis(self, owner: str, axis_name: str | None, mesh: Mesh | None = None) -> str:
        """The axis ``_axes.tp_axis`` resolves from ``axis_name`` and the split dim's name."""
        return _axes.tp_axis(owner, axis_name, self._split_name(), mesh)

    @nn.nowrap
    def prepare(self, x: jax.Array, **kw) -> ParallelConfig:
        """The call's settings, checked against its input (``_checks.prepare``)."""
        params = lambda: self.variables.get("params")  # noqa: E731 (read only where needed)
        owner = type(self).__name__
        return _checks.prepare(owner, self.resolved_config(), x, params=params, **kw)

    @nn.nowrap
    def dropout_key(self, deterministic: bool | None) -> jax.Array | None:
        """This call's dropout key (the ``"dropout"`` rng), or None where no dropout runs:
        ``dropout_rate`` 0, or ``deterministic`` (the attribute's or the call's, as
        ``nn.merge_param`` merges them, as flax's attention does)."""
        _checks.check_dropout(type(self).__name__, self.dropout_rate)
        if self.dropout_rate == 0:
            return None
        if nn.merge_param("deterministic", self.deterministic, deterministic):
            return None
        return self.make_rng("dropout")


class Biased(SettingsModule):
    """:class:`SettingsModule` with the layers' bias: ``use_bias`` and ``bias_init``."""

    use_bias: bool = _setting(True)
    bias_init: Initializer = _setting(default_bias_init)


class _ParallelLinear(Biased):
    """Shared fields, checks and parameter creation of the two parallel layers, shaped as
    ``nn.DenseGeneral``'s."""

    features: int | Sequence[int]
    axis: int | Sequence[int] = _setting(-1)

    # Set by subclasses: "column" or "row".
    _kind: ClassVar[str]

    @nn.nowrap
    def _tp_axis(self, owner: str, axis_name: str | None, mesh: Mesh | None = None) -> str:
        return self._split(axis_name, mesh)[1]

    @nn.nowrap
    def _split(self, axis_name: str | None, mesh: Mesh | None = None) -> tuple[int, str]:
        """``(kernel dim, mesh axis)`` of the split (``_axes.choose_split``)."""
        owner = type(self).__name__
        names, mesh_names = self._kernel_names()
        n_in = len(_projection.canonical_axes(owner, self.axis))
        return _axes.choose_split(
            owner, self._kind, n_in, names, axis_name, mesh_names=mesh_names, mesh=mesh
        )

    @nn.nowrap
    def _kernel_names(self) -> tuple[tuple | None, bool]:
        """The kernel's names and whether they are mesh axes: ``kernel_axes`` (logical),
        or those of a ``kernel_init`` wrapped by ``nn.with_logical_partitioning`` (logical)
        or ``nn.with_partitioning`` (mesh axes)."""
        owner = type(self).__name__
        return _axes.given_names(owner, self.kernel_axes, self.kernel_init, self.param_axes)

    @nn.nowrap
    def projection(self, in_shape: Any) -> Projection:
        """The layer's shape on an input whose contracted (global) dims are ``in_shape``."""
        owner = type(self).__name__
        in_shape = _projection.canonical_shape(owner, "the input's features", in_shape)
        features = _projection.canonical_shape(owner, "features", self.features)
        n_in = len(_projection.canonical_axes(owner, self.axis, len(in_shape)))
        names, _ = self._kernel_names()
        if names is not None:
            _axes.check_kernel_axes(owner, names, n_in + len(features))
        split = self._split(self.resolved_config().axis_name)[0]
        return Projection(self._kind, in_shape, features, split, self.use_bias)

    @nn.nowrap
    def in_shape(self, inputs: jax.Array) -> tuple[int, ...]:
        """The global contracted dims of ``inputs`` (a row layer's split one is the local
        shard inside a shard_map over the axis)."""
        owner = type(self).__name__
        n_in = len(_projection.canonical_axes(owner, self.axis))
        shape = list(inputs.shape[max(inputs.ndim - n_in, 0) :])
        if self._kind == "row" and len(shape) == n_in:
            split, axis = self._split(self.resolved_config().axis_name)
            tp = self.tp_size(inputs, self.variables.get("params"))
            shape[split] = _checks.global_features(shape[split], tp, axis, split=True)
        return tuple(shape)

    @nn.nowrap
    def tp_size(self, *arrays: Any) -> int:
        """Size of the tensor-parallel axis; validates the settings. With no mesh set or
        given, the mesh that ``arrays`` (the call's inputs and params) are sharded over."""
        config, owner = self.resolved_config(), type(self).__name__
        return _checks.group_size(
            owner, config.axis_name, *arrays, mesh=config.mesh, impl=config.impl
        )

    @nn.compact
    def get_params(self, in_features: int | Sequence[int]) -> dict[str, Any]:
        """Create (at init) or fetch the global ``kernel [*in_features, *features]``, (with
        ``use_bias``) ``bias [*features]`` and (with ``fp8="delayed"``) the amax histories,
        as ``fp8: {"x", "w", "grad"}``.

        Blocks (and :func:`project`) call this to run several layers in one ``shard_map``.
        """
        owner = type(self).__name__
        config = self.resolved_config()
        shape = self.projection(in_features)
        names, mesh_names = self._kernel_names()
        boxed = names is not None and _projection.box_names(self.kernel_init)[0] is not None
        logical = None if names is None or mesh_names else names
        our = shape.names(owner, config.axis_name, self.param_axes, logical)
        if names is not None and mesh_names:
            our = {"kernel": names, "bias": names[shape.n_in :]}

        def box(base, names):
            if logical is not None:
                return nn.with_logical_partitioning(base, names, mesh=config.mesh)
            return nn.with_partitioning(base, names, mesh=config.mesh)

        def init(base, names, n_lead):
            base = _flat_init(base, n_lead)
            return base if boxed else box(base, names)  # a user's box keeps its names

        kernel_init = init(self.kernel_init, our["kernel"], shape.n_in)
        dtype = config.param_dtype
        param = functools.partial(local_or_param, self, config.axis_name, dtype=dtype)
        params = {"kernel": param("kernel", kernel_init, shape.kernel_shape, split=shape.split)}
        if self.use_bias:
            bias_init = init(self.bias_init, our["bias"], 0)
            split = shape.split - shape.n_in if shape.kind == "column" else None
            params["bias"] = param("bias", bias_init, shape.features, split=split)
        if config.fp8_recipe == "delayed":
            # Zeros: scale 1 until the first step records its amaxes (as flax's fp8 ops).
            zeros = lambda: jnp.zeros((config.amax_history_length,), jnp.float32)  # noqa: E731
            params["fp8"] = {
                k: self.variable(OVERWRITE_WITH_GRADIENT, name, box(zeros, (None,))).value
                for k, name in _fp8.HISTORY_NAMES.items()
            }
        return params

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` contracted with ``kernel``, plus ``bias``: ``[..., *in]`` ->
        ``[..., *features]``."""
        return project(inputs, self)


def local_or_param(
    module: nn.Module,
    axis_name: str,
    name: str,
    init: Any,
    shape: Sequence[int],
    dtype: Any,
    split: int | None,
) -> jax.Array:
    """``module.param(name, init, shape, dtype)`` (``shape`` global, dim ``split`` split over
    ``axis_name``, or None); inside a user's shard_map over ``axis_name`` the param as given,
    checked to be its local shard there (flax's param() would refuse it for not having the
    global shape)."""
    if axis_name not in placement.manual_axes() or not module.has_variable("params", name):
        return module.param(name, init, shape, dtype)
    value = module.get_variable("params", name)
    if isinstance(value, meta.Partitioned):  # no sharding constraint on a manual axis
        value = value.unbox(apply_constraint=False)
    local = list(shape)
    if split is not None:
        local[split] //= jax.lax.axis_size(axis_name)
    if tuple(value.shape) != tuple(local):
        raise ValueError(
            f"{type(module).__name__}: inside a shard_map over {axis_name!r} its {name} is "
            f"the local shard {tuple(local)} (the whole {tuple(shape)} split over the axis), "
            f"got {tuple(value.shape)}; give the shard_map the params' partition specs "
            "(nn.get_partition_spec)"
        )
    return value


def _flat_init(init: Any, n_lead: int) -> Any:
    """``init`` called as ``nn.DenseGeneral`` calls it: on the shape flattened to
    ``[prod(leading n_lead dims), prod(the rest)]`` (without leading dims, to one dim),
    so that a fan-in is that of the contracted dims; an n-d initializer on the shape
    itself, with ``in_axis`` and ``out_axis`` (``_projection.init_kernel``); a box keeps
    its names."""

    def call(key, shape, dtype=jnp.float32):
        value = _projection.init_kernel(init, key, shape, n_lead, dtype)
        if isinstance(value, nn.Partitioned):  # not constrained while flat (rank < names)
            return value.replace_boxed(jnp.reshape(value.unbox(apply_constraint=False), shape))
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return call


def project(inputs: jax.Array, *layers: _ParallelLinear) -> Any:
    """Linen version of :func:`jax_ub.flax.nnx.project`: ``inputs`` through each of
    ``layers``, column-parallel layers of one input gathered once, each keeping its own
    params. Call it where the layers are called, in the parent's ``@nn.compact`` method or
    ``setup``-defined one::

        >>> class QK(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         q = jax_ub.flax.linen.ColumnParallelLinear((8, 4), name="query")
        ...         k = jax_ub.flax.linen.ColumnParallelLinear((4, 4), name="key")
        ...         return jax_ub.flax.linen.project(x, q, k)
        >>> x = jnp.ones((32, 2, 16))
        >>> with jax.set_mesh(mesh):
        ...     variables = QK().init(jax.random.key(0), x)
        ...     q, k = jax.jit(QK().apply)(variables, x)
        >>> variables["params"]["query"]["kernel"].value.shape, q.shape, k.shape
        ((16, 8, 4), (32, 2, 8, 4), (32, 2, 4, 4))
    """
    if not layers or not all(isinstance(lay, _ParallelLinear) for lay in layers):
        raise ValueError(
            f"project: takes jax_ub's linen ColumnParallelLinear or RowParallelLinear "
            f"layers, got {[type(lay).__name__ for lay in layers]}"
        )
    first = layers[0]
    in_shape = first.in_shape(inputs)
    shapes = tuple(lay.projection(in_shape) for lay in layers)
    configs = [lay.resolved_config() for lay in layers]
    check_group(shapes, configs)
    divisible = {p.split_what: p.split_size for p in shapes}
    call = first.prepare(inputs, in_features=shapes[0], divisible=divisible)
    params = tuple(lay.get_params(in_shape) for lay in layers)
    out = _core.projection_call(shapes, call, inputs.ndim)(inputs, params)
    return out[0] if len(layers) == 1 and shapes[0].kind == "column" else out


class ColumnParallelLinear(_ParallelLinear):
    """Linen version of :class:`jax_ub.flax.ColumnParallelLinear`.

    Output features are split over ``axis_name``: the sequence-parallel input is
    all-gathered into the matmul with :func:`jax_ub.all_gather_matmul`, and each device adds
    its shard of the bias.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, sequence-sharded ``P(axis_name, None, ...)``
    * output ``[seq, *batch, features]``, feature-sharded ``P(None, ..., axis_name)``
    * params ``kernel [in_features, features]`` boxed as ``nn.Partitioned`` with names
      ``(param_axes, axis_name)``, ``bias [features]`` with ``(axis_name,)``

    Called as the NNX layer is: inside a shard_map over ``axis_name`` (local shards), or
    on global arrays from ``jit`` under ``jax.set_mesh(mesh)`` (or with ``mesh=``), where
    the other mesh axes stay XLA's.

    Example::

        >>> layer = jax_ub.flax.linen.ColumnParallelLinear(64, mesh=mesh)
        >>> x = jnp.ones((32, 2, 16))
        >>> variables = layer.init(jax.random.key(0), x)
        >>> nn.get_partition_spec(variables)["params"]["kernel"]
        P(None, 'tp')
        >>> jax.jit(layer.apply)(variables, x).shape
        (32, 2, 64)

    Attributes:
      features: number of output features, or a tuple of the output's feature dims, e.g.
        ``(heads, head_dim)`` (as ``nn.DenseGeneral``'s); the split one (the first, or the
        one the rules map to the axis) a multiple of ``tp``.
      axis: the input dims contracted, ``-1`` (default) or the last few in order, e.g.
        ``(-2, -1)``; a row-parallel layer splits the first (or the one the rules map).
      mesh: optional :class:`jax.sharding.Mesh` to run on when no mesh is set (default:
        the mesh set by ``jax.set_mesh``, or the enclosing shard_map's).
      axis_name: the tensor-parallel mesh axis (default: with ``kernel_axes``, the mesh
        axis the active ``nn.logical_axis_rules`` map the split dim's name to; else
        ``"tp"``).
      kernel_axes: logical names of the kernel's dims ``(*in, *out)``, e.g.
        ``("embed", "mlp")``, as flax's ``with_logical_partitioning`` takes them: the params
        are boxed ``nn.LogicallyPartitioned`` (the bias named as the output dims) and your
        ``logical_axis_rules`` map them to mesh axes. A ``kernel_init`` wrapped by
        ``nn.with_logical_partitioning`` (or ``nn.with_partitioning``: mesh axes) gives
        them instead, boxing the params itself. Instead of ``param_axes``.
      param_axes: mesh axis (or axes) splitting the kernel's other dim, e.g. ``"fsdp"``
        (default: None); XLA gathers them for the matmul.
      impl: ``"ub"`` (userbuffers), ``"xla"`` (lax collectives) or ``"auto"`` (default).
      config, sequence_parallel: as for :class:`jax_ub.flax.ColumnParallelLinear`. The
        settings of :class:`~jax_ub.flax.ParallelConfig` left None are ``config``'s, else
        those of the :func:`jax_ub.flax.defaults` active when the layer is called.
      use_bias, dtype, param_dtype, kernel_init, bias_init: as for ``nn.Dense``.
      fp8: run the matmul in fp8 (per-tensor scales; e4m3 forward, e5m2 gradients), in
        forward and backward; the collective moves fp8 bytes and the output is in the
        compute dtype. ``True`` or ``"current"``: current scaling (each tensor's amax this
        step); ``"delayed"``: delayed scaling from amax histories (below); ``False``: no
        fp8 (default).
      amax_history_length: steps of amaxes each delayed scale looks back over (default 16).
      seq_axis: the sequence dim of the input and output, split over ``axis_name``: 0
        (default) for ``[seq, *batch, in]``, 1 for batch-major ``[batch, seq, in]``.

    With ``fp8="delayed"`` the layer keeps the amax histories of flax's fp8 layers,
    ``input_amax_history``, ``kernel_amax_history`` and ``output_grad_amax_history``
    (float32 ``[amax_history_length]``, zeros at first, boxed ``nn.Partitioned`` with
    names ``(None,)``: replicated), in the ``"_overwrite_with_gradient"`` collection
    (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``). Scales and history updates are those
    of :class:`jax_ub.flax.ColumnParallelLinear`: differentiate the loss with respect to
    all the variables, step ``"params"`` with the optimizer and replace that collection by
    its gradient, as ``flax.training.train_state.TrainState.apply_gradients`` does when
    its ``params`` are the whole variables dict::

        >>> import optax
        >>> from flax.training.train_state import TrainState
        >>> layer = jax_ub.flax.linen.ColumnParallelLinear(64, mesh=mesh, fp8="delayed")
        >>> x = jax.random.normal(jax.random.key(1), (32, 2, 16))
        >>> variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
        >>> state = TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(0.1))
        >>> @jax.jit
        ... def train_step(state, x):
        ...     loss = lambda v: jnp.mean(state.apply_fn(v, x) ** 2)
        ...     return state.apply_gradients(grads=jax.grad(loss)(state.params))
        >>> state = train_step(state, x)
        >>> history = state.params["_overwrite_with_gradient"]["input_amax_history"]
        >>> bool(history[0] == jnp.max(jnp.abs(x))), bool(jnp.all(history[1:] == 0))
        (True, True)
    """

    _kind = "column"


class RowParallelLinear(_ParallelLinear):
    """Linen version of :class:`jax_ub.flax.RowParallelLinear`.

    Input features are split over ``axis_name``:
    :func:`jax_ub.matmul_reduce_scatter` sums the per-device partial products and scatters
    the sequence back over the devices; the bias is added once, after the reduction.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, feature-sharded ``P(None, ..., axis_name)``;
      ``in_features`` and ``seq`` multiples of ``tp``
    * output ``[seq, *batch, features]``, sequence-sharded ``P(axis_name, None, ...)``
    * params ``kernel [in_features, features]`` with names ``(axis_name, param_axes)``,
      ``bias [features]`` replicated

    Example::

        >>> layer = jax_ub.flax.linen.RowParallelLinear(16, mesh=mesh)
        >>> h = jnp.ones((32, 2, 64))
        >>> variables = layer.init(jax.random.key(0), h)
        >>> jax.jit(layer.apply)(variables, h).shape
        (32, 2, 16)

    Attributes: as for :class:`ColumnParallelLinear`.
    """

    _kind = "row"
