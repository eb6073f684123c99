"""Flax NNX versions of the jax_ub tensor-parallel layers (also exported by
:mod:`jax_ub.flax` itself).

Parameters are ``nnx.Param``s carrying their sharding names as metadata, so
``nnx.get_partition_spec`` gives their sharding over the tensor-parallel axis.
"""

from jax_ub.flax.nnx.blocks import ParallelMLP, ParallelSelfAttention
from jax_ub.flax.nnx.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention", "RowParallelLinear"]
