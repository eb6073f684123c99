"""The gated MLP block (SwiGLU, GeGLU) for Flax NNX, tensor-parallel (:func:`jax_ub.gated_mlp`).

Also exported by :mod:`jax_ub.flax`, :mod:`jax_ub.flax.nnx` and :mod:`jax_ub.flax.nnx.blocks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from flax import nnx

from jax_ub.flax import _gated
from jax_ub.flax.nnx.base import (
    ConfigFields,
    Dropping,
    Settings,
    add_histories,
    block_config,
    block_kernel_axes,
    check_split,
    prepare_call,
    sharded_param,
    take_settings,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ParallelGatedMLP(ConfigFields, Dropping, nnx.Module):
    """The gated MLP of Llama, Mistral and Qwen (SwiGLU) or Gemma (GeGLU), tensor-parallel:
    ``down_proj(activation(x @ gate) * (x @ up))`` (:func:`jax_ub.gated_mlp`).

    Params: ``gate_up`` ``[in_features, 2, hidden_features]`` (the gate kernel at ``[:, 0]``,
    the up kernel at ``[:, 1]``), split over ``axis_name`` on its last dim, and
    ``down_proj`` ``[hidden_features, out_features]``, split on its first; no biases, as in
    those models. From an unsharded checkpoint's ``gate_proj [in, hidden]``, ``up_proj``
    and ``down_proj [hidden, out]`` (PyTorch's ``[out, in]`` weights transposed):
    ``gate_up = jnp.stack([gate_proj, up_proj], axis=1)``, ``down_proj = down_proj``.

    Shapes and sharding: input and output ``[seq, *batch, features]``, sequence-sharded
    ``P(axis_name, None, ...)`` (or batch-major with ``seq_axis``).

    Example::

        >>> mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        >>> mlp = jax_ub.flax.ParallelGatedMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0))
        >>> jax.jit(mlp)(jnp.ones((32, 2, 16))).shape
        (32, 2, 16)

    Delayed scaling, ``fp8="delayed"``: each projection keeps its own three amax histories
    (float32 ``[amax_history_length]``, zeros at first, replicated), as
    :class:`OverwriteWithGradient` variables named after the projection and flax's names:
    ``gate_up_input_amax_history``, ``gate_up_kernel_amax_history``,
    ``gate_up_output_grad_amax_history`` (of ``x``, ``gate_up`` and the gradient of the
    gate and up products) and ``down_proj_input_amax_history``,
    ``down_proj_kernel_amax_history``, ``down_proj_output_grad_amax_history`` (of the
    gated product, ``down_proj`` and the output's gradient). Scales and updates are those
    of :class:`ColumnParallelLinear`: train with its ``train_step``, which steps the params
    and overwrites the histories with their gradients::

        >>> mlp = jax_ub.flax.ParallelGatedMLP(16, 64, mesh=mesh, fp8="delayed", rngs=nnx.Rngs(0))
        >>> x = jax.random.normal(jax.random.key(1), (32, 2, 16))
        >>> owg = nnx.Any(nnx.Param, jax_ub.flax.OverwriteWithGradient)
        >>> grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, owg))(mlp)
        >>> history = grads.gate_up_input_amax_history[...]  # this step's amax of x in front
        >>> bool(history[0] == jnp.max(jnp.abs(x))), bool(jnp.all(history[1:] == 0))
        (True, True)

    Args:
      in_features: number of input features.
      hidden_features: number of hidden features; a multiple of ``tp``.
      out_features: number of output features (default: ``in_features``).
      activation: the gate's activation: ``"silu"`` (default, SwiGLU), ``"gelu"`` (GeGLU)
        or an elementwise callable.
      fp8: run both projections in fp8 (e4m3 forward, e5m2 gradients); the collectives
        move fp8 bytes. ``True`` or ``"current"``: current scaling; ``"delayed"``: delayed
        scaling from the amax histories above; ``False``: no fp8 (default).
      amax_history_length: steps of amaxes each delayed scale looks back over (default 16).
      kernel_init: initializer of ``gate_up`` (called with shape
        ``[in_features, 2 * hidden_features]``, so fan-in is ``in_features``) and
        ``down_proj``; names it boxes values with (``nnx.with_partitioning``) are read as
        ``kernel_axes``.
      dropout_rate, deterministic: dropout of the gated hidden activations before
        ``down_proj``, as :class:`ParallelMLP`'s.
      config, mesh, axis_name, param_axes, kernel_axes, impl, sequence_parallel, seq_axis,
        dtype, param_dtype, rngs: as for :class:`ColumnParallelLinear`.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        out_features: int | None = None,
        activation: str | Callable[[jax.Array], jax.Array] = "silu",
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        rngs: nnx.Rngs,
        **settings: Unpack[Settings],
    ):
        owner = type(self).__name__
        s = take_settings(owner, settings, bias=False)
        self.config = cfg = block_config(owner, s)
        check_split(owner, cfg, "hidden_features", hidden_features)
        out_features = in_features if out_features is None else out_features
        kernel_axes = block_kernel_axes(owner, s)  # or the names kernel_init boxes with
        param_axes, kernel_init = s["param_axes"], s["kernel_init"]
        if kernel_axes is None:
            names = _gated.gated_kernel_names(owner, cfg.axis_name, param_axes)
        else:  # logical names, mapped by the user's logical_axis_rules
            names = _gated.logical_kernel_names(owner, kernel_axes, param_axes)
        gate_up = kernel_init(rngs.params(), (in_features, 2 * hidden_features), cfg.param_dtype)
        gate_up = _gated.unboxed(gate_up).reshape(in_features, 2, hidden_features)
        down = kernel_init(rngs.params(), (hidden_features, out_features), cfg.param_dtype)
        down = _gated.unboxed(down)
        self.gate_up = sharded_param(gate_up, names["gate_up"], cfg.mesh)
        self.down_proj = sharded_param(down, names["down_proj"], cfg.mesh)
        histories = (name for p in _gated.HISTORY_NAMES.values() for name in p.values())
        add_histories(self, histories, cfg)
        self.in_features, self.hidden_features = in_features, hidden_features
        self.activation = activation
        self._init_dropout(owner, dropout_rate, deterministic, rngs)

    def __call__(
        self, inputs: jax.Array, *, deterministic: bool | None = None, rngs=None
    ) -> jax.Array:
        """``[seq, *batch, in_features]`` -> ``[seq, *batch, out_features]``.

        ``deterministic``, ``rngs``: the dropout's, as ``nnx.Dropout``'s call takes them
        (with ``dropout_rate`` > 0 only)."""
        call = prepare_call(self, inputs, divisible={"hidden_features": self.hidden_features})
        key = self._dropout_key(deterministic, rngs)
        rate = 0.0 if key is None else self.dropout_rate
        f = _gated.gated_mlp_call(call, self.activation, inputs.ndim, rate)
        hist = _gated.histories(self.fp8, lambda name: getattr(self, name)[...])
        return f(inputs, self.gate_up[...], self.down_proj[...], hist, key)
