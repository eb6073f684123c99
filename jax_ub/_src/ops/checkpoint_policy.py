"""The names the ops give to what they keep for their backward, and the ``jax.checkpoint``
policy that keeps it (``jax_ub.dots_and_ops_saveable``).

``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` saves the outputs of
``dot_general``; jax_ub's GEMMs are custom calls, which it does not recognise, so under
it the backward would recompute every op (GEMM and communication) to rebuild its
residuals. The ops name their results (``OUTPUT``) and the gathered operand the weight
gradient needs (``GATHERED``) with ``jax.ad_checkpoint.checkpoint_name``;
:data:`dots_and_ops_saveable` saves those and the dots.

What an all-gathered op keeps of its input for the weight gradient, ``all_gather(x)`` or
``x``'s shard, is ``kept_input.py``'s.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUTPUT = "jax_ub_output"
GATHERED = "jax_ub_gathered"


def saved_output(a: jax.Array) -> jax.Array:
    return checkpoint_name(a, OUTPUT)


def saved_gathered(a: jax.Array) -> jax.Array:
    return checkpoint_name(a, GATHERED)


dots_and_ops_saveable = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(OUTPUT, GATHERED),
)
