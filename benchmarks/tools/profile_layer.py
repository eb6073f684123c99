"""Where the layer benchmark's time goes on the GPUs: jax_ub, XLA and the bound, per HLO op.

python benchmarks/tools/profile_layer.py --size 8192x28672x8192 [--pass fwd+bwd] [--calls 4]
    [--variants bound,xla,jax_ub] [--out DIR]

Builds `jax_ub.bench.layer`'s layer for each variant, traces a few calls with JAX's
profiler (CUPTI, no nsys) and prints, per variant and per call and GPU:

* the span of a call, how much of it some kernel ran (copy-engine transfers excluded) and
  the idle rest: idle time on the GPU is waiting (a flag, a peer, the host);
* kernel time by kind (GEMM, attention, NCCL, copies, jax_ub's own kernels, other fusions);
* one call's ops in order on the first GPU: each HLO op's start, its wall time (first
  kernel start to last kernel end, all streams) and the sum of its GEMM kernels; for a
  jax_ub custom call the wall time over its GEMMs is what the overlap costs, for XLA's
  collectives the wall time is what they expose.

Kernels are tied to their HLO op by the `hlo_op` the profiler records on device events
(where it records none the kernel name stands in).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from profile_kernels import busy_and_span, device_events
from profile_train_step import KINDS, kind_of

from jax_ub.bench.impls import AXIS
from jax_ub.bench.layer import build, layer_inputs


def op_of(event: dict) -> str:
    """The HLO op a device event belongs to (its kernel name where none is recorded)."""
    args = event.get("args", {})
    return str(args.get("hlo_op") or args.get("long_name") or event["name"])


def calls_of(events: list[dict], calls: int) -> list[list[dict]]:
    """The first GPU's events in time order, cut into `calls` equal runs (every call of
    one jitted function runs the same kernels)."""
    first_gpu = min(e["pid"] for e in events)
    mine = sorted((e for e in events if e["pid"] == first_gpu), key=lambda e: float(e["ts"]))
    n = len(mine) // calls
    return [mine[i * n : (i + 1) * n] for i in range(calls)]


def _union(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the intervals."""
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def op_timeline(call: list[dict]) -> list[tuple[str, float, float, float, float, int]]:
    """One call's ops in order of first kernel: (op, start us from the call's start, wall
    us, us in which one of its kernels ran (copies excluded), GEMM kernel us, kernels).
    An op whose kernels are not consecutive (another op's ran between) gets a row per
    run."""
    t0 = float(call[0]["ts"])
    rows: list[list] = []
    for e in call:
        op, a = op_of(e), float(e["ts"])
        b = a + float(e["dur"])
        if not rows or rows[-1][0] != op:
            rows.append([op, a - t0, a, b, [], 0.0, 0])
        row = rows[-1]
        row[2], row[3], row[6] = min(row[2], a), max(row[3], b), row[6] + 1
        if kind_of(e["name"]) != "peer copy":
            row[4].append((a, b))
        if kind_of(e["name"]) == "GEMM":
            row[5] += b - a
    return [
        (op, rel, end - start, _union(iv), gemm, n) for op, rel, start, end, iv, gemm, n in rows
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8192x28672x8192", help="HIDDENxFFNxSEQ")
    ap.add_argument("--pass", dest="which", default="fwd+bwd", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--variants", default="bound,xla,jax_ub")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tp", type=int, default=0)
    ap.add_argument("--min-us", type=float, default=20.0, help="timeline: leave out shorter ops")
    ap.add_argument(
        "--command-buffers",
        action="store_true",
        help="keep XLA's CUDA graphs (default: off, so that every kernel names its own op)",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.command_buffers:  # read when the GPU backend starts, which is below
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
        )
    hidden, ffn, seq = (int(v) for v in args.size.split("x"))
    devices = jax.devices()[: args.tp or None]
    mesh = Mesh(np.array(devices), (AXIS,))
    x, params, dy = layer_inputs(mesh, hidden, ffn, seq, 1, jnp.bfloat16, 0)
    ndev = len(devices)
    print(f"{ndev} x {devices[0].device_kind}, layer {args.size} {args.which}, {args.calls} calls")
    for variant in args.variants.split(","):
        fwd, fwd_bwd = build(mesh, variant, args.head_dim)
        f, fargs = (fwd, (x, params)) if args.which == "fwd" else (fwd_bwd, (x, params, dy))
        for _ in range(3):  # compile, autotune, and reach a steady clock outside the trace
            jax.block_until_ready(f(*fargs))
        trace_dir = tempfile.mkdtemp(dir=args.out or None, prefix=f"trace_layer_{variant}_")
        with jax.profiler.trace(trace_dir):
            for _ in range(args.calls):
                out = f(*fargs)
            jax.block_until_ready(out)
        events = device_events(trace_dir)
        if not events:
            print(f"\n== {variant}: no GPU events in the trace (CPU devices?)")
            continue
        scale = 1e-3 / args.calls  # us -> ms per call
        print(f"\n== {variant}")
        for gpu, (busy, span) in sorted(busy_and_span(trace_dir).items()):
            print(
                f"  GPU {gpu}: span {span * scale:.3f} ms/call, kernels running "
                f"{busy * scale:.3f}, idle {(span - busy) * scale:.3f}"
            )
        per_kind: dict[str, float] = collections.defaultdict(float)
        for e in events:
            per_kind[kind_of(e["name"])] += float(e["dur"])
        print("  " + ", ".join(f"{k} {per_kind[k] * scale / ndev:.3f}" for k, _ in KINDS))
        head = f"{'start':>8s} {'wall':>7s} {'busy':>7s} {'GEMMs':>7s} {'k':>4s}"
        print(f"  first GPU, call 2 (us): {head}  op, wall/GEMMs")
        calls = calls_of(events, args.calls)
        call = calls[min(1, len(calls) - 1)]
        for op, rel, wall, busy, gemm, n in op_timeline(call):
            if wall >= args.min_us:
                over = f"  x{wall / gemm:.3f}" if gemm > 0 else ""
                print(f"  {rel:32.0f} {wall:7.0f} {busy:7.0f} {gemm:7.0f} {n:4d}  {op[:60]}{over}")
        print(f"  (event args of one kernel: {sorted(events[0].get('args', {}))})")


if __name__ == "__main__":
    main()
