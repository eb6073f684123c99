"""The group an op's collective runs over, and on which path: the static arguments that
the ops' custom VJPs hand from their front end to their forward and backward, and the
userbuffer ops bound over that group."""

from __future__ import annotations

import dataclasses

from jax_ub._src.lowering.primitives import bind_all_gather_matmul, bind_matmul_reduce_scatter
from jax_ub._src.lowering.unfused import XLA, Collectives, collectives_of
from jax_ub._src.ops import impl_choice
from jax_ub._src.ops.driver import Call
from jax_ub._src.settings.fp8 import compute_operands
from jax_ub._src.settings.options import weight_transposed


@dataclasses.dataclass(frozen=True)
class Group:
    """One call's collective: over which group, and on which path.

    Attributes:
      axis_name: the mesh axis of the collective.
      size: the size of that axis (``tp``).
      fallback: impl="auto": lower to XLA's collectives where the group's devices cannot
        share memory (impl="ub" raises there instead).
      ub: run the userbuffer custom call; False runs the unfused reference on
        ``collectives`` (only the fp8 ops take both paths through one VJP).
      collectives: the unfused reference's collectives: XLA's, or none (impl="none").
    """

    axis_name: str
    size: int
    fallback: bool
    ub: bool = True
    collectives: Collectives = XLA

    @classmethod
    def of_call(cls, call: Call, x, w, fp8=None) -> Group:
        """The group of one call (its axis bound: ``call.size`` set) on the rank's operands
        ``x @ w`` (in fp8 where ``fp8``, its scales, is not None): the path
        :func:`impl_choice.use_ub` picks for the operands the call computes in.
        impl="auto" falls back to XLA's collectives if the group's GPUs cannot share
        memory."""
        operands = (x, w) if fp8 is None else compute_operands(x, w)
        kw = dict(fp8=fp8 is not None, axis_size=call.size)
        ub = impl_choice.use_ub(call.op, call.impl, *operands, **kw)
        return cls(
            call.axis_name,
            call.size,
            fallback=call.impl == "auto",
            ub=ub,
            collectives=collectives_of(call.impl),
        )

    def all_gather_matmul(self, x, w, **kwargs):
        """The userbuffer all-gather GEMM over this group: ``bind_all_gather_matmul`` with
        its other keywords (``return_gathered`` among them) as given."""
        return bind_all_gather_matmul(
            x, w, self.axis_name, self.size, fallback=self.fallback, **kwargs
        )

    def matmul_reduce_scatter(self, x, w, **kwargs):
        """The userbuffer GEMM reduce-scatter over this group: ``bind_matmul_reduce_scatter``
        with its other keywords as given."""
        return bind_matmul_reduce_scatter(
            x, w, self.axis_name, self.size, fallback=self.fallback, **kwargs
        )

    def gather_times_w_t(self, dy, w, gelu_input=None):
        """``(all_gather(dy) @ w.T, all_gather(dy))``: the input gradient of a
        reduce-scattered product, whose gathered ``dy`` the weight gradient takes too (so
        ``dy`` is gathered once). ``w.T`` is read in place where the tuning says
        (``weight_transposed``); with ``gelu_input``, the product times gelu'(gelu_input)
        in the GEMMs' epilogue."""
        w_t, in_place = weight_transposed(w)
        dx, dy_gathered, _ = self.all_gather_matmul(
            dy,
            w_t,
            return_gathered=True,
            transpose_w=in_place,
            gelu_input=gelu_input,
        )
        return dx, dy_gathered

    def scatter_times_w_t(self, dp, w, gather=None):
        """``reduce_scatter(dp @ w.T)``: the input gradient of an all-gathered product, by
        the overlapped GEMM+RS reading ``w.T`` in place where the tuning says. With
        ``gather`` (laid out and typed as that result: the product's input shard),
        ``(reduce_scatter(dp @ w.T), all_gather(gather))``, the gather moving beside the
        GEMMs in the same call."""
        w_t, in_place = weight_transposed(w)
        return self.matmul_reduce_scatter(dp, w_t, transpose_w=in_place, gather=gather)
