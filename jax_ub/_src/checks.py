"""Argument checks shared by the public ops: all of them run before anything is traced."""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jax_ub._src import auto_rule
from jax_ub._src.config import config

UB_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IMPLS = ("auto", "ub", "xla")


def bound_axis_size(op: str, axis_name: str) -> int | None:
    """Size of `axis_name` where it is bound (a shard_map over it), else None: the op is
    then called on global arrays. A ValueError if `axis_name` is not an axis name."""
    if not isinstance(axis_name, str):
        raise ValueError(f"{op}: axis_name must be one mesh axis name (str), got {axis_name=}")
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        return None


def check_divisible(op: str, what: str, value: int, size: int, axis_name: str, shapes: str):
    if value % size != 0:
        raise ValueError(
            f"{op}: {what} ({value}) are not divisible by the size of axis {axis_name!r} "
            f"({size}); {shapes}"
        )


def check_impl(op: str, impl: str) -> None:
    """Every public op, layer and explain_impl call starts here: a JAX_UB_* environment
    variable with invalid text fails it (its error names the variable), then a bad impl."""
    config.check()
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl=}")


def check_matmul_shapes(op: str, x: jax.Array, w: jax.Array) -> None:
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have at least 2 dims [rows, ..., k], got {x.shape=}")
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be 2-D [k, n], got {w.shape=}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op}: contracting dims differ: x.shape[-1]={x.shape[-1]} but w.shape[0]="
            f"{w.shape[0]}; {x.shape=} {w.shape=}"
        )


def ub_unsupported_reason(x: jax.Array, w: jax.Array) -> str | None:
    """Why the userbuffer path cannot take these operands, or None if it can."""
    if x.dtype != w.dtype:
        return f"x and w have different dtypes ({x.dtype=}, {w.dtype=})"
    if x.shape[-1] == 0:
        return f"the contraction is empty (k = x.shape[-1] = 0; {x.shape=})"
    if jnp.dtype(x.dtype) not in UB_DTYPES:
        return f"dtype {x.dtype} is not supported (supported: float32, bfloat16, float16)"
    return None


def fp8_unsupported_reason(x: jax.Array, w: jax.Array) -> str | None:
    """Why the userbuffer path cannot run fp8 with ``x`` [..., k] and weight ``w`` [k, n]
    (this rank's shards) here, or None.

    The shape rule is cuBLASLt's (its fp8 GEMMs need k and n divisible by 16; the backward's
    GEMMs swap them), and it holds on every platform: the host path, which emulates fp8 and
    could run any shape, refuses the same calls, so that a CPU run meets the error (or, with
    impl="auto", the fallback to XLA) that the GPU job would. XLA's own fp8 dots pad to 16
    on GPUs, so impl="xla" takes any shape everywhere.
    """
    if jax.default_backend() == "gpu":
        caps = [getattr(d, "compute_capability", "0.0") for d in jax.devices()]
        if min(tuple(map(int, c.split("."))) for c in caps) < (8, 9):
            return f"fp8 GEMMs need GPUs of compute capability 8.9 or newer, these have {caps}"
    k, n = w.shape
    if k % 16 or n % 16:
        return (
            f"fp8 GEMMs need k and n divisible by 16 (cuBLASLt's rule on GPUs, checked on "
            f"every platform), got k={k}, n={n} in this rank's shards x.shape={tuple(x.shape)}, "
            f"w.shape={tuple(w.shape)}; pad k and n to multiples of 16, or use impl='xla' "
            "(XLA pads its fp8 dots)"
        )
    return None


def platform_unsupported_reason(backend: str) -> str | None:
    """Why this process has no userbuffer op on ``backend`` (jax.default_backend()), or None."""
    from jax_ub._src import extension  # noqa: PLC0415  (keeps import order simple)

    if extension.supported(backend):
        return None
    reason = f"no userbuffer implementation for platform {backend!r}"
    if extension.normalize_platform(backend) == "cuda":
        reason += (
            f": the CUDA extension is {extension.cuda_import_error()} (reinstall jax_ub "
            "without JAX_UB_DISABLE_CUDA: it builds with NVIDIA's compiler wheels where no "
            "CUDA toolkit is installed; `python -m jax_ub.info` says what is loaded)"
        )
    return reason


def operands_unsupported_reason(x, w, fp8: bool) -> str | None:
    """Why the userbuffer op cannot take ``x`` and ``w`` (in fp8 with ``fp8``), or None.
    ``x`` and ``w`` need only ``shape`` and ``dtype``."""
    reason = ub_unsupported_reason(x, w)
    if reason is None and fp8:
        reason = fp8_unsupported_reason(x, w)
    return reason


def choose_impl(
    op: str,
    impl: str,
    x: jax.Array,
    w: jax.Array,
    fp8: bool = False,
    axis_size: int | None = None,
) -> auto_rule.ImplChoice:
    """What ``impl`` runs for ``x @ w`` (local shards, in fp8 with ``fp8``) on this process's
    backend, and why: impl="auto" resolved by the rule (:mod:`jax_ub._src.auto_rule`;
    without ``axis_size`` its size tests are skipped). Raises if impl="ub" cannot run it;
    warns once where "auto" falls back on GPUs for want of the CUDA extension."""
    from jax_ub._src import extension  # noqa: PLC0415

    if impl == "xla":
        return auto_rule.ImplChoice("xla", "impl='xla' asks for XLA's collectives")
    backend = jax.default_backend()
    operands_reason = operands_unsupported_reason(x, w, fp8)
    reason = operands_reason or platform_unsupported_reason(backend)
    if reason is not None:
        if impl == "ub":
            raise ValueError(f"{op}: impl='ub' cannot run this call: {reason}")
        if operands_reason is None and extension.normalize_platform(backend) == "cuda":
            message = f"jax_ub: impl='auto' uses XLA's collectives on GPUs: {reason}"
            warn_once(message, message)
        return auto_rule.ImplChoice("xla", reason)
    if impl == "ub":
        return auto_rule.ImplChoice("ub", "impl='ub' asks for the userbuffer op")
    platform = "cpu" if backend == "cpu" else "gpu"
    return auto_rule.auto_choice(
        op, x.shape, w.shape, x.dtype, axis_size, fp8=fp8, platform=platform
    )


def use_ub(
    op: str,
    impl: str,
    x: jax.Array,
    w: jax.Array,
    fp8: bool = False,
    axis_size: int | None = None,
) -> bool:
    """Whether the op runs the userbuffer path (:func:`choose_impl`); impl="auto"'s
    decisions are logged at DEBUG on the "jax_ub" logger."""
    choice = choose_impl(op, impl, x, w, fp8, axis_size)
    if impl == "auto":
        auto_rule.log_choice(op, x.shape, w.shape, x.dtype, axis_size, choice)
    return choice.impl == "ub"


_warned: set[str] = set()  # keys already warned about; cleared by jax_ub.finalize()
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
