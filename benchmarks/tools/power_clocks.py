"""SM clock and power while each implementation runs a long loop, per GPU.

python benchmarks/tools/power_clocks.py --tp 2 --shape 32768x8192x32768 [--op ag|rs] [--seconds 3]

An H200 running GEMMs back to back sits at its power limit and lowers its clock. A loop
that pauses for communication (XLA's all-gather then dot) lets the clock recover between
GEMMs; an overlapped loop never pauses and adds the copies' power. This prints, for GEMM
alone, XLA's sequential op and jax_ub: the loop's ms per call and, sampled by nvidia-smi
every 100 ms while it ran, the mean SM clock, power draw and how often the power cap or a
thermal limit was throttling. Used to tell a slower kernel from a slower clock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ub.bench.impls import build_ag, build_rs
from jax_ub.bench.timing import calls_lasting, loop_time_ms

_QUERY = ",".join(
    [
        "index",
        "clocks.sm",
        "power.draw",
        "clocks_event_reasons.sw_power_cap",
        "clocks_event_reasons.hw_slowdown",
        "clocks_event_reasons.sw_thermal_slowdown",
    ]
)


def _sample(command: list[str], f, args, iters: int) -> tuple[float, list[list[str]]]:
    """loop_time_ms(f, args, iters) while nvidia-smi samples; its rows, split."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # let nvidia-smi start sampling before the loop
    ms = loop_time_ms(f, args, iters)
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    rows = [[v.strip() for v in line.split(",")] for line in out.splitlines() if line.strip()]
    return ms, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=0)
    ap.add_argument("--shape", default="32768x8192x32768")
    ap.add_argument("--op", choices=("ag", "rs"), default="ag")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    M, K, N = (int(v) for v in args.shape.split("x"))
    devices = jax.devices()[: args.tp or None]
    mesh = Mesh(np.array(devices), ("tp",))
    build = build_ag if args.op == "ag" else build_rs
    impls, _ = build(mesh, M, K, N, jax.numpy.bfloat16, 0)
    names = [n for n in ("gemm", "xla_seq", "jax_ub") if n in impls]
    ids = ",".join(str(d.local_hardware_id) for d in devices)
    command = [
        "nvidia-smi",
        f"--id={ids}",
        f"--query-gpu={_QUERY}",
        "--format=csv,noheader,nounits",
        "-lms",
        "100",
    ]
    calls = {n: calls_lasting(*impls[n], args.seconds, 10) for n in names}
    print(
        f"{args.op.upper()} M={M} K={K} N={N} tp={len(devices)}: each loop ~{args.seconds} s, "
        "nvidia-smi every 100 ms"
    )
    print(f"  {'impl':8} {'ms/call':>8} {'SM MHz':>7} {'W':>6} {'power cap':>9} {'thermal':>7}")
    for r in range(args.rounds):
        for name in names:
            ms, rows = _sample(command, *impls[name], calls[name])
            rows = [row for row in rows if len(row) == 6 and row[1].replace(".", "").isdigit()]
            if not rows:
                print(f"  {name:8} {ms:8.3f}  (no nvidia-smi samples)")
                continue
            mhz = statistics.mean(float(row[1]) for row in rows)
            watts = statistics.mean(float(row[2]) for row in rows)
            cap = sum(row[3] == "Active" for row in rows) / len(rows)
            thermal = sum("Active" in (row[4], row[5]) for row in rows) / len(rows)
            print(
                f"  {name:8} {ms:8.3f} {mhz:7.0f} {watts:6.0f} {cap:9.0%} {thermal:7.0%}"
                f"   (round {r}, {len(rows)} samples)",
                flush=True,
            )


if __name__ == "__main__":
    main()
