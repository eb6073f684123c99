"""The group an op's collective runs over, and on which path: the static arguments that
the ops' custom VJPs hand from their front end to their forward and backward."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Group:
    """One call's collective: over which group, and on which path.

    Attributes:
      axis_name: the mesh axis of the collective.
      size: the size of that axis (``tp``).
      fallback: impl="auto": lower to XLA's collectives where the group's devices cannot
        share memory (impl="ub" raises there instead).
      ub: run the userbuffer custom call; False runs the unfused reference on XLA's
        collectives (only the fp8 ops take both paths through one VJP).
    """

    axis_name: str
    size: int
    fallback: bool
    ub: bool = True
