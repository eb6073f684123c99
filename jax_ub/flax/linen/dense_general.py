"""Linen's :class:`DenseGeneral`: one DenseGeneral-shaped layer that is column-parallel,
row-parallel or a plain matmul as its kernel's logical names and the rules place it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import linen as nn

from jax_ub.flax import _axes, _dense_general, _projection, _settings
from jax_ub.flax._checks import DEFAULT_AXIS
from jax_ub.flax._settings import ParallelConfig
from jax_ub.flax.linen.layers import _ParallelLinear, _setting, project


class DenseGeneral(_ParallelLinear):
    """Linen version of :class:`jax_ub.flax.DenseGeneral`: ``nn.DenseGeneral``'s params
    (``kernel [*in, *features]``, ``bias [*features]``), run as
    :class:`ColumnParallelLinear`, :class:`RowParallelLinear` or a plain matmul, decided
    at each call from the kernel's logical names (``kernel_axes``, or a ``kernel_init``
    wrapped by ``nn.with_logical_partitioning``) under the active
    ``nn.logical_axis_rules`` and the mesh set (or ``mesh=``). The rules of the choice, the
    tensor-parallel axis and a trainer's conventions (``kernel_axes=()``,
    ``weight_dtype``, n-d initializers with ``in_axis`` / ``out_axis``, ``quant``,
    ``matmul_precision``, ``out_sharding=`` at call) are the NNX layer's. The params are
    the same whichever it runs as, so a model initialized with no mesh runs under one.

    Example: a trainer's ``DenseGeneral`` replaced by one assignment::

        >>> import functools
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
        >>> Dense = functools.partial(jax_ub.flax.linen.DenseGeneral, seq_axis=1)
        >>> class Mlp(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         h = Dense(64, kernel_axes=("embed", "mlp"), name="wi")(x)
        ...         return Dense(16, kernel_axes=("mlp", "embed"), name="wo")(h)
        >>> x = jnp.ones((2, 32, 16))
        >>> with jax.set_mesh(mesh), nn.logical_axis_rules([("mlp", "tensor")]):
        ...     variables = Mlp().init(jax.random.key(0), x)
        ...     y = jax.jit(Mlp().apply)(variables, x)
        >>> nn.get_partition_spec(variables)["params"]["wi"]["kernel"], y.shape
        (P('embed', 'mlp'), (2, 32, 16))

    Attributes:
      features, axis, kernel_axes, and the settings of :class:`ColumnParallelLinear`.
      weight_dtype: the params' dtype (``param_dtype``).
      quant: None (a trainer's quantization has no counterpart: use ``fp8``).
      matmul_precision: ``"default"`` (default), ``"float32"`` or ``"highest"``.
    """

    weight_dtype: Any = _setting()
    quant: Any = _setting()
    matmul_precision: Any = _setting("default")

    @property
    def _kind(self) -> str:  # type: ignore[override]
        return self.kind()

    @nn.nowrap
    def kind(self) -> str:
        """``"column"``, ``"row"`` or ``"replicated"``: how the layer runs here, under the
        rules and mesh in force (``_axes.choose_kind``)."""
        owner = type(self).__name__
        given = {name: getattr(self, name) for name in _settings.FIELDS}
        config = _settings.resolve(owner, self.config, **given)
        names, mesh_names, n_in = self._names_and_n_in()
        kind, _ = _axes.choose_kind(
            owner, n_in, names, config.axis_name, mesh_names=mesh_names, mesh=config.mesh
        )
        return kind

    @nn.nowrap
    def _names_and_n_in(self) -> tuple[tuple | None, bool, int]:
        """The kernel's names (mesh axes' where the second is True) and its contracted
        dims' count."""
        names, mesh_names = self._kernel_names()
        return names, mesh_names, len(_projection.canonical_axes(type(self).__name__, self.axis))

    @nn.nowrap
    def _kernel_names(self) -> tuple[tuple | None, bool]:
        axes = _dense_general.kernel_axes(self.kernel_axes)
        return _axes.given_names(type(self).__name__, axes, self.kernel_init, self.param_axes)

    @nn.nowrap
    def _split(self, axis_name: str | None, mesh: Any = None) -> tuple[int, str]:
        kind = self.kind()
        names, mesh_names, n_in = self._names_and_n_in()
        if kind == "replicated":
            return n_in, axis_name or DEFAULT_AXIS
        return _axes.choose_split(
            type(self).__name__, kind, n_in, names, axis_name, mesh_names=mesh_names, mesh=mesh
        )

    @nn.nowrap
    def resolved_config(self) -> ParallelConfig:
        config = super().resolved_config()
        owner = type(self).__name__
        dtype = _dense_general.param_dtype(owner, self.weight_dtype, self.param_dtype)
        return config if dtype is None else dataclasses.replace(config, param_dtype=dtype)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """``inputs [..., *in]`` -> ``[..., *features]``; with ``out_sharding`` (a
        ``NamedSharding`` or ``PartitionSpec``), checked against the layer's output
        layout and constrained to it."""
        owner = type(self).__name__
        _dense_general.check_options(owner, self.quant, self.matmul_precision)
        config = self.resolved_config()
        kind = self.kind()
        if kind == "replicated":
            _dense_general.check_no_fp8(owner, config.fp8)
            in_shape = self.in_shape(inputs)
            params = self.get_params(in_shape)
            out = _dense_general.replicated_matmul(
                inputs, params["kernel"], params.get("bias"), len(in_shape),
                config.dtype, self.matmul_precision,
            )  # fmt: skip
            return _dense_general.constrain_output(
                owner, out, out_sharding, kind, None, config.axis_name
            )
        out = project(inputs, self)
        if out_sharding is None:
            return out
        shape = self.projection(self.in_shape(inputs))
        call = self.prepare(inputs, in_features=shape)
        sp = kind == "row" and call.sequence_parallel
        tp_dim = _dense_general.output_tp_dim(shape, out.ndim, sp, call.seq_axis)
        return _dense_general.constrain_output(
            owner, out, out_sharding, kind, tp_dim, config.axis_name
        )
