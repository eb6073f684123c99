"""Which path a call takes: the userbuffer op ("ub"), XLA's unfused op ("xla") or the
unfused GEMMs alone ("none"), as a :class:`~jax_ub._src.ops.path.Path`.

What the userbuffer op can run at all (dtypes, fp8 support, platform and extension) is
decided here; among the calls it can run, impl="auto" follows the rule of
:mod:`jax_ub._src.settings.auto_rule`. The driver asks :func:`choose_path` once per GEMM
of a call, at trace time, and records the answer in the call.

One part of the decision is deferred to lowering, the only place that knows the concrete
devices: whether the group's devices can share memory (one host, peer access). A call on
``Path.UB`` under ``impl="auto"`` then still lowers to XLA's collectives, with a warning,
where they cannot (:func:`falls_back_at_lowering`; ``communicator.for_lowering``);
``impl="ub"`` raises there instead.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ub._src.ops.path import Path
from jax_ub._src.runtime import extension
from jax_ub._src.settings import auto_rule, checks
from jax_ub._src.settings.auto_rule import ImplChoice
from jax_ub._src.settings.config import config
from jax_ub._src.settings.warn_registry import warn_once

UB_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
) -> ImplChoice:
    """What ``impl`` runs for ``x @ w`` (local shards, in fp8 with ``fp8``) on this process's
    backend, and why: impl="auto" resolved by the rule (:mod:`jax_ub._src.settings.auto_rule`;
    without ``axis_size`` its size tests are skipped). Raises if impl="ub" cannot run it;
    warns once where "auto" falls back on GPUs for want of the CUDA extension."""
    if impl == "xla":
        return ImplChoice("xla", "impl='xla' asks for XLA's collectives")
    if impl == "none" and config.bound_gemms == "xla":
        return ImplChoice("none", "impl='none' removes the communication (the bound)")
    backend = jax.default_backend()
    operands_reason = operands_unsupported_reason(x, w, fp8)
    reason = operands_reason or platform_unsupported_reason(backend)
    if reason is not None:
        if impl == "ub":
            raise ValueError(f"{op}: impl='ub' cannot run this call: {reason}")
        if impl == "none":
            raise ValueError(
                f"{op}: impl='none' with bound_gemms='ub' cannot run jax_ub's GEMM here: "
                f"{reason}; configure(bound_gemms='xla') times XLA's"
            )
        if operands_reason is None and extension.normalize_platform(backend) == "cuda":
            message = f"jax_ub: impl='auto' uses XLA's collectives on GPUs: {reason}"
            warn_once(message, message)
        return ImplChoice("xla", reason)
    if impl == "ub":
        return ImplChoice("ub", "impl='ub' asks for the userbuffer op")
    if impl == "none":
        return ImplChoice("none_ub", "impl='none' on jax_ub's GEMMs (bound_gemms='ub')")
    platform = "cpu" if backend == "cpu" else "gpu"
    return auto_rule.auto_choice(
        op, x.shape, w.shape, x.dtype, axis_size, fp8=fp8, platform=platform
    )


def choose_path(
    op: str,
    impl: str,
    x: jax.Array,
    w: jax.Array,
    fp8: bool = False,
    axis_size: int | None = None,
) -> Path:
    """The path of one GEMM ``x @ w`` of ``op`` (:func:`choose_impl`); impl="auto"'s
    decisions are logged at DEBUG on the "jax_ub" logger."""
    choice = choose_impl(op, impl, x, w, fp8, axis_size)
    if impl == "auto":
        auto_rule.log_choice(op, x.shape, w.shape, x.dtype, axis_size, choice)
    return Path(choice.impl)


def falls_back_at_lowering(impl: str) -> bool:
    """Whether a call on ``Path.UB`` may still lower to XLA's collectives where its group's
    devices cannot share memory (module docstring): under impl="auto" only."""
    return impl == "auto"


def all_reduce_sums_nothing(size: int, rows: int) -> bool:
    """matmul_all_reduce on a group of one, or on no rows (an empty sequence), sums
    nothing: it runs XLA's dot whatever the impl (its route, and explain_impl)."""
    return size == 1 or rows == 0


def explain_impl(
    op: str,
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: object,
    axis_size: int,
    *,
    impl: str = "auto",
    fp8: bool = False,
) -> ImplChoice:
    """What ``op(x, w, axis_name, impl=impl)`` runs in this process, and why.

    The same decision the op makes at trace time (module ``jax_ub._src.settings.auto_rule``), for a
    call inside ``shard_map`` on local shards, on this process's default backend.

    Args:
      op: ``"all_gather_matmul"``, ``"matmul_reduce_scatter"`` or ``"matmul_all_reduce"``.
      x_shape, w_shape: the local shapes (``x [m, ..., k]``, ``w [k, n]``), as inside
        ``shard_map``.
      dtype: the dtype of ``x`` and ``w``.
      axis_size: the size of the op's mesh axis (``tp``).
      impl: ``"auto"``, ``"ub"``, ``"xla"`` or ``"none"``.
      fp8: the call passes ``fp8=Fp8Scales(...)``.

    Returns:
      an :class:`ImplChoice`: ``impl`` ("ub", "xla" or "none"), ``reason``,
      ``comm_bytes``.

    Raises:
      ValueError: where ``impl="ub"`` cannot run this call (the op raises the same), for a
        call the op refuses with any impl (matmul_reduce_scatter's rows not divisible by
        ``axis_size``), or for an ``axis_size`` below 1.

    Example (on CPU devices, where the host protocol runs wherever it can; on GPUs this
    call would run XLA's op, its 1.5 MiB per rank being below the default 8 MiB)::

        >>> choice = jax_ub.explain_impl("all_gather_matmul", (256, 1024), (1024, 4096),
        ...                              jnp.bfloat16, axis_size=4)
        >>> choice.impl, choice.comm_bytes
        ('ub', 1572864)
        >>> choice.comm_bytes == (4 - 1) * 256 * 1024 * 2  # 3 peers' bf16 shards of x
        True
    """
    auto_rule.check_op(op)
    checks.check_impl(op, impl)
    if not isinstance(axis_size, numbers.Integral) or isinstance(axis_size, bool) or axis_size < 1:
        raise ValueError(f"{op}: axis_size must be an integer >= 1, got {axis_size=}")
    axis_size = int(axis_size)
    x = jax.ShapeDtypeStruct(tuple(x_shape), jnp.dtype(dtype))
    w = jax.ShapeDtypeStruct(tuple(w_shape), jnp.dtype(dtype))
    checks.check_matmul_shapes(op, x, w)
    if op == "matmul_reduce_scatter" and x.shape[0] % axis_size:  # the op's check, as it says it
        raise ValueError(
            f"{op}: rows of x ({x.shape[0]}) are not divisible by the size of the axis "
            f"({axis_size=}); {x.shape=}"
        )
    if op == "matmul_all_reduce" and all_reduce_sums_nothing(axis_size, x.shape[0]):
        choice = ImplChoice("xla", "a group of one, or no rows, sums nothing: XLA's dot")
    else:
        choice = choose_impl(op, impl, x, w, fp8, axis_size)
    if choice.impl == "none_ub":
        keeps = op == "matmul_all_reduce"  # its bound keeps XLA's dot (_route)
        choice = ImplChoice(
            "none",
            "impl='none' removes the communication (the bound), on "
            + ("XLA's dot: matmul_all_reduce keeps it" if keeps else "jax_ub's GEMMs")
            + " (bound_gemms='ub')",
        )
    moved = auto_rule.comm_bytes(op, x_shape, w_shape, dtype, axis_size, fp8=fp8)
    return dataclasses.replace(choice, comm_bytes=moved)
