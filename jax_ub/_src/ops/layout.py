"""How an op's operands and result are split over its mesh axis: static data per op, which
the driver reads to run the op on global arrays and to hand its body the rank's rows."""

from __future__ import annotations

import dataclasses
import enum


class Split(enum.Enum):
    """Which dim of an activation (an op's ``x`` or result) is split over the axis."""

    ROWS = "rows"  # the sequence (``seq_axis``): sequence-parallel
    FEATURES = "features"  # the last dim
    REPLICATED = "replicated"  # none: every rank holds all of it


class Rows(enum.Enum):
    """What an op's body does to the rows, which says how a batch-major shard
    (``seq_axis`` > 0) becomes the body's rows and back."""

    # Every rank's rows come back; rank-major blocks put in sequence order once.
    GATHER = "gather"
    # The rank keeps its block of the whole: the rows reordered once, rank-major.
    SCATTER = "scatter"
    # Gathered and scattered again inside, only row-wise math between: no row moves at all.
    KEEP = "keep"
    # Every rank holds all rows: the body takes the shard as it is and reads ``seq_axis``
    # itself, moving rows only where it splits them.
    WHOLE = "whole"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an op's operands and result are split over its axis.

    Attributes:
      x: the split of ``x``: :attr:`Split.ROWS` (sequence-parallel input) or
        :attr:`Split.FEATURES`.
      w_dim: the dim of ``w`` split over the axis (negative: from the end).
      out: the split of the result.
      rows: what the body does to the rows (:class:`Rows`).
    """

    x: Split
    w_dim: int
    out: Split
    rows: Rows


# all_gather_matmul: the rows of x gathered, w split on its columns, the product's
# columns split as w's.
GATHER = Layout(x=Split.ROWS, w_dim=-1, out=Split.FEATURES, rows=Rows.GATHER)
# matmul_reduce_scatter: the features of x split (w's rows), the summed product's rows
# scattered.
SCATTER = Layout(x=Split.FEATURES, w_dim=0, out=Split.ROWS, rows=Rows.SCATTER)
# matmul_all_reduce: as SCATTER, the summed product on every rank; ub splits the rows
# (the sequence moved first) for its reduce-scatter inside.
ALL_REDUCE = Layout(x=Split.FEATURES, w_dim=0, out=Split.REPLICATED, rows=Rows.WHOLE)
# The MLPs: rows gathered into the up-projection, the down-projection's scattered back;
# only row-wise math between, so a batch-major x moves no rows.
BLOCK = Layout(x=Split.ROWS, w_dim=-1, out=Split.ROWS, rows=Rows.KEEP)
