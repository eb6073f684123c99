"""The user's settings: userbuffer size, peer-wait deadline, growth policy, TF32, the
smallest call that ``impl="auto"`` runs as the userbuffer op on GPUs, and a file that keeps
GPU kernel choices across processes.

Each value is validated where it enters: from the environment at import (an error names
the variable that was set) or from :func:`configure` (an error names the argument).
"""

from __future__ import annotations

import dataclasses
import math
import os


def _check_timeout(value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"timeout_s must be a number of seconds, got {value!r} ({source})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout_s must be positive and finite, got {value} ({source})")


def _check_buffer_bytes(value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"buffer_bytes must be an integer, got {value!r} ({source})")
    if value < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {value} ({source})")


def _check_auto_min_bytes(value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"auto_min_bytes must be an integer number of bytes >= 0, got {value!r} ({source})"
        )


def _check_bool(name: str):
    def check(value: object, source: str) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r} ({source})")

    return check


def _check_gemm_cache(value: object, source: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"gemm_cache must be a file path (str), got {value!r} ({source})")
    if not value:
        return
    if "\n" in value:
        raise ValueError(f"gemm_cache must be a path without newlines, got {value!r} ({source})")
    if os.path.isdir(value):
        raise ValueError(f"gemm_cache must be a file, {value!r} is a directory ({source})")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise ValueError(
            f"gemm_cache {value!r}: its directory {folder!r} does not exist ({source})"
        )


# The smallest size measured at which neither op was slower than XLA's (at 4 MiB the
# reduce-scatter was): the calibration is in jax_ub._src.auto_rule's docstring.
DEFAULT_AUTO_MIN_BYTES = 8 << 20

# name -> (env variable or None, parse the variable's text, check, default)
_SETTINGS = {
    "buffer_bytes": ("JAX_UB_BUFFER_BYTES", int, _check_buffer_bytes, 0),
    "timeout_s": ("JAX_UB_TIMEOUT_S", float, _check_timeout, 30.0),
    "allow_grow": ("JAX_UB_ALLOW_GROW", lambda t: t != "0", _check_bool("allow_grow"), True),
    "allow_tf32": (None, None, _check_bool("allow_tf32"), False),
    "auto_min_bytes": ("JAX_UB_AUTO_MIN_BYTES", int, _check_auto_min_bytes, DEFAULT_AUTO_MIN_BYTES),
    "gemm_cache": ("JAX_UB_GEMM_CACHE", str, _check_gemm_cache, ""),
}


def _from_env(name: str) -> object:
    env, parse, check, default = _SETTINGS[name]
    text = os.environ.get(env) if env else None
    if not text:
        return default
    source = f"environment variable {env}={text!r}"
    try:
        value = parse(text)
    except ValueError:
        raise ValueError(f"{name}: {source} is not a valid value") from None
    check(value, source)
    return value


@dataclasses.dataclass
class Config:
    """Settings read when a communicator is created (``auto_min_bytes``: when a call is
    traced).

    Attributes:
      buffer_bytes: the symmetric buffer per device, in bytes. ``0`` (default) sizes it
        from the first op that needs one (at least 1 MiB on CPU, 256 MiB on GPUs, so a
        model's first ops do not each grow it). An op that needs more than the buffer
        holds grows it when ``allow_grow``, else raises naming both sizes (env
        ``JAX_UB_BUFFER_BYTES``).
      timeout_s: how long any rank waits for a peer before the op fails with an error
        naming the missing rank (env ``JAX_UB_TIMEOUT_S``, default 30).
      allow_grow: when an op needs more than the buffer holds, create a larger buffer at
        trace time (at least twice the old one) instead of raising (env
        ``JAX_UB_ALLOW_GROW``, default on).
      allow_tf32: let float32 GEMMs on GPUs use TF32 tensor cores (default off).
      auto_min_bytes: on GPUs, ``impl="auto"`` runs the userbuffer op only for calls whose
        collective moves at least this many bytes per rank, XLA's unfused op below (env
        ``JAX_UB_AUTO_MIN_BYTES``, default 8 MiB, calibrated on 2x H200; the rule and its
        calibration: ``jax_ub._src.auto_rule``, :func:`jax_ub.explain_impl`). CPU devices
        and ``impl="ub"`` ignore it. Every process of a group needs the same value.
      gemm_cache: a file that keeps the GPU kernel each GEMM shape's tuning and trials
        chose (env ``JAX_UB_GEMM_CACHE``; default ``""``: none). A shape the file holds
        runs its kernel from the first call, with no tuning and no trials, so processes
        that share the file run the same kernels: the same speed and the same bits from
        run to run. Lines are keyed by GPU model, cuBLASLt version and shape, and new
        choices are appended; processes may share it on a local file system. Delete it
        to choose again (after a driver, library or clock change). CPU devices ignore it.
    """

    buffer_bytes: int = dataclasses.field(default_factory=lambda: _from_env("buffer_bytes"))
    timeout_s: float = dataclasses.field(default_factory=lambda: _from_env("timeout_s"))
    allow_grow: bool = dataclasses.field(default_factory=lambda: _from_env("allow_grow"))
    allow_tf32: bool = dataclasses.field(default_factory=lambda: _from_env("allow_tf32"))
    auto_min_bytes: int = dataclasses.field(default_factory=lambda: _from_env("auto_min_bytes"))
    gemm_cache: str = dataclasses.field(default_factory=lambda: _from_env("gemm_cache"))


config = Config()


def configure(**changes: object) -> Config:
    """Change settings for communicators created from now on; returns the new config.

    Programs traced afterwards get a communicator made with the new values (a new one
    where a setting it is created with changed, ``timeout_s``, ``allow_tf32`` or
    ``gemm_cache``);
    programs compiled before keep theirs until :func:`jax_ub.finalize`. ``auto_min_bytes``
    applies to calls traced from now on: a function ``jit`` has already traced keeps its
    choice.

    Example::

        jax_ub.configure(timeout_s=5.0, buffer_bytes=512 << 20)
    """
    unknown = [name for name in changes if name not in _SETTINGS]
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        raise ValueError(f"unknown jax_ub setting {names}; known: {list(_SETTINGS)}")
    # Validate the whole change before applying any of it.
    for name, value in changes.items():
        _SETTINGS[name][2](value, f"jax_ub.configure({name}=...)")
    for name, value in changes.items():
        setattr(config, name, value)
    return config
