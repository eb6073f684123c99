"""Flax integration of jax_ub: tensor-parallel layers with overlapped communication.

NNX modules (:mod:`jax_ub.flax.nnx`) are exported here; linen modules with the same names
live in :mod:`jax_ub.flax.linen`.

* :class:`ColumnParallelLinear`: sequence-parallel input, all-gathered into the matmul
  (:func:`jax_ub.all_gather_matmul`); output feature-sharded.
* :class:`RowParallelLinear`: feature-sharded input, matmul reduce-scattered back to
  sequence-parallel (:func:`jax_ub.matmul_reduce_scatter`).
* Both shaped as flax's ``nnx.LinearGeneral`` / ``nn.DenseGeneral`` (multi-dim features and
  contracted dims, the same params), so a model's own attention and MLP swap their
  projection constructors; :func:`jax_ub.flax.nnx.project` (linen:
  :func:`jax_ub.flax.linen.project`) runs column layers of one input from one gather.
* :class:`DenseGeneral`: one DenseGeneral-shaped class that runs as either of the two, or
  as a plain matmul, as its kernel's logical names and the rules place it (a trainer's
  projections swap to jax_ub by one assignment).
* :class:`ParallelMLP`, :class:`ParallelSelfAttention`: blocks built from the two.
* :class:`ParallelGatedMLP`: SwiGLU / GeGLU (:func:`jax_ub.gated_mlp`).

Activations are ``[seq, *batch, features]`` by default; a model whose activations are
batch-major, ``[batch, seq, features]``, sets ``seq_axis=1`` (per layer, or for the whole
model with ``jax_ub.flax.defaults(seq_axis=1)``). Parameters are global arrays annotated
with their sharding over the tensor-parallel mesh axis, so model state holds only arrays and
saves and restores like any Flax model's. The layers need no mesh: inside a shard_map over
the tensor-parallel axis they run on local shards; from ``jit`` under ``jax.set_mesh``, or
with ``mesh=`` (or ``defaults(mesh=...)``) given and no mesh set, they run in a shard_map
over that axis alone, leaving the other mesh axes to XLA.

``fp8=True`` (or ``"current"``) runs the layers' matmuls in fp8 with current scaling;
``fp8="delayed"`` with delayed scaling from amax histories kept in the model state, as
flax's own fp8 layers do: NNX :class:`OverwriteWithGradient` variables, linen's
``"_overwrite_with_gradient"`` collection (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``),
which a training step overwrites with their gradients (see :class:`ColumnParallelLinear`).

The settings the layers share (``mesh``, ``axis_name``, ``impl``, ``sequence_parallel``,
``seq_axis``, ``fp8``, ``amax_history_length``, ``dtype``, ``param_dtype``) are one checked
record, :class:`ParallelConfig`: each layer takes them as keyword arguments (linen:
attributes) or whole as ``config=``, and a model sets them for all its layers with
``with jax_ub.flax.defaults(impl="ub", sequence_parallel=True): ...``.
"""

from jax_ub.flax import checkpoints, linen, nnx
from jax_ub.flax._settings import ParallelConfig, defaults
from jax_ub.flax.nnx import (
    ColumnParallelLinear,
    DenseGeneral,
    OverwriteWithGradient,
    ParallelGatedMLP,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)

__all__ = [
    "ColumnParallelLinear",
    "DenseGeneral",
    "OverwriteWithGradient",
    "ParallelConfig",
    "ParallelGatedMLP",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "checkpoints",
    "defaults",
    "linen",
    "nnx",
]
