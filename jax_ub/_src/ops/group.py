"""The group an op's collective runs over, and on which path: the static arguments that
the ops' custom VJPs hand from their front end to their forward and backward, and the
userbuffer ops bound over that group."""

from __future__ import annotations

import dataclasses

from jax_ub._src.lowering.custom_call import SOLO_AXIS
from jax_ub._src.lowering.primitives import bind_all_gather_matmul, bind_matmul_reduce_scatter
from jax_ub._src.lowering.unfused import copies_of_rows, reduce_scatter_rows, sum_row_blocks
from jax_ub._src.ops.path import Path
from jax_ub._src.settings.options import weight_transposed


@dataclasses.dataclass(frozen=True)
class Group:
    """One call's collective: over which group, and on which path.

    Attributes:
      axis_name: the mesh axis of the collective.
      size: the size of that axis (``tp``).
      path: the path the driver resolved (:class:`Path`); the fp8 ops read it to pick the
        userbuffer call or the unfused reference on ``path.collectives`` inside one VJP.
      fallback: lower to XLA's collectives where the group's devices cannot share memory
        (``impl_choice.falls_back_at_lowering``; else that raises).
    """

    axis_name: str
    size: int
    path: Path = Path.UB
    fallback: bool = False

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

    def scatter_rows(self, y):
        """``psum_scatter`` of ``y``'s rows over this group (XLA's: no GEMM beside it)."""
        return reduce_scatter_rows(y, self.axis_name)

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


@dataclasses.dataclass(frozen=True)
class SoloGroup(Group):
    """impl="none" on jax_ub's GEMMs (``Path.NONE_UB``, ``config.bound_gemms="ub"``): the
    userbuffer calls of a group of one device, at the shapes of this group's, the
    collectives replaced as impl="none" replaces them (a gather by ``size`` copies of the
    local rows, a reduce-scatter by the sum of the product's row blocks): jax_ub's GEMMs
    with nothing communicated, the no-communication bound of its own kernels. Wrong
    numbers, for timing only."""

    def all_gather_matmul(self, x, w, **kwargs):
        rows = copies_of_rows(x, self.axis_name)
        return bind_all_gather_matmul(rows, w, SOLO_AXIS, 1, **kwargs)

    def matmul_reduce_scatter(self, x, w, gather=None, **kwargs):
        out = sum_row_blocks(
            bind_matmul_reduce_scatter(x, w, SOLO_AXIS, 1, **kwargs), self.axis_name
        )
        return out if gather is None else (out, copies_of_rows(gather, self.axis_name))

    def scatter_rows(self, y):
        return sum_row_blocks(y, self.axis_name)
