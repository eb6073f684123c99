"""Flax integration of jax_ub: tensor-parallel layers with overlapped communication.

NNX modules (:mod:`jax_ub.flax.nnx`) are exported here; linen modules with the same names
live in :mod:`jax_ub.flax.linen`.

* :class:`ColumnParallelLinear`: sequence-parallel input, all-gathered into the matmul
  (:func:`jax_ub.all_gather_matmul`); output feature-sharded.
* :class:`RowParallelLinear`: feature-sharded input, matmul reduce-scattered back to
  sequence-parallel (:func:`jax_ub.matmul_reduce_scatter`).
* :class:`ParallelMLP`, :class:`ParallelSelfAttention`: blocks built from the two.
* :class:`ParallelGatedMLP`: SwiGLU / GeGLU (:func:`jax_ub.gated_mlp`).

Activations are ``[seq, *batch, features]``; parameters are global arrays annotated with
their sharding over the tensor-parallel mesh axis, so model state holds only arrays and
saves and restores like any Flax model's. The layers need no mesh: inside a shard_map over
the tensor-parallel axis they run on local shards; from ``jit`` under ``jax.set_mesh`` they
run in a shard_map over that axis alone, leaving the other mesh axes to XLA.

``fp8=True`` (or ``"current"``) runs the layers' matmuls in fp8 with current scaling;
``fp8="delayed"`` with delayed scaling from amax histories kept in the model state, as
flax's own fp8 layers do: NNX :class:`OverwriteWithGradient` variables, linen's
``"_overwrite_with_gradient"`` collection (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``),
which a training step overwrites with their gradients (see :class:`ColumnParallelLinear`).
"""

from jax_ub.flax import linen, nnx
from jax_ub.flax.nnx import (
    ColumnParallelLinear,
    OverwriteWithGradient,
    ParallelGatedMLP,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)

__all__ = [
    "ColumnParallelLinear",
    "OverwriteWithGradient",
    "ParallelGatedMLP",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "linen",
    "nnx",
]
