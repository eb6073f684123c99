"""Flax NNX versions of the jax_ub tensor-parallel layers (also exported by
:mod:`jax_ub.flax` itself).

Parameters are ``nnx.Param``s carrying their sharding names as metadata, so
``nnx.get_partition_spec`` gives their sharding over the tensor-parallel axis. With
``fp8="delayed"`` the layers also keep amax histories as :class:`OverwriteWithGradient`
variables (replicated), which a training step overwrites with their gradients.
"""

from jax_ub.flax.nnx.base import OverwriteWithGradient
from jax_ub.flax.nnx.blocks import ParallelMLP, ParallelSelfAttention
from jax_ub.flax.nnx.dense_general import DenseGeneral
from jax_ub.flax.nnx.gated import ParallelGatedMLP
from jax_ub.flax.nnx.layers import ColumnParallelLinear, RowParallelLinear, project

__all__ = [
    "ColumnParallelLinear",
    "DenseGeneral",
    "OverwriteWithGradient",
    "ParallelGatedMLP",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "project",
]
