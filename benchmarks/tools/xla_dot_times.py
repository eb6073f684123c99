"""XLA's own dot on one GPU for row-major bf16 shapes, as loop averages of async calls.

The counterpart of gemm_candidates.cu and overlap_cost.cu: what XLA's autotuned GEMM
takes at a shape. With --loop-seconds, each timed loop lasts at least that long, so the
GPU runs at the clock its power cap allows (what a training loop sees).
Usage: python benchmarks/tools/xla_dot_times.py [--loop-seconds S] m,k,n [m,k,n ...]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from jax_ub.bench.timing import calls_lasting, loop_time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="m,k,n")
    parser.add_argument("--loop-seconds", type=float, default=0.0)
    args = parser.parse_args()
    dot = jax.jit(lambda a, b: a @ b)
    for spec in args.shapes:
        m, k, n = (int(v) for v in spec.split(","))
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.bfloat16) * 0.01
        iters = calls_lasting(dot, (a, b), args.loop_seconds, 20)
        rounds = [loop_time_ms(dot, (a, b), iters) for _ in range(3)]
        ms = statistics.median(rounds)
        print(
            f"xla dot m={m} k={k} n={n}: {ms:.4f} ms {2 * m * k * n / ms / 1e9:.1f} TFLOP/s"
            f" ({iters} calls a loop, rounds {min(rounds):.4f}..{max(rounds):.4f})"
        )


if __name__ == "__main__":
    main()
