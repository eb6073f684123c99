"""Tensor-parallel linear layers for Flax NNX, overlapped through jax_ub."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypedDict

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.nnx import variablelib
from flax.typing import Dtype, Initializer
from jax.sharding import Mesh

from jax_ub.flax import _axes, _checks, _core, _fp8, _settings
from jax_ub.flax._settings import ParallelConfig

if TYPE_CHECKING:
    from typing_extensions import Unpack

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


def _overwrite_with_gradient_type() -> type[nnx.Variable]:
    """The NNX variable type of linen's ``"_overwrite_with_gradient"`` collection: the one
    ``nnx.bridge`` gives flax's own fp8 layers' amax histories and scales, so that one
    filter selects both; registered here under that name when nothing has yet."""
    try:
        return variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT)
    except ValueError:

        class OverwriteWithGradient(nnx.Variable):
            """State a training step overwrites with its gradient (flax's
            OVERWRITE_WITH_GRADIENT), e.g. fp8 amax histories."""

        return variablelib.register_variable_name(OVERWRITE_WITH_GRADIENT, OverwriteWithGradient)


OverwriteWithGradient = _overwrite_with_gradient_type()


def sharded_param(
    value: jax.Array, names: tuple, mesh: Mesh | None, kind: type[nnx.Variable] = nnx.Param
) -> nnx.Variable:
    """A ``kind`` variable (a param by default) carrying its sharding names; placed on
    ``mesh`` (or the mesh set by ``jax.set_mesh``) when one is known, else left where it
    is until the user shards it."""
    if mesh is None and jax.sharding.get_abstract_mesh().empty:
        return kind(value, out_sharding=names, eager_sharding=False)
    return kind(value, out_sharding=names, mesh=mesh)


class Settings(TypedDict, total=False):
    """The keyword settings every NNX layer takes, as :class:`ColumnParallelLinear`
    documents them; a layer's constructor takes them as ``**settings``."""

    config: ParallelConfig | None
    mesh: Mesh | None
    axis_name: str | None
    param_axes: str | tuple[str, ...] | None
    kernel_axes: tuple[str | None, str | None] | None
    impl: str | None
    sequence_parallel: bool | None
    fp8: bool | str | None
    amax_history_length: int | None
    seq_axis: int | None
    dtype: Dtype | None
    param_dtype: Dtype | None
    kernel_init: Initializer


class BiasedSettings(Settings, total=False):
    """:class:`Settings` and the bias of the layers that have one."""

    use_bias: bool
    bias_init: Initializer


_DEFAULTS = dict.fromkeys(Settings.__annotations__) | {"kernel_init": default_kernel_init}
_BIAS_DEFAULTS = {"use_bias": True, "bias_init": default_bias_init}


def take_settings(owner: str, given: dict[str, Any], bias: bool = True) -> dict[str, Any]:
    """The settings ``given`` to a constructor as ``**settings``, each one there (its
    default where not given); a name that is not one (with ``bias``, of
    :class:`BiasedSettings`, else of :class:`Settings`) raises a TypeError as Python does."""
    defaults = _DEFAULTS | (_BIAS_DEFAULTS if bias else {})
    for name in given:
        if name not in defaults:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    return defaults | given


def block_config(owner: str, settings: dict[str, Any]) -> ParallelConfig:
    """A block's settings (from :func:`take_settings`) over ``config`` or the model
    defaults, with its tensor-parallel axis resolved from its ``kernel_axes`` ``(model
    dim, split dim)``: what it gives its projections."""
    given = {name: settings[name] for name in _settings.FIELDS}
    config = _settings.resolve(owner, settings["config"], **given)
    split = _axes.block_split_name(owner, settings["kernel_axes"], settings["param_axes"])
    axis_name = _axes.tp_axis(owner, config.axis_name, split)
    return dataclasses.replace(config, axis_name=axis_name, owner=owner)


def check_split(owner: str, config: ParallelConfig, what: str, features: int) -> None:
    """``features`` (named ``what``) divide over the axis, where its size is known."""
    tp = _checks.group_size(owner, config.mesh, config.axis_name, required=False)
    if tp is not None:
        _checks.check_divisible(owner, what, features, tp, config.axis_name)


def add_histories(module: nnx.Module, names: Iterable[str], config: ParallelConfig) -> None:
    """With ``fp8="delayed"``, the amax histories ``names`` of ``module``: float32
    ``[amax_history_length]`` zeros (scale 1 until the first step records its amaxes, as
    flax's fp8 ops), replicated, :class:`OverwriteWithGradient` variables."""
    if config.fp8_recipe != "delayed":
        return
    history = jnp.zeros((config.amax_history_length,), jnp.float32)
    for name in names:
        setattr(module, name, sharded_param(history, (None,), config.mesh, OverwriteWithGradient))


def prepare_call(owner: nnx.Module, inputs: jax.Array, first=None, **checks) -> tuple:
    """``(the ops' settings, sequence-parallel)`` for a call of ``owner`` on ``inputs``
    (:func:`_checks.prepare`, its errors naming ``owner``'s class): the settings, axis and
    ``in_features`` are those of ``first``, the layer the inputs go into (default: ``owner``
    itself); ``checks`` are ``prepare``'s ``split_in`` and ``divisible``."""
    first, params = owner if first is None else first, lambda: nnx.state(owner, nnx.Param)
    args = (first.config, first.axis_name, inputs, first.in_features)
    return _checks.prepare(type(owner).__name__, *args, params=params, **checks)


class Configured:
    """A layer's :class:`~jax_ub.flax.ParallelConfig` as ``config``, and its fields as
    attributes: ``layer.impl = "xla"`` replaces the record by a checked copy."""

    config: ParallelConfig

    def _configure(self, owner: str, config: ParallelConfig | None, given: dict, axis) -> None:
        """Settle the settings ``given`` (keyword arguments, None where not given) over
        ``config`` or the model defaults, the tensor-parallel axis resolved as ``axis``
        (``_axes.tp_axis``'s split name) says."""
        config = _settings.resolve(owner, config, **given)
        axis_name = _axes.tp_axis(owner, config.axis_name, axis)
        self.config = dataclasses.replace(config, axis_name=axis_name, owner=owner)


def _setting(name: str) -> property:
    def get(self):
        return getattr(self.config, name)

    def set(self, value):
        self.config = dataclasses.replace(self.config, owner=type(self).__name__, **{name: value})

    return property(get, set, doc=f"The layer's ``config.{name}``.")


for _name in _settings.FIELDS:
    setattr(Configured, _name, _setting(_name))


class Dropping:
    """The dropout of a block (of its hidden activations or attention weights), with
    ``nnx.Dropout``'s conventions: ``dropout_rate``; ``deterministic`` set when built, by
    ``nnx.view(model, deterministic=...)`` or per call (the call's wins); the key from the
    call's ``rngs`` or else the ``dropout`` stream of the ``rngs`` the block was built
    with (forked)."""

    dropout_rate: float
    deterministic: bool | None

    def _init_dropout(
        self, owner: str, rate: float, deterministic: bool | None, rngs: nnx.Rngs
    ) -> None:
        _checks.check_dropout(owner, rate)
        self.dropout_rate, self.deterministic = float(rate), deterministic
        self.rngs = rngs.dropout.fork() if rate > 0 else nnx.data(None)

    def _dropout_key(self, deterministic: bool | None, rngs) -> jax.Array | None:
        """This call's dropout key, or None where no dropout runs (rate 0, deterministic)."""
        owner = type(self).__name__
        if self.dropout_rate == 0:
            return None
        deterministic = nnx.module.first_from(
            deterministic,
            self.deterministic,
            error_msg=f"{owner}: dropout_rate={self.dropout_rate} needs `deterministic`: "
            "pass it to the constructor or the call, or use nnx.view(model, deterministic=...)",
        )
        if deterministic:
            return None
        rngs = self.rngs if rngs is None else rngs
        if isinstance(rngs, nnx.Rngs):
            return rngs.dropout()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if rngs is None:
            raise ValueError(f"{owner}: deterministic=False needs rngs for the dropout masks")
        return rngs  # a key

    def set_view(self, deterministic: bool | None = None, **_) -> None:
        """For ``nnx.view``: ``deterministic=True`` turns dropout off."""
        if deterministic is not None:
            self.deterministic = deterministic


class _ParallelLinear(Configured, nnx.Module):
    """Shared constructor: global-shaped params carrying their sharding over ``axis_name``."""

    # Set by subclasses: which features are split over the axis, and the layer's kind.
    _split: str
    _kind: str

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        **settings: Unpack[BiasedSettings],
    ):
        owner = type(self).__name__
        s = take_settings(owner, settings)
        kernel_axes, param_axes, use_bias = s["kernel_axes"], s["param_axes"], s["use_bias"]
        if kernel_axes is not None:  # checked before the names resolve the axis
            _axes.logical_param_names(self._kind, kernel_axes, owner, param_axes)
        given = {name: s[name] for name in _settings.FIELDS}
        split_name = _axes.split_name(self._kind, kernel_axes)
        self._configure(owner, s["config"], given, split_name)
        cfg = self.config
        split = {"in_features": in_features, "out_features": out_features}[self._split]
        check_split(owner, cfg, self._split, split)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        if kernel_axes is None:
            names = _core.param_names(owner, self._kind, cfg.axis_name, use_bias, param_axes)
        else:  # logical names, which the user's logical_axis_rules map to mesh axes
            names = _axes.logical_param_names(self._kind, kernel_axes, owner, param_axes)
        kernel = s["kernel_init"](rngs.params(), (in_features, out_features), cfg.param_dtype)
        self.kernel = sharded_param(kernel, names["kernel"], cfg.mesh)
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            bias = s["bias_init"](rngs.params(), (out_features,), cfg.param_dtype)
            self.bias = sharded_param(bias, names["bias"], cfg.mesh)
        else:
            self.bias = nnx.data(None)
        add_histories(self, _fp8.HISTORY_NAMES.values(), cfg)

    def param_values(self) -> dict[str, jax.Array]:
        """The global arrays the ops take: ``kernel``, with ``use_bias`` ``bias``, and with
        ``fp8="delayed"`` the amax histories as ``fp8: {"x", "w", "grad"}``."""
        values = {"kernel": self.kernel[...]}
        if self.bias is not None:
            values["bias"] = self.bias[...]
        if self.config.fp8_recipe == "delayed":
            values["fp8"] = {k: getattr(self, n)[...] for k, n in _fp8.HISTORY_NAMES.items()}
        return values

    def _config(self, inputs: jax.Array) -> tuple:
        split = {"in_features": self.in_features, "out_features": self.out_features}[self._split]
        ops, sp = prepare_call(
            self, inputs, split_in=self._split == "in_features", divisible={self._split: split}
        )
        return ops, inputs.ndim, self.use_bias, sp


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer whose output features are split over a tensor-parallel axis.

    The sequence-parallel input is all-gathered into the matmul with
    :func:`jax_ub.all_gather_matmul`, so the gather of one chunk overlaps the GEMM of the
    previous one. Each device multiplies the full sequence by its column shard of the
    kernel and adds its shard of the bias.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, sequence-sharded: ``P(axis_name, None, ...)``
    * output ``[seq, *batch, out_features]``, feature-sharded: ``P(None, ..., axis_name)``
    * ``kernel [in_features, out_features]`` sharded ``P(param_axes, axis_name)``,
      ``bias [out_features]`` sharded ``P(axis_name)``

    Three ways to call it, as the ops: inside a ``shard_map`` over ``axis_name`` (on local
    shards: pass the params in with ``nnx.get_partition_spec``'s specs); from ``jit`` under
    ``jax.set_mesh(mesh)`` or with ``mesh=`` given, on global arrays, where every other
    mesh axis stays XLA's (a batch dim sharded over ``dp`` stays sharded, an ``fsdp``
    kernel is gathered by XLA). No mesh is needed to build the layer; with one (``mesh=``
    or ``jax.set_mesh``) the params are created sharded on it, under ``jit`` too.

    Pair it with :class:`RowParallelLinear`, which takes the feature-sharded output back to
    sequence-parallel, with nothing but elementwise ops in between.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jax.sharding import AxisType, PartitionSpec as P
        >>> import jax_ub.flax
        >>> mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2,
        ...                      devices=jax.devices()[:4])

        From ``jit`` under a mesh: the batch stays split over ``dp`` (XLA's), the sequence
        is gathered over ``tp`` inside the matmul (jax_ub's)::

        >>> with jax.set_mesh(mesh):
        ...     layer = jax_ub.flax.ColumnParallelLinear(16, 64, rngs=nnx.Rngs(0))
        ...     x = jax.device_put(jnp.ones((32, 4, 16)), P("tp", "dp"))  # [seq, batch, in]
        ...     y = nnx.jit(lambda layer, x: layer(x))(layer, x)
        >>> layer.kernel[...].sharding.spec
        P(None, 'tp')
        >>> y.shape, y.sharding.spec
        ((32, 4, 64), P(None, 'dp', 'tp'))

        Inside your own ``shard_map`` over ``tp`` (here partial-auto: ``dp`` stays XLA's),
        on the local shards of the params, with no mesh given to the layer::

        >>> graphdef, state = nnx.split(layer)
        >>> body = lambda state, x: nnx.merge(graphdef, state)(x)
        >>> f = jax.shard_map(body, mesh=mesh, axis_names={"tp"}, out_specs=P(None, None, "tp"),
        ...                   in_specs=(nnx.get_partition_spec(state), P("tp")))
        >>> jax.jit(f)(state, x).shape
        (32, 4, 64)

    Delayed scaling, ``fp8="delayed"``, is flax's fp8 recipe (``Fp8DirectDotGeneralOp``):
    the layer keeps float32 ``[amax_history_length]`` amax histories of its input, kernel
    and output gradient, ``input_amax_history``, ``kernel_amax_history`` and
    ``output_grad_amax_history`` (zeros at first, replicated), as
    :class:`OverwriteWithGradient` variables. A step's scale of each tensor is
    ``max(history) / fp8_max`` (1 while the history is all zeros); the gradient of each
    history is the history with this step's amax of its tensor rolled in front, and a
    training step overwrites the histories with their gradients (flax's
    OVERWRITE_WITH_GRADIENT convention). Differentiate with respect to them as well as
    the params; the optimizer (``wrt=nnx.Param``) steps the params, and the histories are
    overwritten. A step that differentiates the params only leaves them, and so the scales,
    as they are. Call each fp8 layer once per step: the gradient of a history read twice
    is the sum of two updated histories::

        >>> import optax
        >>> owg = jax_ub.flax.OverwriteWithGradient
        >>> @nnx.jit
        ... def train_step(model, optimizer, x):
        ...     loss = lambda model: jnp.mean(model(x) ** 2)
        ...     wrt = nnx.DiffState(0, nnx.Any(nnx.Param, owg))  # params and histories
        ...     grads = nnx.grad(loss, argnums=wrt)(model)
        ...     optimizer.update(model, grads)  # steps the params (wrt=nnx.Param) only
        ...     nnx.update(model, nnx.state(grads, owg))  # overwrites the histories
        >>> with jax.set_mesh(mesh):
        ...     model = jax_ub.flax.ColumnParallelLinear(16, 64, fp8="delayed", rngs=nnx.Rngs(0))
        ...     optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        ...     x = jax.random.normal(jax.random.key(1), (32, 4, 16))
        ...     for _ in range(3):
        ...         train_step(model, optimizer, x)
        >>> history = model.input_amax_history[...]  # float32 [16]: 3 steps' amaxes, then 0s
        >>> bool(jnp.all(history[:3] == jnp.max(jnp.abs(x)))), bool(jnp.all(history[3:] == 0))
        (True, True)

    Args:
      in_features: number of input features.
      out_features: number of output features; a multiple of ``tp``.
      config: a :class:`~jax_ub.flax.ParallelConfig` of the settings below from ``mesh``
        to ``param_dtype`` (default: the model defaults, :func:`jax_ub.flax.defaults`);
        those given as keyword arguments take precedence. A setting left None is the
        config's (its default where none is given).
      mesh: optional :class:`jax.sharding.Mesh` to create the params on and to run on when
        no mesh is set (default: the mesh set by ``jax.set_mesh``, or the enclosing
        shard_map's).
      axis_name: the tensor-parallel mesh axis (default: with ``kernel_axes``, the mesh
        axis the ``logical_axis_rules`` active when the layer is built map the split dim's
        name to; else ``"tp"``).
      kernel_axes: logical names of the kernel's dims ``(in, out)``, e.g.
        ``("embed", "mlp")``: the params carry them as their sharding names (the bias the
        output dim's), which your ``logical_axis_rules`` map to mesh axes
        (``nnx.get_partition_spec`` under the rules). Instead of ``param_axes``.
      param_axes: mesh axis (or axes) splitting the kernel's other dim, e.g. ``"fsdp"``
        (default: None, replicated). Only where the params are placed: XLA gathers them
        for the matmul.
      impl: ``"ub"`` (userbuffers), ``"xla"`` (lax collectives) or ``"auto"`` (default).
      sequence_parallel: the activations' layout: None (default) sequence-parallel where
        ``tp`` divides the sequence, else replicated over the axis; True always
        sequence-parallel; False replicated (no sequence parallelism). See
        :class:`~jax_ub.flax.ParallelConfig`.
      fp8: run the matmul in fp8 (per-tensor scales; e4m3 forward, e5m2 gradients), in
        forward and backward; the collective moves fp8 bytes and the output is in the
        compute dtype. ``True`` or ``"current"``: current scaling (each tensor's amax this
        step); ``"delayed"``: delayed scaling from amax histories kept in the layer (see
        below); ``False``: no fp8 (default).
      amax_history_length: steps of amaxes each delayed scale looks back over (default 16).
      seq_axis: the sequence dim of the input (and output), the one split over
        ``axis_name``: 0 (default) for ``[seq, *batch, in_features]``, 1 for batch-major
        ``[batch, seq, in_features]``; not the last (see :func:`jax_ub.all_gather_matmul`).
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      kernel_init: initializer for the global ``[in_features, out_features]`` kernel.
      bias_init: initializer for the global ``[out_features]`` bias.
      rngs: rng key.
    """

    _split = "out_features"
    _kind = "column"

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, out]``."""
        return _core.linear_call(self._kind, *self._config(inputs))(inputs, self.param_values())


class RowParallelLinear(_ParallelLinear):
    """A linear layer whose input features are split over a tensor-parallel axis.

    Each device multiplies its feature shard of the input by its row shard of the kernel;
    :func:`jax_ub.matmul_reduce_scatter` sums the partial products and scatters the
    sequence back over the devices, overlapped with the GEMM. The bias is added once,
    after the reduction.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, feature-sharded: ``P(None, ..., axis_name)``
    * output ``[seq, *batch, out_features]``, sequence-sharded: ``P(axis_name, None, ...)``
    * ``kernel [in_features, out_features]`` sharded ``P(axis_name, param_axes)``,
      ``bias [out_features]`` replicated

    Example::

        >>> layer = jax_ub.flax.RowParallelLinear(64, 16, mesh=mesh, rngs=nnx.Rngs(0))
        >>> y = jax.jit(layer)(jnp.ones((32, 2, 64)))
        >>> y.shape, y.sharding.spec
        ((32, 2, 16), P('tp',))

        ``mesh=`` is the third way: the layer runs on that mesh when none is set.

    Args:
      in_features: number of input features; a multiple of ``tp``.
      out_features: number of output features.
      config, mesh, axis_name, param_axes, impl, sequence_parallel, fp8, seq_axis,
        use_bias, dtype, param_dtype, kernel_init, bias_init, rngs: as for
        :class:`ColumnParallelLinear`. ``seq`` must be
        a multiple of ``tp``.
    """

    _split = "in_features"
    _kind = "row"

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, out]``."""
        return _core.linear_call(self._kind, *self._config(inputs))(inputs, self.param_values())
