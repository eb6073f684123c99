"""What ``impl="auto"`` runs: the userbuffer op where it pays, XLA's unfused op elsewhere.

The rule, applied at trace time to every call whose operands the userbuffer op ("ub") can
run (dtype, platform, extension, fp8 support: :mod:`jax_ub._src.ops.impl_choice`):

* **CPU devices: ub, always.** The host protocol is CI's test vehicle for the protocol the
  GPUs run, not a speed path, so ``auto`` exercises it wherever it can run.
* **GPUs, a group of one device: XLA.** There is nothing to communicate, and the op's
  extra kernels made it 0-4% slower than a plain dot (2x H200, bf16).
* **GPUs, a call whose collective moves fewer than ``jax_ub.config.auto_min_bytes`` bytes
  per rank: XLA.** The op costs a fixed ~15-20 us of extra kernels per call (the split of
  the GEMM, the descriptor check, RS's sum pass); a collective shorter than that has too
  little to hide.
* **GPUs, otherwise: ub.** matmul_all_reduce needs ``ALL_REDUCE_FACTOR`` (6) times as many
  bytes (48 MiB by default), and rows that the group divides (else XLA's).

Bytes per rank (:func:`comm_bytes`) are what one rank receives from its peers, in the dtype
the collective moves: all_gather_matmul of a local ``x [m, ..., k]`` over ``tp`` ranks
moves ``(tp - 1) * m * ... * k`` elements of ``x`` (fp8 moves 1-byte elements);
matmul_reduce_scatter of ``x [M, ..., k] @ w [k, n]`` moves ``(tp - 1) / tp * M * ... * n``
partial sums in ``x.dtype`` (fp8 too); matmul_all_reduce twice that (the scatter, then
the all-gather of the summed rows). The backward of each of the first two moves the same
bytes as its forward (dx of an all-gather matmul is a reduce-scatter of
``dy [tp * m, ..., n] @ w.T``), so one decision covers both; the all-reduce's backward
moves nothing.

The default, ``config.DEFAULT_AUTO_MIN_BYTES`` = 8 MiB, is the smallest size per rank at
which neither op lost to XLA's on 2x H200 (bf16, tp=2; benchmarks/RESULTS.md, "Small calls",
has the sweep and its command): below it the collective is too short to hide the op's fixed
cost. Not calibrated: tp > 2 below 24 MiB per rank, other GPUs, fp8. Set
``jax_ub.configure(auto_min_bytes=...)`` (or ``JAX_UB_AUTO_MIN_BYTES``) from your own
``python -m jax_ub.bench --sweep-m ...``; ``0`` takes ub for every call of a group of two
or more. ``impl="ub"`` always runs the userbuffer op, ``impl="xla"`` XLA's.

The bytes are counted on the operands as the op sees them. Called in a partial-auto
``shard_map`` or on global arrays, a batch split over other mesh axes (``dp``) is still
whole there: the rule then counts up to their size times more bytes than a device moves.

Every process of a group must decide alike: give them the same ``auto_min_bytes``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import jax.numpy as jnp

from jax_ub._src.settings.config import config

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

# matmul_all_reduce hides only its reduce-scatter half behind the GEMM; its all-gather half
# runs after it. So it pays from larger sizes: ALL_REDUCE_FACTOR times auto_min_bytes (of
# both halves' bytes). On 2x H200 (bf16, tp=2, n=4096; benchmarks/RESULTS.md, "GEMM +
# all-reduce") ub ran 3-8% faster than XLA's dot + all-reduce at 64 MiB per rank, even at
# 32 MiB and 11-30% slower at 16 MiB.
ALL_REDUCE_FACTOR = 6

log = logging.getLogger("jax_ub")


@dataclasses.dataclass(frozen=True)
class ImplChoice:
    """What an op's ``impl`` resolves to for one call, and why.

    Attributes:
      impl: ``"ub"`` (the userbuffer op), ``"xla"`` (XLA's unfused collective and dot) or
        ``"none"`` (the unfused dot, its collective removed).
      reason: why, in words.
      comm_bytes: the bytes the call's collective moves per rank (:func:`comm_bytes`), or
        None where the rule did not need them.
    """

    impl: str
    reason: str
    comm_bytes: int | None = None


def comm_bytes(
    op: str,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: object,
    axis_size: int,
    *,
    fp8: bool = False,
) -> int:
    """Bytes one rank receives from its peers in ``op``'s collective (module docstring).

    ``x_shape`` and ``w_shape`` are the local shapes inside ``shard_map``: all_gather_matmul
    ``x [m, ..., k]``, matmul_reduce_scatter ``x [M, ..., k]`` and ``w [k, n]``.
    """
    check_op(op)
    rows = math.prod(x_shape[:-1])  # every dim but the contracted one
    if op == "all_gather_matmul":
        itemsize = 1 if fp8 else jnp.dtype(dtype).itemsize  # fp8 gathers float8_e4m3fn
        return (axis_size - 1) * rows * x_shape[-1] * itemsize
    # Each rank receives a block of M / tp rows from each of its tp - 1 peers; the
    # all-reduce receives as many again in its all-gather of the summed blocks.
    scattered = (axis_size - 1) * rows // axis_size * w_shape[-1] * jnp.dtype(dtype).itemsize
    return 2 * scattered if op == "matmul_all_reduce" else scattered


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def auto_choice(
    op: str,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: object,
    axis_size: int | None,
    *,
    fp8: bool = False,
    platform: str = "gpu",
    min_bytes: int | None = None,
) -> ImplChoice:
    """The rule (module docstring) for a call that the userbuffer op can run on
    ``platform`` ("cpu" or "gpu"/"cuda"); ``min_bytes`` defaults to
    ``jax_ub.config.auto_min_bytes``. Pure: reads nothing but the config."""
    known = axis_size is not None
    if op == "matmul_all_reduce" and known and x_shape[0] % axis_size:
        # ub would pad the rows (x_shape[0]: the sequence, first) up to a multiple of tp
        return ImplChoice(
            "xla", f"its {x_shape[0]} rows do not split over {axis_size} ranks: ub would pad them"
        )
    moved = comm_bytes(op, x_shape, w_shape, dtype, axis_size, fp8=fp8) if known else None
    if platform == "cpu":
        return ImplChoice(
            "ub",
            "CPU devices: impl='auto' runs the host protocol wherever it can (it tests the "
            "protocol; it is not a speed path)",
            moved,
        )
    if moved is None:
        # Only where the op's caller did not say how large the group is.
        return ImplChoice("ub", "the group size is not known here: the size rule is not applied")
    if axis_size == 1:
        return ImplChoice(
            "xla", "a group of one device has nothing to communicate: a plain dot is faster", 0
        )
    limit = config.auto_min_bytes if min_bytes is None else min_bytes
    name = "auto_min_bytes"
    if op == "matmul_all_reduce":
        limit *= ALL_REDUCE_FACTOR
        name = f"{ALL_REDUCE_FACTOR} x auto_min_bytes"
    if moved < limit:
        return ImplChoice(
            "xla",
            f"its collective moves {_size(moved)} per rank, below {name}="
            f"{_size(limit)}: too little to hide the op's fixed cost per call",
            moved,
        )
    return ImplChoice(
        "ub", f"its collective moves {_size(moved)} per rank, >= {name}={_size(limit)}",
        moved,
    )  # fmt: skip


def log_choice(op: str, x_shape, w_shape, dtype, axis_size, choice: ImplChoice) -> None:
    """The debug line of an ``impl="auto"`` decision at trace time (logger "jax_ub")."""
    log.debug(
        "jax_ub: %s impl='auto' -> %r (x %s, w %s, %s, group of %s): %s",
        op, choice.impl, tuple(x_shape), tuple(w_shape), jnp.dtype(dtype).name, axis_size,
        choice.reason,
    )  # fmt: skip


def _size(n: int) -> str:
    """Bytes for a person: the exact count, and in MiB from 1 MiB up."""
    if n >= 1 << 20:
        return f"{n} bytes ({n / (1 << 20):.3g} MiB)"
    return f"{n} bytes"
