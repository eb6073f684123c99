"""What an all-gathered op keeps of its input for the backward, and how its backward
computes the input gradient from it.

An all-gathered op's weight gradient needs ``all_gather(x)``. :class:`KeptInput` keeps it
from the forward, or, with ``jax_ub.configure(keep_gathered=False)``, keeps ``x``'s shard
and gathers it again in the backward, inside the input gradient's GEMM+RS call (on its
copy engines, beside its GEMMs): the memory XLA's own unfused ops take, where a policy
recomputes ``x`` (e.g. a norm's output) instead of keeping it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jax_ub._src.ops.checkpoint_policy import saved_gathered
from jax_ub._src.settings.config import config


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
