"""``python -m jax_ub.bench``'s command line (its description: DESCRIPTION): parse, run
each shape and op, print the tables, write JSON and PNG."""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_ub import share_gpu
from jax_ub.bench.impls import (
    AXIS,
    EPILOGUE_CHECKS,
    _windowed_einsum_child,
    build_ag,
    build_ar,
    build_rs,
    parse_variants,
    variant_name,
    windowed_einsum_ms,
)
from jax_ub.bench.timing import UNCHECKED, bar_chart, measure, rel_err

DESCRIPTION = (
    "Overlap benchmark: times jax_ub's all_gather_matmul (AG+GEMM) and "
    "matmul_reduce_scatter (GEMM+RS) on a 1-D tensor-parallel mesh of this host's devices "
    "against the GEMM alone, XLA's unfused collective and dot, and XLA's windowed einsum "
    "(a process of its own per shape, GPUs only). The implementations run interleaved round "
    "by round; each reported time is the median over the rounds of a loop average of async "
    "calls, per device, and every result is checked against XLA's. On CPU devices it checks "
    "the benchmark and the host protocol, not speed."
)
DTYPES = ("bfloat16", "float16", "float32")


BUILDERS = {"ag": build_ag, "rs": build_rs, "ar": build_ar}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jax_ub.bench", description=DESCRIPTION)
    ap.add_argument(
        "--shapes",
        default="",
        help="comma-separated MxKxN (global): AG+GEMM x[M,K]@w[K,N] (default: "
        f"{GPU_SHAPES} on GPUs, {CPU_SHAPES} on CPU devices)",
    )
    ap.add_argument("--sweep-m", default="", help="comma-separated M values at the first K,N")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=DTYPES,
        help="the operands' dtype (default: %(default)s); --fp8 adds fp8 rows on top",
    )
    ap.add_argument(
        "--ops",
        default="ag,rs",
        help="comma-separated ops to time: ag (all_gather_matmul, AG+GEMM), rs "
        "(matmul_reduce_scatter, GEMM+RS), ar (matmul_all_reduce, GEMM+AR: x [M, K] split "
        "over K, every device ending with all M rows) (default: %(default)s)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds, interleaved across the implementations; each time reported is "
        "the median over them (default: %(default)s)",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=30,
        help="async calls per timed loop, after a warm-up (default: %(default)s)",
    )
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
        "(jax_ub._src.settings.options.Tuning) or GEMM choice file (gemm_cache=PATH), "
        "measured in the same interleaved rounds: "
        '"name=value,...;name=value" (e.g. "reduce_scatter_fold_rows=-1;gemm_order=auto"); '
        "printed relative to jax_ub (with --fp8, jax_ub_fp8 too)",
    )
    ap.add_argument("--tp", type=int, default=0, help="use the first TP devices (default: all)")
    ap.add_argument(
        "--no-windowed-einsum",
        action="store_true",
        help="skip XLA's windowed einsum (it compiles and runs in a process of its own per "
        "shape; always skipped on CPU devices and with --processes)",
    )
    ap.add_argument(
        "--epilogue",
        action="store_true",
        help="AG: also time gelu(x @ w + bias) with the bias and GELU in jax_ub's GEMM epilogue, "
        "in XLA's unfused op and after XLA's dot alone",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="also time the ops in fp8 (given scales) against the fp8 GEMM alone and XLA's "
        "unfused fp8 op",
    )
    ap.add_argument(
        "--json",
        default="",
        metavar="PATH",
        help="write the results (times, spreads, errors, ratios per op and shape) to this "
        "JSON file, rewritten after each one so that a later failure loses nothing",
    )
    ap.add_argument(
        "--png",
        default="",
        metavar="PATH",
        help="write a bar chart of every implementation's time over the GEMM alone, per op "
        "and shape, to this PNG file (needs matplotlib)",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=0,
        help="run as this many processes on this host (jax.distributed), GPUs split evenly",
    )
    ap.add_argument(
        "--gpus-per-process",
        type=int,
        default=1,
        help="with --processes: the GPUs each process drives, process i taking GPUs "
        "[i * G, (i + 1) * G) (default: %(default)s)",
    )
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="with --processes N: every process drives GPU 0, a rank of its own "
        "(jax_ub.share_gpu), so jax_ub's ops run at tp=N on one GPU. The ranks take turns on "
        "the GPU, so times say nothing of speed; jax_ub's host time per call (its handler's, "
        "printed per op) does: a loop of calls is bound by the host where it nears the op's "
        "GPU time",
    )
    # Internal: how --processes and the windowed einsum start their child processes.
    ap.add_argument("--process-id", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    ap.add_argument("--windowed-einsum-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--windowed-einsum-only-first",
        action="store_true",
        help="run XLA's windowed einsum (a process per shape) for the first shape only",
    )
    return ap


GPU_SHAPES = "8192x8192x32768"
CPU_SHAPES = "256x128x256"  # the host protocol's GEMM is a plain loop: small on CPU


def _shapes(ap, args, tp: int, on_cpu: bool) -> list[tuple[int, int, int]]:
    """The shapes to run, checked: a bad one is an argparse error naming it."""
    text = args.shapes or (CPU_SHAPES if on_cpu else GPU_SHAPES)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
        if args.sweep_m:
            _, K, N = shapes[0]
            shapes += [(int(m), K, N) for m in args.sweep_m.split(",")]
    except ValueError:
        ap.error(f"--shapes/--sweep-m: {text!r}, {args.sweep_m!r} is not MxKxN,... / M,...")
    for shape in shapes:
        if len(shape) != 3 or min(shape) <= 0:
            ap.error(f"--shapes: {shape} is not three positive sizes MxKxN")
        M, K, N = shape
        split_ops = set(args.ops.split(",")) - {"ar"}  # ar splits K alone
        if split_ops and (M % tp or N % tp):
            ap.error(f"--shapes: M={M} and N={N} must be multiples of the {tp} devices used")
        if "ar" in args.ops.split(",") and K % tp:
            ap.error(f"--shapes: K={K} must be a multiple of the {tp} devices used (ar)")
    return shapes


def main(argv=None) -> None:
    """``python -m jax_ub.bench``: see ``--help``."""
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.ub_variants)
    except ValueError as e:
        ap.error(f"--ub-variants: {e}")
    dtype = jnp.dtype(args.dtype)
    if args.rounds < 1 or args.iters < 1:
        ap.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    unknown_ops = set(args.ops.split(",")) - set(BUILDERS)
    if unknown_ops:
        ap.error(f"--ops takes {', '.join(BUILDERS)}, got {sorted(unknown_ops)}")
    if "ar" in args.ops.split(",") and (args.fp8 or args.epilogue):
        ap.error("--ops ar has no --fp8 or --epilogue rows")
    if args.epilogue and "ag" not in args.ops.split(","):
        ap.error(f"--epilogue adds the all-gather's (ag) rows: --ops {args.ops} has none")
    if args.windowed_einsum_child:
        shapes = _shapes(ap, args, 1, False)
        _windowed_einsum_child(*shapes[0], dtype, args.rounds, args.iters, args.tp)
        return
    if args.share_gpu and (args.processes < 2 or args.gpus_per_process != 1):
        ap.error(
            "--share-gpu needs --processes >= 2 and one GPU a process; got --processes "
            f"{args.processes}, --gpus-per-process {args.gpus_per_process}"
        )
    if args.processes and args.loop_seconds:
        # Each process would choose its own number of calls, and their collectives must match.
        ap.error("--loop-seconds needs one process (its call counts are chosen per process)")
    if args.processes and args.process_id < 0:
        sys.exit(_launch(args, argv if argv is not None else sys.argv[1:]))
    if args.processes:
        if args.share_gpu:
            share_gpu(args.process_id)
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
        args.no_windowed_einsum = True  # its child process would not join the others
    lead = jax.process_index() == 0
    say = functools.partial(print, flush=True) if lead else (lambda *a, **k: None)
    if not 0 <= args.tp <= len(jax.devices()):
        ap.error(f"--tp must be between 1 and the {len(jax.devices())} devices, got {args.tp}")
    devices = jax.devices()[: args.tp or None]
    mesh = Mesh(np.array(devices), (AXIS,))
    tp = len(devices)
    on_cpu = devices[0].platform == "cpu"
    shapes = _shapes(ap, args, tp, on_cpu)
    say(
        f"devices: {tp} x {devices[0].device_kind} in {jax.process_count()} process(es); "
        f"jax {jax.__version__}; dtype {dtype}"
    )
    if args.share_gpu and not on_cpu:
        say(
            f"{args.processes} ranks share one GPU: times say nothing of speed; jax_ub's host "
            "time per call does"
        )
    if on_cpu:
        args.no_windowed_einsum = True  # an XLA GPU flag
        say(
            "CPU devices: this checks the benchmark and the host protocol, not speed (times "
            "say nothing about GPUs)"
            + ("" if args.shapes else f"; CPU-sized shapes {CPU_SHAPES}")
            + (
                ""
                if tp > 1
                else "; one device: set XLA_FLAGS=--xla_force_host_platform_device_count=4"
            )
        )
    results = []
    for M, K, N in shapes:
        for op in args.ops.split(","):
            say(f"{op.upper()} M={M} K={K} N={N}: compiling and checking ...")
            build = BUILDERS[op]
            impls, ref = build(mesh, M, K, N, dtype, M + K + N, variants, args.fp8, args.epilogue)
            # The epilogue rows compute gelu(x @ w + b): checked against each other below.
            unchecked = UNCHECKED + tuple(EPILOGUE_CHECKS) + tuple(EPILOGUE_CHECKS.values())
            measured = measure(
                impls, ref, args.rounds, args.iters, args.loop_seconds, say, unchecked
            )
            for name, against in EPILOGUE_CHECKS.items():
                if name in impls:
                    (f, a), (g, b) = impls[name], impls[against]
                    measured.errs[name] = rel_err(f(*a), g(*b))
            windowed = (
                op == "ag"
                and not args.no_windowed_einsum
                and ((M, K, N) == shapes[0] or not args.windowed_einsum_only_first)
            )
            if windowed:
                we = windowed_einsum_ms(M, K, N, args.dtype, args.rounds, args.iters, tp)
                if we is not None:
                    measured.times["xla_windowed_einsum"] = we
            row = dict(op=op, M=M, K=K, N=N, tp=tp, dtype=str(dtype))
            results.append(_report(row, measured, args, variants, say))
            if args.json and lead:  # as it goes: a later failure loses nothing
                with open(args.json, "w") as fh:
                    info = dict(device=devices[0].device_kind, tp=tp, processes=jax.process_count())
                    json.dump(dict(**info, results=results), fh, indent=1)
    if args.png and lead:
        _plot(results, args.png, say)


def _report(row: dict, measured, args, variants, say) -> dict:
    """Print one op and shape's table; return its JSON row (`row` completed)."""
    op, M, K, N, tp = row["op"], row["M"], row["K"], row["N"], row["tp"]
    times, errs = measured.times, measured.errs
    t_seq, t_gemm, t_ub = times["xla_seq"], times["gemm"], times["jax_ub"]
    hidden = (t_seq - t_ub) / (t_seq - t_gemm) if t_seq > t_gemm else float("nan")
    row.update(
        times_ms=times,
        spread=measured.spread,
        issued_ms=measured.issued,
        rel_err=errs,
        speedup_vs_xla_seq=t_seq / t_ub,
        ub_over_gemm=t_ub / t_gemm,
        comm_hidden=hidden,
    )
    loops = f"{args.iters} calls"
    if args.loop_seconds:
        loops = f">= {args.loop_seconds:g} s loops ({min(measured.calls.values())}"
        loops += f"-{max(measured.calls.values())} calls)"
        row.update(calls=measured.calls)
    say(
        f"\n{op.upper()} M={M} K={K} N={N} tp={tp}: per-device ms, median of "
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
    # Only meaningful where the unfused op is slower than its GEMM (not on CPU devices).
    shown = f"{100 * hidden:.0f}%" if t_seq > t_gemm and 0 <= hidden <= 2 else "n/a"
    say(f"  jax_ub / gemm = {t_ub / t_gemm:.3f}, comm hidden = {shown}", flush=True)
    for settings in variants:  # an A/B of settings, same rounds
        for base in ("jax_ub", "jax_ub_fp8"):
            name = variant_name(settings, base)
            if name in times and base in times:
                say(f"  {name} / {base} = {times[name] / times[base]:.3f}", flush=True)
    if "jax_ub_fp8" in times and "fp8_gemm" in times:
        row.update(ub_fp8_over_fp8_gemm=times["jax_ub_fp8"] / times["fp8_gemm"])
        t8 = times["jax_ub_fp8"]
        say(
            f"  jax_ub_fp8 / fp8_gemm = {t8 / times['fp8_gemm']:.3f}, "
            f"xla_fp8 / jax_ub_fp8 = {times.get('xla_fp8', float('nan')) / t8:.3f}",
            flush=True,
        )
        if "fp8_nocomm" in times:  # the same quantization in the call, no communication
            t8q = times["jax_ub_fp8_hp"]
            row.update(ub_fp8_hp_over_nocomm=t8q / times["fp8_nocomm"])
            say(f"  jax_ub_fp8_hp / fp8_nocomm = {t8q / times['fp8_nocomm']:.3f}", flush=True)
    if "jax_ub_bias_gelu" in times:
        t_ep = times["jax_ub_bias_gelu"]
        row.update(ub_epilogue_over_ub=t_ep / t_ub, ub_epilogue_over_gemm=t_ep / t_gemm)
        say(
            f"  jax_ub_bias_gelu / jax_ub = {t_ep / t_ub:.3f}, / gemm = {t_ep / t_gemm:.3f}, "
            f"/ gemm_bias_gelu = {t_ep / times['gemm_bias_gelu']:.3f}; "
            f"xla_bias_gelu / jax_ub_bias_gelu = {times['xla_bias_gelu'] / t_ep:.3f}",
            flush=True,
        )
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
    for name, (host_ms, await_ms) in measured.host_ms.items():
        # Host-bound when this approaches the row's device time per call.
        if name == "jax_ub":
            row.update(jax_ub_host_ms=host_ms, jax_ub_host_await_ms=await_ms)
        else:
            row.setdefault("variant_host_ms", {})[name] = [host_ms, await_ms]
        say(
            f"  {name} host time per call and GPU: {host_ms:.3f} ms "
            f"({await_ms:.3f} ms of it waiting for the process's other GPUs)",
            flush=True,
        )
    return row


def _launch(args, argv: list[str]) -> int:
    """Start args.processes copies of this benchmark, each on its own GPUs; wait for all."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    g = args.gpus_per_process
    procs = []
    for i in range(args.processes):
        env = dict(os.environ)
        if not args.share_gpu:  # each its own GPUs (with --share-gpu, share_gpu sets GPU 0)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * g + d) for d in range(g))
        cmd = [sys.executable, "-m", "jax_ub.bench", *argv]
        cmd += ["--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"]
        procs.append(subprocess.Popen(cmd, env=env))
    return max(p.wait() for p in procs)


def _plot(results, path, say) -> None:
    """Per op, every implementation's time over the GEMM alone, per shape."""
    panels = []
    for op in sorted({r["op"] for r in results}):
        rows = [r for r in results if r["op"] == op]
        names = sorted({n for r in rows for n in r["times_ms"]})
        series = {
            n: [r["times_ms"].get(n, np.nan) / r["times_ms"]["gemm"] for r in rows] for n in names
        }
        labels = [f"{r['M']}x{r['K']}x{r['N']}" for r in rows]
        panels.append((f"{op.upper()} on {rows[0]['tp']} GPUs", labels, series))
    bar_chart(path, panels, "time / GEMM alone", say)


if __name__ == "__main__":
    main()
