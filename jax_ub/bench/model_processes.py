"""The model benchmark's variants timed in processes of their own (``python -m
jax_ub.bench.model``): a process runs the benchmark with ``--child`` and prints its results
as one JSON line; several such processes' results combine into one table."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


def run_child(variants: list[str], argv: list[str], say, xla_flags: str = "") -> dict:
    """`variants` timed in a process of their own (with `xla_flags` added to XLA_FLAGS),
    the same arguments otherwise: their results, {} if it failed. Its progress lines pass
    through as it runs."""
    env = dict(os.environ)
    if xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    # As JSON: a --ub-variants variant's name holds commas.
    cmd = [sys.executable, "-m", "jax_ub.bench.model", *argv, "--child", json.dumps(variants)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("MODEL_RESULT "):
            return json.loads(line[len("MODEL_RESULT ") :])
    say(f"  {','.join(variants)}: the process failed (rc={done.returncode}; its errors above)")
    return {}


def over_processes(per_process: list[dict], say) -> dict:
    """The results of several processes as one: per variant the median over the processes
    of their step times, `spread` across those medians, `per_process_ms` each one's, the
    rest the first process's. Prints each process's times and ratios to the bound."""
    ran = [r for r in per_process if r]
    for i, r in enumerate(per_process):
        bound = r.get("bound", {}).get("step_ms")
        cells = [
            f"{v} {x['step_ms']:.2f} ms"
            + (f" ({x['step_ms'] / bound:.3f}x the bound)" if bound and v != "bound" else "")
            for v, x in r.items()
            if not v.startswith("_")
        ]
        say(f"  process {i + 1}: " + (", ".join(cells) if cells else "failed"))
    if not ran:
        return {}
    combined = {}
    for v in (v for v in ran[0] if not v.startswith("_")):
        ms = [r[v]["step_ms"] for r in ran]
        median = statistics.median(ms)
        spread = (max(ms) - min(ms)) / median
        combined[v] = ran[0][v] | {"step_ms": median, "spread": spread, "per_process_ms": ms}
    return combined | {"_processes": len(ran)}
