"""Overlap benchmark: jax_ub against GEMM alone, XLA and other collective matmuls.

Run ``python -m jax_ub.bench`` (or ``benchmarks/bench_overlap.py``) on a machine with
several GPUs. Everything below runs in one process, interleaved round by round, except
XLA's windowed einsum, which needs its own XLA flags and so its own process.

With ``--processes P`` the same benchmark runs as P processes on this host, each driving
``--gpus-per-process`` GPUs, joined by ``jax.distributed`` (userbuffers shared through
CUDA IPC): compare with the one-process numbers of the same shapes.

Device time of an implementation = average over a loop of async calls (after warm-up);
the reported number is the median over rounds. Per GPU shapes: x [M/tp, K] gathered to
[M, K] and multiplied by w [K, N/tp] (AG+GEMM); x [M, N/tp] @ w [N/tp, K] reduce-scattered
to [M/tp, K] (GEMM+RS).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import options
from jax_ub._src.communicator import host_times

AXIS = "tp"
WARMUP_CALLS = 20  # per implementation and shape, before anything is timed
SOLO = "solo"  # a size-1 axis: jax_ub's op as a GEMM alone


def _smap(mesh, f, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


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


def ring_all_gather_matmul(x, w):
    """Collective matmul from ppermute: each step multiplies the chunk in hand, passes it on."""
    size = lax.axis_size(AXIS)
    idx = lax.axis_index(AXIS)
    m = x.shape[0]
    out = jnp.zeros((size * m, w.shape[1]), x.dtype)
    perm = [(j, (j - 1) % size) for j in range(size)]
    chunk = x
    for i in range(size):
        src = (idx + i) % size
        out = lax.dynamic_update_slice(out, chunk @ w, (src * m, 0))
        if i < size - 1:
            chunk = lax.ppermute(chunk, AXIS, perm)
    return out


def _mgpu_all_gather_matmul(mesh, m_local, k, n_local, dtype):
    """JAX's Pallas Mosaic-GPU collective matmul (Hopper, AG only), or None if unavailable."""
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
    except Exception:  # noqa: BLE001  (optional baseline)
        return None
    try:
        cfg = cm.TuningConfig(
            tile_m=128,
            tile_n=128,
            tile_k=64,
            max_concurrent_steps=4,
            grid_minor_dim=cm.MatmulDimension.M,
            grid_tile_width=16,
            wg_dimension=cm.MatmulDimension.N,
        )
        fn = functools.partial(cm.all_gather_lhs_matmul, axis_name=AXIS, config=cfg, dtype=dtype)
    except Exception:  # noqa: BLE001
        return None
    return _smap(mesh, fn, (P(AXIS, None), P(None, AXIS)), P(None, AXIS))


def _put(host: np.ndarray, mesh, spec) -> jax.Array:
    """A global array from the same host data in every process (works with several)."""
    return jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, spec), lambda index: host[index]
    )


def _random(seed: int, shape, dtype, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)


def _solo_mesh(mesh) -> Mesh:
    """The same GPUs, each in a tensor-parallel group of its own (axis SOLO, size 1)."""
    return Mesh(np.array(mesh.devices).reshape(-1, 1), (AXIS, SOLO))


def build_ag(mesh, M, K, N, dtype, seed, variants=()):
    tp = mesh.shape[AXIS]
    x = _random(seed, (M, K), dtype)
    w = _random(seed + 1, (K, N), dtype, 1 / np.sqrt(K))
    xs, xr, ws = _put(x, mesh, P(AXIS, None)), _put(x, mesh, P()), _put(w, mesh, P(None, AXIS))
    row, col = (P(AXIS, None), P(None, AXIS)), P(None, AXIS)
    row_solo = (P(), P(None, AXIS))

    def ub():
        return _smap(mesh, lambda a, b: jax_ub.all_gather_matmul(a, b, AXIS, impl="ub"), row, col)

    impls = {
        "gemm": (_smap(mesh, lambda a, b: a @ b, (P(), P(None, AXIS)), col), (xr, ws)),
        "comm": (_smap(mesh, lambda a, b: lax.all_gather(a, AXIS, tiled=True), row, P()), (xs, ws)),
        "xla_seq": (
            _smap(mesh, lambda a, b: jax_ub.all_gather_matmul(a, b, AXIS, impl="xla"), row, col),
            (xs, ws),
        ),
        "ring": (_smap(mesh, ring_all_gather_matmul, row, col), (xs, ws)),
        "jax_ub": (ub(), (xs, ws)),
    }
    _add_variants(impls, ub, (xs, ws), variants)
    if jax.process_count() == 1:  # the Pallas kernel and the ring: one-process baselines
        # jax_ub's own GEMM alone: the op on groups of one GPU, the "gemm" row's shapes.
        solo = _solo_mesh(mesh)
        impls["ub_gemm"] = (
            _smap(
                solo, lambda a, b: jax_ub.all_gather_matmul(a, b, SOLO, impl="ub"), row_solo, col
            ),
            (_put(x, solo, P()), _put(w, solo, P(None, AXIS))),
        )
        mgpu = _mgpu_all_gather_matmul(mesh, M // tp, K, N // tp, dtype)
        if mgpu is not None:
            impls["pallas_mgpu"] = (mgpu, (xs, ws))
    else:
        del impls["ring"]
    return impls, impls["xla_seq"]


def build_rs(mesh, M, K, N, dtype, seed, variants=()):
    x = _random(seed, (M, N), dtype)
    w = _random(seed + 1, (N, K), dtype, 1 / np.sqrt(N))
    xs, ws = _put(x, mesh, P(None, AXIS)), _put(w, mesh, P(AXIS, None))
    ins, out = (P(None, AXIS), P(AXIS, None)), P(AXIS, None)
    y_local = _put(np.ones((M * mesh.shape[AXIS], K), dtype), mesh, P(AXIS, None))

    def ub():
        return _smap(
            mesh, lambda a, b: jax_ub.matmul_reduce_scatter(a, b, AXIS, impl="ub"), ins, out
        )

    impls = {
        "gemm": (_smap(mesh, lambda a, b: a @ b, ins, P(AXIS, None)), (xs, ws)),
        "comm": (
            _smap(
                mesh,
                lambda a: lax.psum_scatter(a, AXIS, tiled=True),
                (P(AXIS, None),),
                P(AXIS, None),
            ),
            (y_local,),
        ),
        "xla_seq": (
            _smap(
                mesh, lambda a, b: jax_ub.matmul_reduce_scatter(a, b, AXIS, impl="xla"), ins, out
            ),
            (xs, ws),
        ),
        "jax_ub": (ub(), (xs, ws)),
    }
    _add_variants(impls, ub, (xs, ws), variants)
    if jax.process_count() == 1:
        solo = _solo_mesh(mesh)
        impls["ub_gemm"] = (
            _smap(solo, lambda a, b: jax_ub.matmul_reduce_scatter(a, b, SOLO, impl="ub"), ins, out),
            (_put(x, solo, P(None, AXIS)), _put(w, solo, P(AXIS, None))),
        )
    return impls, impls["xla_seq"]


def parse_variants(text: str) -> list[dict]:
    """ "name=value,name=value;name=value" -> one dict of tuning choices per variant
    (jax_ub._src.options.Tuning's names).
    Values are read as Python literals where they parse (ints, floats, True), else kept as
    strings ("auto")."""
    variants = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        settings = {}
        for item in part.split(","):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r} is not name=value")
            try:
                settings[name.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                settings[name.strip()] = value.strip()
        variants.append(settings)
    return variants


def variant_name(settings: dict) -> str:
    return "jax_ub[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]"


def _configured(settings: dict):
    """The tuning choices `settings` inside the block, through the experimental hook (a
    bad name or value raises there, changing nothing)."""
    return options.experimental_tuning(**settings)


def _add_variants(impls, make, args, variants) -> None:
    """jax_ub's op again under other settings, one row each, interleaved with the rest.
    Communicators take their settings when they are created, at lowering: so each variant
    is compiled now, with its settings configured, and keeps a communicator of its own."""
    for settings in variants:
        with _configured(settings):
            impls[variant_name(settings)] = (make().lower(*args).compile(), args)


@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def rel_err(a, b) -> float:
    # On the devices: with several processes no one process holds the whole result.
    return float(np.asarray(_rel_err(a, b)))


@dataclasses.dataclass
class Measured:
    """One op and shape, per implementation: medians over rounds of the loop time (ms per
    call), the spread of the rounds ((max - min) / median), how long the host took to issue
    each loop (ms per call), the error against the reference, the calls per loop; and
    jax_ub's host time per call and GPU (ms; of it, waiting for the process's other
    GPUs), where measured."""

    times: dict
    spread: dict
    issued: dict
    errs: dict
    calls: dict = dataclasses.field(default_factory=dict)
    host_ms: tuple[float, float] | None = None


def measure(impls, reference, rounds: int, iters: int, loop_seconds: float = 0.0) -> Measured:
    """Each implementation's loop time, rounds interleaved. With `loop_seconds`, every loop
    runs at least that long (more calls than `iters` where needed): long loops reach the
    GPU's steady, power-capped clock, where short ones start cooler and drift."""
    errs = {}
    ref_out = reference[0](*reference[1])
    for name, (f, args) in impls.items():
        if name in ("gemm", "comm", "xla_seq", "ub_gemm"):
            continue
        try:
            errs[name] = rel_err(f(*args), ref_out)
        except Exception as e:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            errs[name] = None
    if "ub_gemm" in impls:  # the GEMM alone, checked against XLA's
        (f, args), (g, gargs) = impls["ub_gemm"], impls["gemm"]
        errs["ub_gemm"] = rel_err(f(*args), g(*gargs))
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
    host = []  # jax_ub's host time per call and GPU, each round
    for _ in range(rounds):
        for name, (f, args) in live.items():
            before = host_times() if name == "jax_ub" else None
            samples[name].append(loop_time_ms(f, args, calls[name], issued[name]))
            if before is not None:
                host.append(_host_ms_per_call(before, host_times()))
    times = {n: statistics.median(v) for n, v in samples.items()}
    return Measured(
        calls=calls,
        times=times,
        spread={n: (max(v) - min(v)) / times[n] for n, v in samples.items()},
        issued={n: statistics.median(v) for n, v in issued.items()},
        errs=errs,
        host_ms=(
            (statistics.median(h[0] for h in host), statistics.median(h[1] for h in host))
            if host and all(h is not None for h in host)
            else None
        ),
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


def windowed_einsum_ms(M, K, N, dtype_name, rounds, iters, tp) -> float | None:
    """XLA's windowed einsum (its own process: it needs its own XLA flags)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_threshold_for_windowed_einsum_mib=0"
        " --xla_gpu_multi_streamed_windowed_einsum=true"
    )
    cmd = [
        sys.executable,
        "-m",
        "jax_ub.bench",
        "--windowed-einsum-child",
        "--shapes",
        f"{M}x{K}x{N}",
        "--dtype",
        dtype_name,
        "--rounds",
        str(rounds),
        "--iters",
        str(iters),
        "--tp",
        str(tp),
    ]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        for line in res.stdout.splitlines():
            if line.startswith("WINDOWED_EINSUM_MS"):
                return float(line.split()[1])
        print("  windowed einsum child said:", res.stderr[-500:], flush=True)
    except subprocess.TimeoutExpired:
        print("  windowed einsum child timed out", flush=True)
    return None


def _windowed_einsum_child(M, K, N, dtype, rounds, iters, tp) -> None:
    mesh = Mesh(np.array(jax.devices()[: tp or None]), (AXIS,))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (M, K), dtype), NamedSharding(mesh, P(AXIS, None)))
    w = jax.device_put(jax.random.normal(kw, (K, N), dtype), NamedSharding(mesh, P(None, AXIS)))
    f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P(None, AXIS)))
    ts = [loop_time_ms(f, (x, w), iters) for _ in range(rounds)]
    print(f"WINDOWED_EINSUM_MS {statistics.median(ts):.4f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes",
        default="8192x8192x32768",
        help="comma-separated MxKxN (global): AG+GEMM x[M,K]@w[K,N]",
    )
    ap.add_argument("--sweep-m", default="", help="comma-separated M values at the first K,N")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ops", default="ag,rs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--loop-seconds",
        type=float,
        default=0.0,
        help="make every timed loop last at least this long (more calls than --iters where "
        "needed), so the GPU reaches its steady, power-capped clock; one process only",
    )
    ap.add_argument(
        "--ub-variants",
        default="",
        help="EXPERIMENTAL: more jax_ub rows, each under other internal tuning choices "
        "(jax_ub._src.options.Tuning), measured in the same interleaved rounds: "
        '"name=value,...;name=value" (e.g. "reduce_scatter_fold_rows=-1;gemm_order=auto"); '
        "printed relative to jax_ub",
    )
    ap.add_argument("--tp", type=int, default=0, help="use the first TP devices (default: all)")
    ap.add_argument("--no-windowed-einsum", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--png", default="")
    ap.add_argument(
        "--processes",
        type=int,
        default=0,
        help="run as this many processes on this host (jax.distributed), GPUs split evenly",
    )
    ap.add_argument("--gpus-per-process", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--windowed-einsum-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--windowed-einsum-only-first",
        action="store_true",
        help="run XLA's windowed einsum (a process per shape) for the first shape only",
    )
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.ub_variants)
        for settings in variants:  # a bad name or value fails now, not after the first shape
            with _configured(settings):
                pass
    except ValueError as e:
        ap.error(f"--ub-variants: {e}")
    dtype = jnp.dtype(args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if args.sweep_m:
        _, K, N = shapes[0]
        shapes += [(int(m), K, N) for m in args.sweep_m.split(",")]
    if args.windowed_einsum_child:
        _windowed_einsum_child(*shapes[0], dtype, args.rounds, args.iters, args.tp)
        return
    if args.processes and args.loop_seconds:
        # Each process would choose its own number of calls, and their collectives must match.
        ap.error("--loop-seconds needs one process (its call counts are chosen per process)")
    if args.processes and args.process_id < 0:
        sys.exit(_launch(args, argv if argv is not None else sys.argv[1:]))
    if args.processes:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
        args.no_windowed_einsum = True  # its child process would not join the others
    lead = jax.process_index() == 0
    say = functools.partial(print, flush=True) if lead else (lambda *a, **k: None)
    devices = jax.devices()[: args.tp or None]
    mesh = Mesh(np.array(devices), (AXIS,))
    tp = len(devices)
    say(
        f"devices: {tp} x {devices[0].device_kind} in {jax.process_count()} process(es); "
        f"jax {jax.__version__}; dtype {dtype}"
    )
    results = []
    for M, K, N in shapes:
        for op in args.ops.split(","):
            build = build_ag if op == "ag" else build_rs
            impls, ref = build(mesh, M, K, N, dtype, M + K + N, variants)
            measured = measure(impls, ref, args.rounds, args.iters, args.loop_seconds)
            times, errs = measured.times, measured.errs
            first = (M, K, N) == shapes[0]
            if (
                op == "ag"
                and not args.no_windowed_einsum
                and (first or not args.windowed_einsum_only_first)
            ):
                we = windowed_einsum_ms(M, K, N, args.dtype, args.rounds, args.iters, tp)
                if we is not None:
                    times["xla_windowed_einsum"] = we
            t_seq, t_gemm, t_ub = times["xla_seq"], times["gemm"], times["jax_ub"]
            hidden = (t_seq - t_ub) / (t_seq - t_gemm) if t_seq > t_gemm else float("nan")
            row = dict(
                op=op,
                M=M,
                K=K,
                N=N,
                tp=tp,
                dtype=str(dtype),
                times_ms=times,
                spread=measured.spread,
                issued_ms=measured.issued,
                rel_err=errs,
                speedup_vs_xla_seq=t_seq / t_ub,
                ub_over_gemm=t_ub / t_gemm,
                comm_hidden=hidden,
            )
            results.append(row)
            loops = f"{args.iters} calls"
            if args.loop_seconds:
                loops = f">= {args.loop_seconds:g} s loops ({min(measured.calls.values())}"
                loops += f"-{max(measured.calls.values())} calls)"
                row.update(calls=measured.calls)
            say(
                f"\n{op.upper()} M={M} K={K} N={N} tp={tp}: per-GPU ms, median of "
                f"{args.rounds} rounds x {loops}; the rounds' spread; per call, how "
                "long the host took to issue the loop",
                flush=True,
            )
            width = max(22, *map(len, times))
            for name, t in sorted(times.items(), key=lambda kv: kv[1]):
                e, sp, d = errs.get(name), measured.spread.get(name), measured.issued.get(name)
                say(
                    f"  {name:{width}s} {t:8.3f}  x{t_seq / t:5.2f} vs xla_seq"
                    + (f"  spread {100 * sp:4.1f}%  issued in {d:6.3f}" if d is not None else "")
                    + (f"  rel_err {e:.1e}" if e is not None else ""),
                    flush=True,
                )
            say(
                f"  jax_ub / gemm = {t_ub / t_gemm:.3f}, comm hidden = {100 * hidden:.0f}%",
                flush=True,
            )
            for settings in variants:  # an A/B of settings, same rounds
                name = variant_name(settings)
                if name in times:
                    say(f"  {name} / jax_ub = {times[name] / t_ub:.3f}", flush=True)
            if "ub_gemm" in times:
                # Splits a miss: jax_ub's GEMM kernels against XLA's, and the overlapped op
                # against its own GEMM run alone.
                t_own = times["ub_gemm"]
                row.update(ub_over_own_gemm=t_ub / t_own)
                say(
                    f"  jax_ub's GEMM alone / gemm = {t_own / t_gemm:.3f}, "
                    f"jax_ub / jax_ub's GEMM alone = {t_ub / t_own:.3f}",
                    flush=True,
                )
            if measured.host_ms is not None:
                # Host-bound when this approaches jax_ub's device time per call.
                host_ms, await_ms = measured.host_ms
                row.update(jax_ub_host_ms=host_ms, jax_ub_host_await_ms=await_ms)
                say(
                    f"  jax_ub host time per call and GPU: {host_ms:.3f} ms "
                    f"({await_ms:.3f} ms of it waiting for the process's other GPUs)",
                    flush=True,
                )
    if args.json and lead:
        with open(args.json, "w") as fh:
            info = dict(device=devices[0].device_kind, tp=tp, processes=jax.process_count())
            json.dump(dict(**info, results=results), fh, indent=1)
    if args.png and lead:
        _plot(results, args.png)


def _launch(args, argv: list[str]) -> int:
    """Start args.processes copies of this benchmark, each on its own GPUs; wait for all."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    g = args.gpus_per_process
    procs = []
    for i in range(args.processes):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i * g + d) for d in range(g)))
        cmd = [sys.executable, "-m", "jax_ub.bench", *argv]
        cmd += ["--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"]
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


def _plot(results, path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = sorted({r["op"] for r in results})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in results if r["op"] == op]
        labels = [f"{r['M']}x{r['K']}x{r['N']}" for r in rows]
        names = sorted({n for r in rows for n in r["times_ms"]})
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [r["times_ms"].get(name, np.nan) / r["times_ms"]["gemm"] for r in rows]
            ax.bar(np.arange(len(rows)) + i * width, ys, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(rows)) + 0.4, labels, rotation=30, fontsize=7)
        ax.set_ylabel("time / GEMM alone")
        ax.set_title(f"{op.upper()} on {rows[0]['tp']} GPUs")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
