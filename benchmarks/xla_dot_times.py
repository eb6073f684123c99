"""XLA's own dot on one GPU for row-major bf16 shapes, as loop averages of async calls.

The counterpart of gemm_candidates.cu: what XLA's autotuned GEMM takes at a chunk shape.
Usage: python benchmarks/xla_dot_times.py m,k,n [m,k,n ...]
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp

from jax_ub.bench import loop_time_ms


def main(shapes: list[str]) -> None:
    dot = jax.jit(lambda a, b: a @ b)
    for spec in shapes:
        m, k, n = (int(v) for v in spec.split(","))
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.bfloat16) * 0.01
        rounds = [loop_time_ms(dot, (a, b), 20) for _ in range(3)]
        ms = statistics.median(rounds)
        print(f"xla dot m={m} k={k} n={n}: {ms:.4f} ms {2 * m * k * n / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main(sys.argv[1:])
