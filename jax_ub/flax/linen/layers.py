"""Tensor-parallel linear layers for Flax linen, overlapped through jax_ub."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.typing import Dtype, Initializer
from jax.sharding import Mesh

from jax_ub.flax import _axes, _core, _fp8

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()


class _ParallelLinear(nn.Module):
    """Shared fields, checks and parameter creation of the two parallel layers."""

    features: int
    mesh: Mesh | None = None
    axis_name: str | None = None
    param_axes: str | tuple[str, ...] | None = None
    kernel_axes: tuple[str | None, str | None] | None = None
    impl: str = "auto"
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    fp8: bool | str = False
    amax_history_length: int = _fp8.DEFAULT_HISTORY_LENGTH
    seq_axis: int = 0

    # Set by subclasses: "column" or "row".
    _kind: ClassVar[str]

    @nn.nowrap
    def resolved_axis(self) -> str:
        """The tensor-parallel mesh axis (``_axes.tp_axis``)."""
        split = _axes.split_name(self._kind, self.kernel_axes)
        return _axes.tp_axis(type(self).__name__, self.axis_name, split)

    @nn.nowrap
    def tp_size(self) -> int:
        """Size of the tensor-parallel axis; validates ``mesh``, ``axis_name``, ``impl``,
        ``fp8`` and ``amax_history_length``."""
        owner = type(self).__name__
        tp = _core.group_size(owner, self.mesh, self.resolved_axis(), impl=self.impl)
        _core.check_impl(owner, self.impl)
        _core.check_fp8(owner, self.fp8, self.amax_history_length)
        _core.check_seq_axis(owner, self.seq_axis)
        return tp

    @nn.compact
    def get_params(self, in_features: int) -> dict[str, Any]:
        """Create (at init) or fetch the global ``kernel``, (with ``use_bias``) ``bias`` and
        (with ``fp8="delayed"``) the amax histories, as ``fp8: {"x", "w", "grad"}``.

        Blocks call this to run several layers in one ``shard_map``.
        """
        owner = type(self).__name__
        if self.kernel_axes is None:
            axis = self.resolved_axis()
            names = _core.param_names(owner, self._kind, axis, self.use_bias, self.param_axes)

            def init(base, names):
                return nn.with_partitioning(base, names, mesh=self.mesh)
        else:  # logical names, mapped to mesh axes by the user's logical_axis_rules
            names = _axes.logical_param_names(self._kind, self.kernel_axes, owner, self.param_axes)

            def init(base, names):
                return nn.with_logical_partitioning(base, names, mesh=self.mesh)

        params = {
            "kernel": self.param(
                "kernel",
                init(self.kernel_init, names["kernel"]),
                (in_features, self.features),
                self.param_dtype,
            )
        }
        if self.use_bias:
            params["bias"] = self.param(
                "bias", init(self.bias_init, names["bias"]), (self.features,), self.param_dtype
            )
        if _fp8.recipe(self.fp8) == "delayed":
            # Zeros: scale 1 until the first step records its amaxes (as flax's fp8 ops).
            zeros = lambda: jnp.zeros((self.amax_history_length,), jnp.float32)  # noqa: E731
            params["fp8"] = {
                k: self.variable(OVERWRITE_WITH_GRADIENT, name, init(zeros, (None,))).value
                for k, name in _fp8.HISTORY_NAMES.items()
            }
        return params


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
      features: number of output features; a multiple of ``tp``.
      mesh: optional :class:`jax.sharding.Mesh` to run on when no mesh is set (default:
        the mesh set by ``jax.set_mesh``, or the enclosing shard_map's).
      axis_name: the tensor-parallel mesh axis (default: with ``kernel_axes``, the mesh
        axis the active ``nn.logical_axis_rules`` map the split dim's name to; else
        ``"tp"``).
      kernel_axes: logical names of the kernel's dims ``(in, out)``, e.g.
        ``("embed", "mlp")``, as flax's ``with_logical_partitioning`` takes them: the params
        are boxed ``nn.LogicallyPartitioned`` (the bias named as the output dim) and your
        ``logical_axis_rules`` map them to mesh axes. Instead of ``param_axes``.
      param_axes: mesh axis (or axes) splitting the kernel's other dim, e.g. ``"fsdp"``
        (default: None); XLA gathers them for the matmul.
      impl: ``"ub"`` (userbuffers), ``"xla"`` (lax collectives) or ``"auto"``.
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

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, features]``."""
        tp = self.tp_size()
        owner = type(self).__name__
        axis = self.resolved_axis()
        _core.check_divisible(owner, "features", self.features, tp, axis)
        sp = _core.check_input(owner, inputs, None, tp, axis, self.seq_axis)
        params = self.get_params(inputs.shape[-1])
        f = _core.linear_call(self._kind, *_core.op_settings(self), inputs.ndim, self.use_bias, sp)
        return f(inputs, params)


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

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, features]``."""
        tp = self.tp_size()
        owner = type(self).__name__
        axis = self.resolved_axis()
        sp = _core.check_input(owner, inputs, None, tp, axis, self.seq_axis)
        in_features = _core.global_features(inputs.shape[-1], tp, axis, split=True)
        _core.check_divisible(owner, "in_features", in_features, tp, axis)
        params = self.get_params(in_features)
        f = _core.linear_call(self._kind, *_core.op_settings(self), inputs.ndim, self.use_bias, sp)
        return f(inputs, params)
