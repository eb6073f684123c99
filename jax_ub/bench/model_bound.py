"""The no-communication bound of the Llama step (``python -m jax_ub.bench.model``'s
``bound`` variant): jax_ub's ops swapped, while a model is traced, for the same GEMMs without
their collectives."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def bound_ops(fp8: bool = False):
    """jax_ub's two ops replaced, while models are traced, by the same GEMMs with no
    communication: the gather becomes ``tp`` copies of the local rows, the reduce-scatter
    a sum of the product's ``tp`` row blocks (the layer benchmark's bound); the embedding's
    reduce-scatter the same sum. What stays: the loss's all-reduces of per-token values
    over the vocabulary's split (``[batch, seq]`` floats).

    With ``fp8``: the ops' XLA path (XLA's fp8 GEMMs of the same quantized operands, as the
    ``xla`` variant runs them) with its gathers and reduce-scatters swapped for the same
    copies and sums; the scales' all-reduces (one float per call) stay. So it bounds the
    ``xla`` variant's fp8 step; jax_ub's fp8 GEMMs are its own (cuBLASLt's)."""
    import jax_ub
    from jax_ub._src.lowering import reference
    from jax_ub._src.ops import gated_mlp
    from jax_ub.bench.layer import bound_all_gather_matmul as ag
    from jax_ub.bench.layer import bound_matmul_reduce_scatter as rs
    from jax_ub.bench.layer import copies_of_rows, sum_row_blocks
    from jax_ub.flax import _attention, _core, _gated
    from jax_ub.models import llama

    saved = [
        (m, n, getattr(m, n))
        for m in (jax_ub, gated_mlp)
        for n in ("all_gather_matmul", "matmul_reduce_scatter")
    ]

    def forget_traces():
        # The layers keep one jitted shard_map per configuration: without this, the bound
        # would reuse the traces of jax_ub's ops, and jax_ub those of the bound.
        for cached in (
            _core.projection_call,
            _core.mlp_call,
            _gated.gated_mlp_call,
            _attention.attention_call,
        ):
            cached.cache_clear()

    saved.append((llama, "scatter_sequence", llama.scatter_sequence))
    bounds = {
        "all_gather_matmul": ag,
        "matmul_reduce_scatter": rs,
        "scatter_sequence": sum_row_blocks,
    }
    if fp8:
        saved += [(reference, n, getattr(reference, n)) for n in _REFERENCE_COLLECTIVES]
        bounds |= {
            "all_gather_matmul": _on_xla(jax_ub.all_gather_matmul),
            "matmul_reduce_scatter": _on_xla(jax_ub.matmul_reduce_scatter),
            "all_gather_rows": copies_of_rows,
            "reduce_scatter_rows": sum_row_blocks,
        }
    for module, name, _ in saved:
        setattr(module, name, bounds[name])
    forget_traces()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        forget_traces()


# The ops' XLA path's collectives (jax_ub._src.lowering.reference), looked up there when
# called: the fp8 bound swaps them for local copies and sums.
_REFERENCE_COLLECTIVES = ("all_gather_rows", "reduce_scatter_rows")


def _on_xla(op):
    """``op`` with ``impl="xla"`` whatever its caller asks."""

    def call(*args, **kwargs):
        return op(*args, **(kwargs | {"impl": "xla"}))

    return call
