"""Timing: loop averages of async calls, rounds interleaved across implementations."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_ub._src.runtime import extension
from jax_ub._src.runtime.communicator import all_communicators
from jax_ub._src.settings.options import Options

WARMUP_CALLS = 20  # per implementation and shape, before anything is timed


def round_order(names, round_index: int) -> list:
    """The order round `round_index` times `names` in: shuffled, since a loop's time depends
    on what ran before it (on one H200 the same GEMM schedule, timed in one fixed slot every
    round, read up to 10% slower than in the next), and seeded by the round alone, so every
    process of a multi-process run takes the same order and their collectives match."""
    order = list(names)
    random.Random(round_index).shuffle(order)
    return order


def loop_time_ms(f, args, iters: int, issued: list | None = None) -> float:
    """Average device time of f(*args) over `iters` async calls, in ms.

    With `issued`, also appends the ms per call until the host had issued them all: when
    that approaches the loop time, the loop is bound by the host, not by the device.
    """
    out = f(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    t_issued = time.perf_counter()
    jax.block_until_ready(out)
    if issued is not None:
        issued.append((t_issued - t0) / iters * 1e3)
    return (time.perf_counter() - t0) / iters * 1e3


def calls_lasting(f, args, seconds: float, minimum: int) -> int:
    """How many calls of f(*args) make a loop of at least `seconds` (and `minimum` calls)."""
    estimate_ms = loop_time_ms(f, args, 3)
    return max(minimum, math.ceil(seconds * 1e3 / estimate_ms))


@jax.jit
def _rel_err(a, b):
    """||a - b|| / ||b||, the norms over every element of two arrays (or pytrees of them,
    e.g. a tuple of gradients)."""
    pairs = [
        (x.astype(jnp.float32), y.astype(jnp.float32))
        for x, y in zip(*map(jax.tree.leaves, (a, b)))
    ]
    diff = sum(jnp.sum(jnp.square(x - y)) for x, y in pairs)
    ref = sum(jnp.sum(jnp.square(y)) for _, y in pairs)
    return jnp.sqrt(diff) / jnp.maximum(jnp.sqrt(ref), 1e-30)


def rel_err(a, b) -> float:
    # On the devices: with several processes no one process holds the whole result.
    return float(np.asarray(_rel_err(a, b)))


@dataclasses.dataclass
class Measured:
    """One op and shape, per implementation: medians over rounds of the loop time (ms per
    call), the spread of the rounds ((max - min) / median), how long the host took to issue
    each loop (ms per call), the error against the reference, the calls per loop; and the
    host time per call and GPU of jax_ub and of each of its variants (ms; of it, waiting for
    the process's other GPUs), by row, where measured."""

    times: dict
    spread: dict
    issued: dict
    errs: dict
    calls: dict = dataclasses.field(default_factory=dict)
    host_ms: dict = dataclasses.field(default_factory=dict)


# bench's rows that are not the op
UNCHECKED = ("gemm", "comm", "xla_seq", "ub_gemm", "fp8_gemm", "fp8_nocomm")


def measure(
    impls,
    reference,
    rounds: int,
    iters: int,
    loop_seconds: float = 0.0,
    say=None,
    unchecked: tuple[str, ...] = UNCHECKED,
) -> Measured:
    """Each implementation's loop time, rounds interleaved. With `loop_seconds`, every loop
    runs at least that long (more calls than `iters` where needed): long loops reach the
    GPU's steady, power-capped clock, where short ones start cooler and drift. Outputs
    (arrays or pytrees of them) are compared with `reference`'s, but for the names in
    `unchecked`, which compute something else."""
    errs = {}
    ref_out = reference[0](*reference[1])
    for name, (f, args) in impls.items():
        if name in unchecked:
            continue
        try:
            errs[name] = rel_err(f(*args), ref_out)
        except Exception as e:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
            message = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
            print(f"  {name} failed: {type(e).__name__}: {message}", flush=True)
            errs[name] = None
    # Rows without communication, checked against XLA's row of the same per-GPU product.
    for name, against in (("ub_gemm", "gemm"), ("fp8_nocomm", "fp8_gemm")):
        if name in impls and against in impls:
            (f, args), (g, gargs) = impls[name], impls[against]
            errs[name] = rel_err(f(*args), g(*gargs))
    live = {n: v for n, v in impls.items() if errs.get(n, 0.0) is not None}
    # Warm-up: jax_ub's first 15 calls of a shape still compare GEMM kernels
    # (Tuning.gemm_trials); every implementation gets the same calls.
    for f, args in live.values():
        loop_time_ms(f, args, WARMUP_CALLS)
    calls = {n: iters for n in live}
    if loop_seconds > 0:
        calls = {n: calls_lasting(f, args, loop_seconds, iters) for n, (f, args) in live.items()}
    samples = {n: [] for n in live}
    issued = {n: [] for n in live}
    # jax_ub's and its variants' host time per call and GPU, each round
    host = {n: [] for n in live if n == "jax_ub" or n.startswith("jax_ub[")}
    for r in range(rounds):
        order = round_order(live, r)
        if say is not None:
            say(f"  round {r + 1}/{rounds}: {', '.join(order)}")
        for name in order:
            f, args = live[name]
            before = host_times() if name in host else None
            samples[name].append(loop_time_ms(f, args, calls[name], issued[name]))
            if before is not None:
                host[name].append(_host_ms_per_call(before, host_times()))
    times = {n: statistics.median(v) for n, v in samples.items()}
    return Measured(
        calls=calls,
        times=times,
        spread={n: (max(v) - min(v)) / times[n] for n, v in samples.items()},
        issued={n: statistics.median(v) for n, v in issued.items()},
        errs=errs,
        host_ms={
            n: (statistics.median(x[0] for x in h), statistics.median(x[1] for x in h))
            for n, h in host.items()
            if h and all(x is not None for x in h)
        },
    )


def _host_ms_per_call(before: dict, after: dict) -> tuple[float, float] | None:
    """Mean over local GPUs of the host ms per jax_ub call (and of its waiting part)."""
    per = []
    for dev, (calls, tot, aw) in after.items():
        c0, t0, a0 = before.get(dev, (0, 0.0, 0.0))
        if calls > c0:
            per.append(((tot - t0) / (calls - c0) * 1e3, (aw - a0) / (calls - c0) * 1e3))
    if not per:
        return None
    return float(np.mean([p[0] for p in per])), float(np.mean([p[1] for p in per]))


def host_times() -> dict[int, tuple[int, float, float]]:
    """Per local GPU ordinal: (calls, host seconds in jax_ub's GPU ops, seconds of that spent
    waiting for the process's other GPUs to enqueue), summed over the communicators that can
    still run calls (live or outgrown).

    When the host seconds per call approach the device time per call, a loop of small ops
    is bound by the host, not by the GPUs.
    """
    totals: dict[int, list] = {}
    for module, comm_id in _cuda_communicators():
        for device, calls, total_ns, await_ns in module.host_times(comm_id):
            t = totals.setdefault(device, [0, 0.0, 0.0])
            t[0] += calls
            t[1] += total_ns * 1e-9
            t[2] += await_ns * 1e-9
    return {d: (c, tot, aw) for d, (c, tot, aw) in totals.items()}


def kernel_choices(
    options: Options | None = None,
) -> dict[tuple[int, int, int], list[tuple[int, bool, int, bool]]]:
    """Per GEMM shape (m, k, n) of the CUDA communicators that can still run calls (live or
    outgrown; those made with `options` where given): every local GPU's (device, row
    description, place in cuBLASLt's heuristic list, whether its trials still compare)."""
    out: dict[tuple[int, int, int], list] = {}
    for module, comm_id in _cuda_communicators(options):
        for device, m, k, n, row, index, deciding in module.kernel_choices(comm_id):
            out.setdefault((m, k, n), []).append((device, row, index, deciding))
    return out


def _cuda_communicators(options: Options | None = None) -> list[tuple[object, int]]:
    """(the CUDA extension, id) of every CUDA communicator that can still run calls: the
    live ones and those outgrown but kept by programs compiled on them (a benchmark's
    earlier programs run there after a later one grew the buffer); those made with
    `options` where given; none without the extension."""
    module = extension.module_for("cuda")
    if module is None:
        return []
    return [(module, c.id) for c in all_communicators(options) if c.platform == "cuda"]


def bar_chart(path: str, panels: list[tuple[str, list[str], dict]], ylabel: str, say) -> None:
    """A PNG of side-by-side bar panels, each ``(title, x labels, {series: values})``, with
    a line at 1.0 (the ratios' baseline); skipped with a message without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        say(f"--png {path}: skipped, matplotlib is missing (pip install 'jax_ub[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, labels, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for i, (name, ys) in enumerate(series.items()):
            ax.bar(np.arange(len(labels)) + i * width, ys, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(labels)) + 0.4, labels, rotation=25, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
