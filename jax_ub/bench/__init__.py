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

from jax_ub._src.settings import options
from jax_ub.bench.cli import main
from jax_ub.bench.impls import parse_variants

__all__ = ["main", "options", "parse_variants"]
