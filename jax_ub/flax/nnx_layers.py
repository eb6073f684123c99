"""Tensor-parallel linear layers for Flax NNX, overlapped through jax_ub."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype, Initializer
from jax.sharding import Mesh

from jax_ub.flax import _core

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class _ParallelLinear(nnx.Module):
    """Shared constructor: global-shaped params, sharded over ``axis_name`` of ``mesh``."""

    # Set by subclasses: which features are split over the axis, and the params' specs.
    _split: str
    _param_specs: Callable[[str, bool], dict]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        axis_name: str = "tp",
        impl: str = "auto",
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        rngs: nnx.Rngs,
    ):
        owner = type(self).__name__
        self.tp = _core.tp_size(owner, mesh, axis_name)
        _core.check_impl(owner, impl)
        split = {"in_features": in_features, "out_features": out_features}[self._split]
        _core.check_divisible(owner, self._split, split, self.tp, axis_name)
        self.in_features = in_features
        self.out_features = out_features
        self.mesh = mesh
        self.axis_name = axis_name
        self.impl = impl
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        specs = self._param_specs(axis_name, use_bias)
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            out_sharding=tuple(specs["kernel"]),
            mesh=mesh,
        )
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            self.bias = nnx.Param(
                bias_init(rngs.params(), (out_features,), param_dtype),
                out_sharding=tuple(specs["bias"]),
                mesh=mesh,
            )
        else:
            self.bias = nnx.data(None)

    def param_values(self) -> dict[str, jax.Array]:
        """The global parameter arrays: ``kernel`` and, with ``use_bias``, ``bias``."""
        values = {"kernel": self.kernel[...]}
        if self.bias is not None:
            values["bias"] = self.bias[...]
        return values

    def _config(self, inputs: jax.Array) -> tuple:
        _core.check_input(type(self).__name__, inputs, self.in_features, self.tp, self.axis_name)
        return (self.mesh, self.axis_name, self.impl, self.dtype, inputs.ndim, self.use_bias)


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer whose output features are split over a tensor-parallel axis.

    The sequence-parallel input is all-gathered into the matmul with
    :func:`jax_ub.all_gather_matmul`, so the gather of one chunk overlaps the GEMM of the
    previous one. Each device multiplies the full sequence by its column shard of the
    kernel and adds its shard of the bias.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, sequence-sharded: ``P(axis_name, None, ...)``
    * output ``[seq, *batch, out_features]``, feature-sharded: ``P(None, ..., axis_name)``
    * ``kernel [in_features, out_features]`` sharded ``P(None, axis_name)``,
      ``bias [out_features]`` sharded ``P(axis_name)``

    Pair it with :class:`RowParallelLinear`, which takes the feature-sharded output back to
    sequence-parallel, with nothing but elementwise ops in between.

    Example::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from flax import nnx
        >>> from jax.sharding import Mesh
        >>> import jax_ub.flax
        >>> mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        >>> layer = jax_ub.flax.ColumnParallelLinear(16, 64, mesh=mesh, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape, layer.kernel[...].sharding.spec
        ((16, 64), P(None, 'tp'))
        >>> y = jax.jit(layer)(jnp.ones((32, 2, 16)))  # [seq, batch, features]
        >>> y.shape, y.sharding.spec
        ((32, 2, 64), P(None, None, 'tp'))

    Args:
      in_features: number of input features.
      out_features: number of output features; a multiple of ``tp``.
      mesh: the concrete :class:`jax.sharding.Mesh` to run on.
      axis_name: the tensor-parallel mesh axis (default ``"tp"``). Other mesh axes
        replicate the layer.
      impl: ``"ub"`` (userbuffers), ``"xla"`` (lax collectives) or ``"auto"``.
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      kernel_init: initializer for the global ``[in_features, out_features]`` kernel.
      bias_init: initializer for the global ``[out_features]`` bias.
      rngs: rng key.
    """

    _split = "out_features"
    _param_specs = staticmethod(_core.column_param_specs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, out]``."""
        return _core.column_call(*self._config(inputs))(inputs, self.param_values())


class RowParallelLinear(_ParallelLinear):
    """A linear layer whose input features are split over a tensor-parallel axis.

    Each device multiplies its feature shard of the input by its row shard of the kernel;
    :func:`jax_ub.matmul_reduce_scatter` sums the partial products and scatters the
    sequence back over the devices, overlapped with the GEMM. The bias is added once,
    after the reduction.

    Shapes and sharding (``tp`` = size of ``axis_name``):

    * input ``[seq, *batch, in_features]``, feature-sharded: ``P(None, ..., axis_name)``
    * output ``[seq, *batch, out_features]``, sequence-sharded: ``P(axis_name, None, ...)``
    * ``kernel [in_features, out_features]`` sharded ``P(axis_name, None)``,
      ``bias [out_features]`` replicated

    Example::

        >>> layer = jax_ub.flax.RowParallelLinear(64, 16, mesh=mesh, rngs=nnx.Rngs(0))
        >>> y = jax.jit(layer)(jnp.ones((32, 2, 64)))
        >>> y.shape, y.sharding.spec
        ((32, 2, 16), P('tp',))

    Args:
      in_features: number of input features; a multiple of ``tp``.
      out_features: number of output features.
      mesh, axis_name, impl, use_bias, dtype, param_dtype, kernel_init, bias_init, rngs:
        as for :class:`ColumnParallelLinear`. ``seq`` must be a multiple of ``tp``.
    """

    _split = "in_features"
    _param_specs = staticmethod(_core.row_param_specs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs @ kernel + bias``: ``[seq, *batch, in]`` -> ``[seq, *batch, out]``."""
        return _core.row_call(*self._config(inputs))(inputs, self.param_values())
