"""One DenseGeneral-shaped NNX layer that is column-parallel, row-parallel or a plain
matmul as its kernel's logical names and the rules place it: a trainer's projections swap
to jax_ub by one assignment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from jax_ub.flax import _axes, _dense_general
from jax_ub.flax.nnx.base import prepare_call
from jax_ub.flax.nnx.layers import _ParallelLinear, project

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from jax_ub.flax.nnx.base import BiasedSettings


class DenseGeneral(_ParallelLinear):
    """A projection ``[..., *in_features] -> [..., *out_features]`` shaped as a trainer's
    n-d ``DenseGeneral`` (flax's ``nnx.LinearGeneral`` params: ``kernel [*in_features,
    *out_features]``, ``bias [*out_features]``), which runs as
    :class:`ColumnParallelLinear`, :class:`RowParallelLinear` or a plain matmul, decided
    when it is built from the kernel's logical names (``kernel_axes``) under the active
    ``nnx.logical_axis_rules`` and the mesh (``mesh=``, else the one set):

    * a feature dim split over the tensor-parallel axis: column-parallel (the sequence
      gathered into the matmul, :func:`jax_ub.all_gather_matmul`);
    * a contracted dim split over it: row-parallel (:func:`jax_ub.matmul_reduce_scatter`,
      or an all-reduce where the sequence is not split);
    * neither, no names, no mesh known when built, or the axis of size 1: a plain matmul
      (``jax.lax.dot_general``), laid out by XLA as the trainer's own layer is.

    The tensor-parallel axis is ``axis_name`` (or ``jax_ub.flax.defaults``'); without
    it, the one mesh axis of size > 1 the rules split the kernel over (a rule may list
    several, e.g. ``'mlp' -> ['fsdp_transpose', 'tensor']``; two of size > 1 among the
    kernel's dims, as on an fsdp x tensor mesh, need ``axis_name``). ``layer.kind`` says
    which it is.

    A trainer's conventions: ``kernel_axes=()`` means no names; ``weight_dtype`` is
    ``param_dtype``; an n-d initializer (``init(key, shape, dtype, in_axis, out_axis)``)
    is called on the kernel's shape with the contracted dims as ``in_axis`` and the
    features as ``out_axis`` (others, as flax calls them, on the shape flattened to
    ``[in, out]``); ``matmul_precision`` ``"default"``, ``"float32"`` or ``"highest"``
    (jax_ub's GEMMs accumulate in float32, float32 operands in full float32) and
    ``quant=None`` are taken, other values raise, naming them. The call takes
    ``out_sharding=`` (checked against the output layout, then a sharding constraint).

    Unlike some trainers' DenseGeneral, ``use_bias`` defaults to True (flax's): pass
    ``use_bias=False`` where yours defaults to it. Activations are ``[seq, batch, ...]``
    unless ``seq_axis=1`` (batch-major). The other settings are those of
    :class:`ColumnParallelLinear`.

    Example: a trainer's projection class swapped by one assignment, on a mesh whose
    rules split the MLP's hidden units over several axes, one of size > 1::

        >>> from jax.sharding import AxisType
        >>> axes = ("data", "fsdp_transpose", "tensor")
        >>> mesh = jax.make_mesh((2, 1, 2), axes, axis_types=(AxisType.Auto,) * 3,
        ...                      devices=jax.devices()[:4])
        >>> rules = (("embed", None), ("mlp", ("fsdp_transpose", "tensor")))
        >>> import functools
        >>> Dense = functools.partial(jax_ub.flax.DenseGeneral, seq_axis=1)  # the swap
        >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        ...     up = Dense(16, 64, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        ...     down = Dense(64, 16, kernel_axes=("mlp", "embed"), rngs=nnx.Rngs(1))
        ...     y = nnx.jit(lambda u, d, x: d(u(x)))(up, down, jnp.ones((4, 32, 16)))
        >>> up.kind, down.kind, up.axis_name, y.shape
        ('column', 'row', 'tensor', (4, 32, 16))

    Args:
      in_features, out_features, axis: as for :class:`ColumnParallelLinear`;
        ``in_features_shape`` and ``out_features_shape`` (a trainer's names) for the first two.
      kernel_axes: the kernel's logical names ``(*in, *out)``; ``()`` or None: none.
      weight_dtype: the params' dtype (``param_dtype``).
      quant: None (a trainer's quantization has no counterpart: use ``fp8``).
      matmul_precision: ``"default"`` (default), ``"float32"`` or ``"highest"``.
      settings: as for :class:`ColumnParallelLinear` (``axis_name``, ``seq_axis``,
        ``impl``, ``use_bias``, ``dtype``, ``kernel_init``, ...).
    """

    _kind = "replicated"

    def __init__(
        self,
        in_features: int | Sequence[int] | None = None,
        out_features: int | Sequence[int] | None = None,
        *,
        in_features_shape: int | Sequence[int] | None = None,
        out_features_shape: int | Sequence[int] | None = None,
        axis: int | Sequence[int] = -1,
        weight_dtype: Any = None,
        quant: Any = None,
        matmul_precision: Any = "default",
        rngs: nnx.Rngs,
        **settings: Unpack[BiasedSettings],
    ):
        owner = type(self).__name__
        in_features = _dense_general.alias(owner, "in_features", in_features, in_features_shape)
        out_features = _dense_general.alias(owner, "out_features", out_features, out_features_shape)
        _dense_general.check_options(owner, quant, matmul_precision)
        settings["kernel_axes"] = _dense_general.kernel_axes(settings.get("kernel_axes"))
        dtype = _dense_general.param_dtype(owner, weight_dtype, settings.get("param_dtype"))
        if dtype is not None:
            settings["param_dtype"] = dtype
        self.matmul_precision = matmul_precision
        super().__init__(in_features, out_features, axis=axis, rngs=rngs, **settings)
        if self.kind == "replicated":
            _dense_general.check_no_fp8(owner, self.config.fp8)

    def _choose_kind(self, owner: str, n_in: int, names: Any, config: Any) -> tuple:
        return _axes.choose_kind(owner, n_in, names, config.axis_name, mesh=config.mesh)

    @property
    def kind(self) -> str:
        """``"column"``, ``"row"`` or ``"replicated"``: how the layer runs."""
        return self.projection.kind

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        """``inputs [..., *in_features]`` -> ``[..., *out_features]``; with
        ``out_sharding`` (a ``NamedSharding`` or ``PartitionSpec``), checked against the
        layer's output layout (``jax_ub.flax._dense_general``) and constrained to it."""
        shape, owner = self.projection, type(self).__name__
        if shape.kind == "replicated":
            params = self.param_values()
            out = _dense_general.replicated_matmul(
                inputs, params["kernel"], params.get("bias"), shape.n_in,
                self.config.dtype, self.matmul_precision,
            )  # fmt: skip
            return _dense_general.constrain_output(
                owner, out, out_sharding, shape.kind, None, self.config.axis_name
            )
        out = project(inputs, self)
        if out_sharding is None:
            return out
        call = prepare_call(self, inputs)
        sp = shape.kind == "row" and call.sequence_parallel
        tp_dim = _dense_general.output_tp_dim(shape, out.ndim, sp, call.seq_axis)
        return _dense_general.constrain_output(
            owner, out, out_sharding, shape.kind, tp_dim, self.config.axis_name
        )
