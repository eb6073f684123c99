"""Tensor-parallel linear layers for Flax NNX, overlapped through jax_ub."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from flax.nnx import variablelib

from jax_ub.flax import _axes, _core, _fp8, _projection, _settings
from jax_ub.flax._projection import check_group
from jax_ub.flax.nnx.base import (
    BiasedSettings,
    ConfigFields,
    add_histories,
    check_split,
    prepare_call,
    sharded_param,
    take_settings,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _ParallelLinear(ConfigFields, nnx.Module):
    """Shared constructor: global-shaped params carrying their sharding over ``axis_name``,
    shaped as ``nnx.LinearGeneral``'s."""

    # Set by subclasses: "column" or "row".
    _kind: str

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        kernel_metadata: Mapping[str, Any] | None = None,
        bias_metadata: Mapping[str, Any] | None = None,
        rngs: nnx.Rngs,
        **settings: Unpack[BiasedSettings],
    ):
        owner = type(self).__name__
        s = take_settings(owner, settings)
        in_shape = _projection.canonical_shape(owner, "in_features", in_features)
        features = _projection.canonical_shape(owner, "out_features", out_features)
        self.axis = _projection.canonical_axes(owner, axis, len(in_shape))
        config = _settings.resolve(owner, s["config"], **{k: s[k] for k in _settings.FIELDS})
        key = rngs.params()
        kernel, kernel_names = _init(owner, s["kernel_init"], key, in_shape, features, config)
        kernel_names = _metadata_names(owner, "kernel_metadata", kernel_metadata, kernel_names)
        logical = _axes.kernel_names(owner, s["kernel_axes"], kernel_names, s["param_axes"])
        if logical is not None:
            _axes.check_kernel_axes(owner, logical, len(in_shape + features))
        kind, axis_name = self._choose_kind(owner, len(in_shape), logical, config)
        split = len(in_shape)
        if kind != "replicated":
            split, axis_name = _axes.choose_split(
                owner, kind, len(in_shape), logical, axis_name, mesh=config.mesh
            )
        axis_name = axis_name or _axes.DEFAULT_AXIS
        self.config = cfg = dataclasses.replace(config, axis_name=axis_name, owner=owner)
        shape = _projection.Projection(kind, in_shape, features, split, s["use_bias"])
        if kind != "replicated":
            check_split(owner, cfg, shape.split_what, shape.split_size)
        self.projection = nnx.static(shape)
        # nnx.Linear's and nnx.LinearGeneral's attributes (ints where they are).
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = s["use_bias"]
        names = shape.names(owner, axis_name, s["param_axes"], logical)
        self.kernel = sharded_param(kernel, names["kernel"], cfg.mesh)
        self.bias: nnx.Param[jax.Array] | None = nnx.data(None)
        if self.use_bias:
            bias, bias_names = _init(owner, s["bias_init"], rngs.params(), (), features, config)
            bias_names = _metadata_names(owner, "bias_metadata", bias_metadata, bias_names)
            self.bias = sharded_param(bias, bias_names or names["bias"], cfg.mesh)
        add_histories(self, _fp8.HISTORY_NAMES.values(), cfg)

    def _choose_kind(self, owner: str, n_in: int, names: Any, config: Any) -> tuple:
        """``(kind, tensor-parallel axis or None)``: the class's own, over the config's."""
        del owner, n_in, names
        return self._kind, config.axis_name

    def param_values(self) -> dict[str, jax.Array]:
        """The global arrays the ops take: ``kernel``, with ``use_bias`` ``bias``, and with
        ``fp8="delayed"`` the amax histories as ``fp8: {"x", "w", "grad"}``."""
        values = {"kernel": self.kernel[...]}
        if self.bias is not None:
            values["bias"] = self.bias[...]
        if self.config.fp8_recipe == "delayed":
            values["fp8"] = {k: getattr(self, n)[...] for k, n in _fp8.HISTORY_NAMES.items()}
        return values

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` contracted with ``kernel``, plus ``bias``: ``[..., *in_features]`` ->
        ``[..., *out_features]``."""
        return project(inputs, self)


def _init(owner: str, init: Any, key: jax.Array, in_shape: tuple, features: tuple, config) -> tuple:
    """``(value, sharding names or None)`` of a param ``[*in_shape, *features]`` from
    ``init``, called as ``nnx.LinearGeneral`` calls it (on the flattened shape, so that a
    fan-in is that of the contracted dims), or an n-d initializer on the shape itself with
    ``in_axis`` and ``out_axis`` (``_projection.init_kernel``); the names are those an
    initializer wrapped by ``nnx.with_partitioning`` gives."""
    shape = in_shape + features
    value = _projection.init_kernel(init, key, shape, len(in_shape), config.param_dtype)
    names = None
    if isinstance(value, meta.Partitioned):
        raise TypeError(
            f"{owner}: its initializer boxed the value as linen's "
            f"{type(value).__name__} (names {value.names}); NNX layers take NNX's wrappers: "
            "nnx.with_partitioning(init, names), not nn.with_partitioning"
        )
    if isinstance(value, variablelib.VariableMetadata):
        held = _projection.nnx_box_key(value)
        names = None if held is None else value.metadata[held]
        value = value.raw_value
    return jnp.reshape(value, in_shape + features), None if names is None else tuple(names)


def _metadata_names(owner: str, what: str, metadata: Any, names: tuple | None) -> tuple | None:
    """The sharding names in ``nnx.LinearGeneral``'s ``kernel_metadata`` /
    ``bias_metadata`` (the only metadata the layers take), else ``names``."""
    if not metadata:
        return names
    unknown = sorted(set(metadata) - set(_projection.NNX_NAME_KEYS))
    given = [metadata[k] for k in _projection.NNX_NAME_KEYS if metadata.get(k) is not None]
    if unknown or len(given) != 1 or names is not None:
        raise ValueError(
            f"{owner}: {what} may hold the params' sharding names alone (one of "
            f"{_projection.NNX_NAME_KEYS}), not also given by the initializer; got "
            f"{dict(metadata)!r}"
        )
    return tuple(given[0])


def project(inputs: jax.Array, *layers: _ParallelLinear) -> Any:
    """``inputs`` through each of ``layers``, column-parallel layers of one input (q, k
    and v; gate and up) gathered once: their kernels' shards run side by side in one
    :func:`jax_ub.all_gather_matmul`, so one all-gather feeds them all, and each layer keeps
    its own params (the checkpoint's layout). Returns a tuple of their outputs, each as the
    layer alone returns it (in fp8, the side-by-side kernels share one scale: each output
    then differs from its layer's alone by fp8 rounding); with one layer (column or row),
    its output.

    Example: a Llama-style attention's projections, each built as ``nnx.LinearGeneral``
    would be, run from one gather of ``x`` (``[seq, batch, embed]``)::

        >>> q_proj = jax_ub.flax.ColumnParallelLinear(16, (8, 4), mesh=mesh, rngs=nnx.Rngs(0))
        >>> k_proj = jax_ub.flax.ColumnParallelLinear(16, (4, 4), mesh=mesh, rngs=nnx.Rngs(1))
        >>> q, k = jax.jit(jax_ub.flax.nnx.project)(jnp.ones((32, 2, 16)), q_proj, k_proj)
        >>> q.shape, k.shape, q.sharding.spec  # heads split over tp
        ((32, 2, 8, 4), (32, 2, 4, 4), P(None, None, 'tp'))
    """
    first = layers[0]
    shapes = _check_group(layers)
    p0 = shapes[0]
    divisible = {p.split_what: p.split_size for p in shapes}
    call = prepare_call(first, inputs, divisible=divisible)
    f = _core.projection_call(shapes, call, inputs.ndim)
    out = f(inputs, tuple(layer.param_values() for layer in layers))
    return out[0] if len(layers) == 1 and p0.kind == "column" else out


def _check_group(layers: Sequence[Any]) -> tuple:
    """The layers' projections, checked to run from one input as one."""
    if not layers or not all(isinstance(lay, _ParallelLinear) for lay in layers):
        raise ValueError(
            f"project: takes jax_ub's ColumnParallelLinear or RowParallelLinear layers, got "
            f"{[type(lay).__name__ for lay in layers]}"
        )
    shapes = tuple(lay.projection for lay in layers)
    check_group(shapes, [lay.config for lay in layers])
    return shapes


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
      in_features: number of input features, or a tuple of the contracted dims' sizes
        (as ``nnx.LinearGeneral``'s; they are the input's last dims, ``axis``).
      out_features: number of output features, or a tuple of the output's feature dims,
        e.g. ``(heads, head_dim)``; the split one (the first, or the one the rules map to
        the axis) a multiple of ``tp``.
      axis: the input dims contracted, ``-1`` (default) or the last few in order, e.g.
        ``(-2, -1)`` for ``[..., heads, head_dim]``.
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
      kernel_axes: logical names of the kernel's dims ``(*in, *out)``, e.g.
        ``("embed", "mlp")`` or ``("embed", "heads", "head_dim")``: the params carry them as
        their sharding names (the bias the output dims'), which your ``logical_axis_rules``
        map to mesh axes (``nnx.get_partition_spec`` under the rules); the split dim is the
        first output dim (row: contracted dim) the rules map to a mesh axis. A
        ``kernel_init`` wrapped by ``nnx.with_partitioning`` gives them too. Instead of
        ``param_axes``.
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
      kernel_init: initializer for the global ``[*in_features, *out_features]`` kernel,
        called on its flattened ``[in, out]`` shape as ``nnx.LinearGeneral`` calls it.
      bias_init: initializer for the global ``[*out_features]`` bias.
      rngs: rng key.
    """

    _kind = "column"


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
      in_features: number of input features, or a tuple of the contracted dims' sizes
        (e.g. ``(heads, head_dim)`` with ``axis=(-2, -1)``); the split one (the first, or
        the one the rules map to the axis) a multiple of ``tp``.
      out_features: number of output features, or a tuple of them.
      config, mesh, axis_name, axis, kernel_axes, param_axes, impl, sequence_parallel,
        fp8, seq_axis, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs: as for
        :class:`ColumnParallelLinear`. ``seq`` must be a multiple of ``tp``.
    """

    _kind = "row"
