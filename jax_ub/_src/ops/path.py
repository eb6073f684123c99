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
    """

    UB = "ub"
    XLA = "xla"
    NONE = "none"

    @property
    def collectives(self) -> Collectives:
        """The collectives of the unfused op on this path: none for ``NONE``, else XLA's."""
        return NONE if self is Path.NONE else XLA


@dataclasses.dataclass(frozen=True)
class Bodies:
    """An op's computation on one rank's operands, one function per path, each called as
    ``f(call, *args)`` (``call``: the driver's call record, its path resolved).

    Attributes:
      ub: the userbuffer custom call (``call.path`` is ``Path.UB``).
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
        elif call.path is Path.UB:
            body = self.ub
        else:
            body = self.unfused
        return body(call, *args)
