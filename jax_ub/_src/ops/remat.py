"""What the ops keep for their backward, by name, and what a ``jax.checkpoint`` policy
keeps of it.

``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` saves the outputs of
``dot_general``; jax_ub's GEMMs are custom calls, which it does not recognise, so under
it the backward would recompute every op (GEMM and communication) to rebuild its
residuals. The ops name their results (``OUTPUT``) and the gathered operand the weight
gradient needs (``GATHERED``) with ``jax.ad_checkpoint.checkpoint_name``;
:data:`dots_and_ops_saveable` saves those and the dots.

An all-gathered op's weight gradient needs ``all_gather(x)``. :class:`KeptInput` keeps it
from the forward, or, with ``jax_ub.configure(keep_gathered=False)``, keeps ``x``'s shard
and gathers it again in the backward, inside the input gradient's GEMM+RS call (on its
copy engines, beside its GEMMs): the memory XLA's own unfused ops take, where a policy
recomputes ``x`` (e.g. a norm's output) instead of keeping it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

from jax_ub._src.settings.config import config

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


class KeptInput(NamedTuple):
    """What an all-gathered op keeps of its input ``x [m, ..., k]`` for its weight
    gradient: ``all_gather(x)`` (``gathered``, ``[tp * m, ..., k]``) or ``x``'s shard
    (``shard``), the other field None."""

    gathered: jax.Array | None
    shard: jax.Array | None

    @staticmethod
    def keeps_gathered() -> bool:
        """Whether calls traced now keep the gathered x (``config.keep_gathered``): the
        forward then asks its op for it."""
        return config.keep_gathered

    @classmethod
    def of(cls, x: jax.Array, gathered: jax.Array) -> KeptInput:
        """What to keep of ``x``: ``gathered`` (``all_gather(x)``, which the forward asks
        its op for where :meth:`keeps_gathered`), or else ``x``'s shard."""
        if config.keep_gathered:
            return cls(saved_gathered(gathered), None)
        return cls(None, x)

    def input_grad_and_gathered(self, group, dp: jax.Array, w: jax.Array):
        """``(reduce_scatter(dp @ w.T), all_gather(x))``: the op's input gradient, by
        ``group``'s (a :class:`jax_ub._src.ops.group.Group`) overlapped GEMM+RS, and the
        gathered ``x`` its weight gradient needs: the kept one, or gathered in that same
        call (x's shard is laid out and typed as the input gradient, as the call needs)."""
        if self.gathered is not None:
            return group.scatter_times_w_t(dp, w), self.gathered
        return group.scatter_times_w_t(dp, w, gather=self.shard)
