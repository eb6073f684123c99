"""Warnings given once per key: the ops warn at trace time, which repeats for every
retrace, so each distinct situation is reported only the first time it comes up.

The registry is cleared where the state it describes is torn down
(``communicator.take_all``, behind ``jax_ub.finalize()``), so a situation met again after
a finalize is reported again.
"""

from __future__ import annotations

import threading
import warnings

_warned: set[str] = set()  # keys already warned about; cleared by clear_warnings()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn with `message` the first time `key` comes up (until :func:`clear_warnings`)."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=stacklevel)


def clear_warnings() -> None:
    with _warned_lock:
        _warned.clear()
