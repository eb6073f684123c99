"""Flax integration of jax_ub: tensor-parallel layers with overlapped communication.

NNX modules live here; linen modules with the same names live in :mod:`jax_ub.flax.linen`.

* :class:`ColumnParallelLinear`: sequence-parallel input, all-gathered into the matmul
  (:func:`jax_ub.all_gather_matmul`); output feature-sharded.
* :class:`RowParallelLinear`: feature-sharded input, matmul reduce-scattered back to
  sequence-parallel (:func:`jax_ub.matmul_reduce_scatter`).
* :class:`ParallelMLP`, :class:`ParallelSelfAttention`: blocks built from the two.

Activations are ``[seq, *batch, features]``; parameters are global arrays annotated with
their sharding over the tensor-parallel mesh axis, so model state holds only arrays and
saves and restores like any Flax model's. The layers call ``jax.shard_map`` themselves.
"""

from jax_ub.flax import linen
from jax_ub.flax.nnx_blocks import ParallelMLP, ParallelSelfAttention
from jax_ub.flax.nnx_layers import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "linen",
]
