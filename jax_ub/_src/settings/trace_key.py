"""What jax_ub reads when it traces a call, made part of the key of JAX's caches of traced
functions (``jax.jit``'s and ``nnx.jit``'s among them).

A setting read at trace time (``configure(auto_min_bytes=...)``, the Flax layers' model-wide
:func:`jax_ub.flax.defaults`) would otherwise reach only functions traced after it: a
function ``jit`` traced before keeps its first trace, and the change has no effect and says
nothing. JAX retraces where a user context's value (``jax.make_user_context``) differs, so
the settings go into two: the global ones (the config's and the tuning's trace-time
values), and those of the innermost ``defaults`` context.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager

import jax

from jax_ub._src import jax_compat

_GLOBAL = jax.make_user_context(None)
_SCOPED = jax.make_user_context(None)
_global_parts: dict[str, Hashable] = {}


def set_global(part: str, value: Hashable) -> None:
    """``part`` of the global settings (``"config"``, ``"tuning"``) is now ``value``."""
    _global_parts[part] = value
    jax_compat.set_user_context_global(_GLOBAL, tuple(sorted(_global_parts.items())))


def scoped(value: Hashable) -> AbstractContextManager:
    """A context in which the scoped settings (a ``defaults`` context's) are ``value``."""
    return _SCOPED(value)
