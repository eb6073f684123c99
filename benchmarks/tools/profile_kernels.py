"""Which GPU kernels an implementation runs, and for how long (no nsys needed).

python benchmarks/tools/profile_kernels.py --tp 2 --shape 2048x8192x32768 [--op ag|rs] [--out DIR]

Traces a few calls of GEMM alone, XLA's all-gather-then-dot and jax_ub with JAX's profiler
(CUPTI; a Perfetto trace), then prints per implementation the kernels on the devices:
count per call, average duration, and name. Used to see whether a gap between jax_ub and
GEMM alone is the GEMM kernel itself or time between kernels.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import math
import os
import tempfile

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ub.bench.impls import build_ag, build_rs


@functools.cache  # each report reads the same trace several ways: parse it once
def trace_events(trace_dir: str) -> list[dict]:
    """Every event of the trace (host and device). Cached per folder: do not change it."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as fh:
        return json.load(fh)["traceEvents"]


@functools.cache
def device_events(trace_dir: str) -> list[dict]:
    """Every device event (kernel, copy) in the trace, in order; `pid` names the GPU.
    Cached per folder: callers must not change the list."""
    events = trace_events(trace_dir)
    # Device streams are the processes whose name starts with /device:GPU.
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "/device:GPU" in e.get("args", {}).get("name", "")
    }
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def kernels(trace_dir: str) -> list[tuple[str, float]]:
    """(name, microseconds) of every device event in the trace, in order."""
    return [(e["name"], float(e["dur"])) for e in device_events(trace_dir)]


def _intervals(trace_dir: str, exclude: str) -> dict[int, list[tuple[float, float, str]]]:
    """Per GPU: (start, end, name) of its device events, sorted, leaving out those whose
    name contains `exclude` (case-insensitive)."""
    per_gpu: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        if exclude and exclude in e["name"].lower():
            continue
        start = float(e["ts"])
        per_gpu[e["pid"]].append((start, start + float(e["dur"]), e["name"]))
    for iv in per_gpu.values():
        iv.sort()
    return per_gpu


def busy_and_span(trace_dir: str, exclude: str = "memcpy") -> dict[int, tuple[float, float]]:
    """Per GPU: (microseconds in which some kernel ran, first start to last end).

    Kernels on all streams count once where they overlap; events whose name contains
    `exclude` (copy-engine transfers by default) do not count as busy.
    """
    out = {}
    for pid, iv in _intervals(trace_dir, exclude).items():
        busy, end = 0.0, -math.inf
        for a, b, _ in iv:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out[pid] = (busy, max(b for _, b, _ in iv) - iv[0][0])
    return out


def idle_gaps(
    trace_dir: str, min_us: float = 5.0, exclude: str = "memcpy"
) -> dict[int, list[tuple[float, str, str]]]:
    """Per GPU: every stretch of at least `min_us` in which no kernel ran, as
    (microseconds, the kernel that ended last before it, the kernel that started it).

    Copy-engine transfers (`exclude`) do not count as running, as in `busy_and_span`.
    """
    out: dict[int, list[tuple[float, str, str]]] = {}
    for pid, iv in _intervals(trace_dir, exclude).items():
        gaps = []
        end, last = iv[0][1], iv[0][2]
        for a, b, name in iv[1:]:
            if a - end >= min_us:
                gaps.append((a - end, last, name))
            if b > end:
                end, last = b, name
        out[pid] = gaps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shape", default="2048x8192x32768")
    ap.add_argument("--op", default="ag", choices=["ag", "rs"])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    M, K, N = (int(v) for v in args.shape.split("x"))
    mesh = Mesh(np.array(jax.devices()[: args.tp]), ("tp",))
    build = build_ag if args.op == "ag" else build_rs
    impls, _ = build(mesh, M, K, N, jax.numpy.bfloat16, 0)
    for name in ("gemm", "xla_seq", "jax_ub"):
        f, fargs = impls[name]
        jax.block_until_ready(f(*fargs))  # compile and warm up (and autotune) outside
        jax.block_until_ready(f(*fargs))
        trace_dir = tempfile.mkdtemp(dir=args.out or None, prefix=f"trace_{name}_")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.calls):
                out = f(*fargs)
            jax.block_until_ready(out)
        ks = kernels(trace_dir)
        per = collections.defaultdict(list)
        for kname, us in ks:
            per[kname].append(us)
        ndev = args.tp
        total = sum(us for _, us in ks) / args.calls / ndev
        print(f"\n{name}: {total:.1f} us of device events per call per GPU")
        for kname, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(
                f"  {len(v) / args.calls / ndev:5.2f}/call  avg {np.mean(v):8.1f} us  {kname[:100]}"
            )
        # Where the time between kernels goes: busy vs span, and the idle stretches grouped
        # by the kernels on either side (copy-engine transfers do not count as running).
        spans = busy_and_span(trace_dir)
        busy = np.mean([b for b, _ in spans.values()]) / args.calls
        span = np.mean([t for _, t in spans.values()]) / args.calls
        print(f"  per call and GPU: span {span:.1f} us, some kernel running {busy:.1f} us")
        grouped = collections.defaultdict(list)
        for gaps in idle_gaps(trace_dir, min_us=2.0).values():
            for us, before, after in gaps:
                grouped[(before[:40], after[:40])].append(us)
        for (before, after), v in sorted(grouped.items(), key=lambda kv: -sum(kv[1]))[:6]:
            per_call = sum(v) / args.calls / ndev
            count = len(v) / args.calls / ndev
            print(f"  idle {per_call:7.1f} us/call ({count:4.2f}x)  after {before}  before {after}")


if __name__ == "__main__":
    main()
