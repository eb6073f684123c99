"""The path one GEMM of a call takes, and an op's bodies, one per path.

The driver (:mod:`jax_ub._src.ops.driver`) resolves each call's ``impl`` into a
:class:`Path` per GEMM once, on the rank's operands (:func:`impl_choice.choose_path`), and
records it in the call; an op's body only reads it (:class:`Bodies`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from jax_ub._src.lowering.unfused import NONE, XLA, Collectives


class Path(enum.Enum):
    """Which implementation runs one GEMM and its collective.

    ``UB``: the userbuffer custom call (still falling back to XLA's collectives at lowering
    under ``impl="auto"``: see :mod:`jax_ub._src.ops.impl_choice`). ``XLA``: the unfused op
    on XLA's collectives. ``NONE``: the same GEMMs, nothing communicated (a timing bound).
    ``NONE_UB``: the bound on jax_ub's GEMMs (``config.bound_gemms="ub"``): the userbuffer
    bodies, each call on a group of one device (``group.SoloGroup``).
    """

    UB = "ub"
    XLA = "xla"
    NONE = "none"
    NONE_UB = "none_ub"

    @property
    def collectives(self) -> Collectives:
        """The collectives of the unfused op on this path: none for the bounds, else XLA's."""
        return NONE if self in (Path.NONE, Path.NONE_UB) else XLA

    @property
    def calls_ub(self) -> bool:
        """Whether the path runs jax_ub's calls (the userbuffer bodies)."""
        return self in (Path.UB, Path.NONE_UB)


@dataclasses.dataclass(frozen=True)
class Bodies:
    """An op's computation on one rank's operands, one function per path, each called as
    ``f(call, *args)`` (``call``: the driver's call record, its path resolved).

    Attributes:
      ub: the userbuffer custom call (``call.path.calls_ub``).
      unfused: XLA's collectives, or none (``call.path.collectives`` says which).
      fp8: the call in fp8 (``call.fp8``), on either path: the fp8 ops run both under one
        VJP, reading the path from their group.
    """

    ub: Callable[..., Any]
    unfused: Callable[..., Any]
    fp8: Callable[..., Any] | None = None

    def __call__(self, call: Any, *args: Any) -> Any:
        if call.fp8:
            body = self.fp8
        elif call.path.calls_ub:
            body = self.ub
        else:
            body = self.unfused
        return body(call, *args)
