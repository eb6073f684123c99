"""Process-wide settings: userbuffer size, peer-wait deadline, growth policy."""

from __future__ import annotations

import dataclasses
import math
import os

_MIB = 1 << 20
_GEMM_ORDERS = ("auto", "column", "row")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _check(cfg: Config, source: str = "") -> None:
    """Raise a ValueError naming the setting (and `source`, e.g. an env var) if it is bad."""
    where = f" (from {source})" if source else ""
    if isinstance(cfg.timeout_s, bool) or not isinstance(cfg.timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number of seconds, got {cfg.timeout_s!r}{where}")
    if not (math.isfinite(cfg.timeout_s) and cfg.timeout_s > 0):
        raise ValueError(f"timeout_s must be positive and finite, got {cfg.timeout_s}{where}")
    if isinstance(cfg.buffer_bytes, bool) or not isinstance(cfg.buffer_bytes, int):
        raise ValueError(f"buffer_bytes must be an integer, got {cfg.buffer_bytes!r}{where}")
    if cfg.buffer_bytes < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {cfg.buffer_bytes}{where}")
    rows = cfg.reduce_scatter_fold_rows
    if isinstance(rows, bool) or not isinstance(rows, int):
        raise ValueError(f"reduce_scatter_fold_rows must be an integer, got {rows!r}{where}")
    trials = cfg.gemm_trials
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"gemm_trials must be an integer >= 0, got {trials!r}{where}")
    if cfg.gemm_order not in _GEMM_ORDERS:
        raise ValueError(f"gemm_order must be one of {_GEMM_ORDERS}, got {cfg.gemm_order!r}{where}")


@dataclasses.dataclass
class Config:
    """Settings read when a communicator is created.

    Attributes:
      buffer_bytes: symmetric buffer per device. ``0`` sizes it from the first op that
        needs one (env ``JAX_UB_BUFFER_BYTES``).
      timeout_s: how long any rank waits for a peer before the op fails with an error
        naming the missing rank (env ``JAX_UB_TIMEOUT_S``).
      allow_grow: when an op needs more than the buffer holds, create a larger buffer
        at trace time instead of raising (env ``JAX_UB_ALLOW_GROW``).
      allow_tf32: let float32 GEMMs on GPU use TF32 tensor cores.
      autotune_gemm: on GPU, time cuBLASLt's candidate algorithms the first time each
        GEMM shape runs and keep the fastest (env ``JAX_UB_AUTOTUNE_GEMM``; ``0`` keeps
        the heuristic's first pick). The first call of a shape blocks its device's
        thread for the tuning runs: milliseconds for small shapes, up to about two
        seconds for the largest (candidates that do not fit that are left out).
      gemm_order: how GPU GEMMs are described to cuBLASLt, which offers different kernels
        for each: ``"column"`` (the transposed column-major product; the default),
        ``"row"`` (row-major layouts) or ``"auto"`` (with ``autotune_gemm``, time both and
        keep the fastest; without, ``"column"``). Tuning times kernels alone, not beside
        the op's copies: on 2 H200s ``"auto"`` once kept a row-major kernel that was as
        fast alone but made the overlapped op 9% slower, hence the default. Env
        ``JAX_UB_GEMM_ORDER``; results are the same up to float rounding.
      gemm_trials: with ``autotune_gemm``, how many of tuning's fastest kernels the op's
        own first calls of each GEMM shape compare, beside its copies and at the clock it
        runs at, before keeping the fastest (default 3; ``0`` or ``1`` keeps tuning's
        pick). It takes a warm-up call per kernel and 4 timed calls each: 15 calls, with
        timing events read later without waiting. Env ``JAX_UB_GEMM_TRIALS``. Kernels
        round differently, so until a shape's trials end (a call after those 15 reads
        their timings) its results may differ from later calls' in the last bits; with
        ``0`` they are bitwise identical from the first call.
      reduce_scatter_fold_rows: on groups of 2, ``matmul_reduce_scatter`` may send each
        partial in two row pieces and add the peer's partial in its own GEMM's epilogue
        instead of a separate sum pass. It does so when each piece has at least this many
        rows (default 2048: on 2 H200s smaller pieces made the op ~1% slower, see
        ``benchmarks/RESULTS.md``); ``0`` always, negative never (env
        ``JAX_UB_REDUCE_SCATTER_FOLD_ROWS``). Every process of a group must use the same
        value: creating a communicator across processes compares it and raises
        ``ValueError`` naming both values where they differ. Results agree to float
        rounding (the fold rounds the local partial once less).
    """

    buffer_bytes: int = dataclasses.field(
        default_factory=lambda: _env_int("JAX_UB_BUFFER_BYTES", 0)
    )
    timeout_s: float = dataclasses.field(
        default_factory=lambda: _env_float("JAX_UB_TIMEOUT_S", 30.0)
    )
    allow_grow: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("JAX_UB_ALLOW_GROW", "1") not in ("0", "")
    )
    allow_tf32: bool = False
    autotune_gemm: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("JAX_UB_AUTOTUNE_GEMM", "1") not in ("0", "")
    )
    gemm_order: str = dataclasses.field(
        default_factory=lambda: os.environ.get("JAX_UB_GEMM_ORDER", "column")
    )
    gemm_trials: int = dataclasses.field(default_factory=lambda: _env_int("JAX_UB_GEMM_TRIALS", 3))
    reduce_scatter_fold_rows: int = dataclasses.field(
        default_factory=lambda: _env_int("JAX_UB_REDUCE_SCATTER_FOLD_ROWS", 2048)
    )

    def __post_init__(self) -> None:
        _check(
            self,
            "JAX_UB_TIMEOUT_S / JAX_UB_BUFFER_BYTES / JAX_UB_GEMM_ORDER / "
            "JAX_UB_GEMM_TRIALS / JAX_UB_REDUCE_SCATTER_FOLD_ROWS or the constructor",
        )


config = Config()

# What a communicator takes from the config when it is created; fixed for its lifetime. A
# change to any of them gets programs traced afterwards a new communicator (see
# communicator.get_communicator). buffer_bytes and allow_grow only size buffers.
_CREATION_SETTINGS = (
    "timeout_s",
    "allow_tf32",
    "autotune_gemm",
    "gemm_order",
    "gemm_trials",
    "reduce_scatter_fold_rows",
)


def creation_settings() -> tuple[tuple[str, object], ...]:
    """The current values of the settings a communicator is created with, as (name,
    value) pairs (hashable: part of the communicator cache's key)."""
    return tuple((name, getattr(config, name)) for name in _CREATION_SETTINGS)


def configure(**changes: object) -> Config:
    """Change settings for communicators created from now on; returns the new config.

    Programs traced afterwards get a communicator made with the new values (a new one
    where a setting it is created with changed, e.g. ``timeout_s`` or ``gemm_order``);
    programs compiled before keep theirs until :func:`jax_ub.finalize`. Each distinct
    combination in use holds its own userbuffers.

    Example::

        jax_ub.configure(timeout_s=5.0, buffer_bytes=512 << 20)
    """
    fields = [f.name for f in dataclasses.fields(Config)]
    unknown = [name for name in changes if name not in fields]
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        raise ValueError(f"unknown jax_ub setting {names}; known: {fields}")
    # Validate the whole change before applying any of it.
    new = dataclasses.replace(config, **changes)
    for name in changes:
        setattr(config, name, getattr(new, name))
    return config
