"""What every jax_ub Flax NNX layer shares: its settings (keyword arguments over a
:class:`~jax_ub.flax.ParallelConfig`), params placed with their sharding names, amax
histories, the checks of a call, and dropout."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.nnx import variablelib
from flax.typing import Dtype, Initializer
from jax.sharding import Mesh

from jax_ub.flax import _axes, _checks, _settings
from jax_ub.flax._settings import ParallelConfig

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
    dim, split dim)``, or its ``kernel_init``'s box names: what it gives its projections."""
    given = {name: settings[name] for name in _settings.FIELDS}
    config = _settings.resolve(owner, settings["config"], **given)
    split = _axes.block_split_name(owner, settings["kernel_axes"], settings["param_axes"])
    axis_name = _axes.tp_axis(owner, config.axis_name, split, config.mesh)
    names = block_kernel_axes(owner, settings)
    boxed = settings["kernel_axes"] is None and names is not None and len(names) == 2
    if config.axis_name is None and boxed:  # a boxed kernel_init's split dim names the axis
        axis_name = _axes.box_split_axis(owner, names[1], config.mesh) or axis_name
    return dataclasses.replace(config, axis_name=axis_name, owner=owner)


def block_kernel_axes(owner: str, settings: dict[str, Any]) -> tuple | None:
    """A block's names ``(model dim, split dim)``: its ``kernel_axes``, or those its
    ``kernel_init`` boxes values with (``nnx.with_partitioning``), read as ``kernel_axes``
    are (not both)."""
    init, param_axes = settings["kernel_init"], settings["param_axes"]
    return _axes.given_names(owner, settings["kernel_axes"], init, param_axes)[0]


def check_split(owner: str, config: ParallelConfig, what: str, features: int) -> None:
    """``features`` (named ``what``) divide over the axis, where its size is known."""
    tp = _checks.group_size(owner, config.axis_name, mesh=config.mesh, required=False)
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


def prepare_call(owner: nnx.Module, inputs: jax.Array, first=None, **checks) -> ParallelConfig:
    """The settings of a call of ``owner`` on ``inputs`` (:func:`_checks.prepare`, its
    errors naming ``owner``'s class): those of ``first``, the layer the inputs go into
    (default: ``owner`` itself), checked against its ``in_features`` (a projection layer's
    ``projection``); ``checks`` are ``prepare``'s ``divisible``."""
    first, params = owner if first is None else first, lambda: nnx.state(owner, nnx.Param)
    in_features = getattr(first, "projection", first.in_features)
    args = (first.config, inputs, in_features)
    return _checks.prepare(type(owner).__name__, *args, params=params, **checks)


class ConfigFields:
    """A layer's :class:`~jax_ub.flax.ParallelConfig` as ``config``, and its fields as
    attributes: ``layer.impl = "xla"`` replaces the record by a checked copy. The settings
    its params were made for (``axis_name``, ``param_dtype``; delayed fp8 and its history
    length) stay as built: changing one raises a ValueError."""

    config: ParallelConfig


def _check_unbuilt_change(owner: str, old: ParallelConfig, new: ParallelConfig) -> None:
    """``old`` -> ``new`` changes none of the settings ``owner``'s params were made for."""
    delayed = old.fp8_recipe == "delayed"
    fixed = ["axis_name", "param_dtype"] + (["amax_history_length"] if delayed else [])
    same = {"param_dtype": lambda a, b: jnp.dtype(a) == jnp.dtype(b)}  # np.float32 is "float32"
    changed = [n for n in fixed if not same.get(n, operator.eq)(getattr(old, n), getattr(new, n))]
    if delayed != (new.fp8_recipe == "delayed"):
        changed.append("fp8")  # delayed scaling's amax histories are made with the params
    if changed:
        name = changed[0]
        raise ValueError(
            f"{owner}: {name} is fixed once the layer is built (its params were made for "
            f"{name}={getattr(old, name)!r}); build the layer with "
            f"{name}={getattr(new, name)!r} instead"
        )


def _setting(name: str) -> property:
    def get(self):
        return getattr(self.config, name)

    def set(self, value):
        owner = type(self).__name__
        new = dataclasses.replace(self.config, owner=owner, **{name: value})
        _check_unbuilt_change(owner, self.config, new)
        self.config = new

    return property(get, set, doc=f"The layer's ``config.{name}``.")


for _name in _settings.FIELDS:
    setattr(ConfigFields, _name, _setting(_name))


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
