"""Flax linen versions of the jax_ub tensor-parallel layers, with the NNX modules' names.

Parameters are created with ``nn.with_partitioning`` (boxed as ``nn.Partitioned``), so
``nn.get_partition_spec(variables)`` gives their sharding over the tensor-parallel axis.
"""

from jax_ub.flax.linen.blocks import ParallelGatedMLP, ParallelMLP, ParallelSelfAttention
from jax_ub.flax.linen.dense_general import DenseGeneral
from jax_ub.flax.linen.layers import ColumnParallelLinear, RowParallelLinear, project

__all__ = [
    "ColumnParallelLinear",
    "DenseGeneral",
    "ParallelGatedMLP",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "project",
]
