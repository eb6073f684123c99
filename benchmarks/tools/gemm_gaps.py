"""Kernel time and GPU idle time of back-to-back bf16 GEMM calls on one GPU: jax_ub's own
GEMM (an op on a group of one), XLA's dot and torch.mm (cuBLAS's heuristic pick). Tells a
slower kernel from a host that cannot keep the GPU busy: a loop of async calls is
host-bound where the median gap between kernels grows, or single gaps reach a kernel's
length. A device investigation tool, not part of the library.

Per shape and round, each in turn (in an order shuffled by the round): a loop of at least
``--seconds`` (ms per call, as the benchmarks time calls), then 20 calls enqueued back to
back with one sync at the end, their kernels read through CUPTI (torch's profiler, which
sees JAX's kernels too): their names, mean time and the gaps between them. Equal kernels
and unequal loops point at the host; unequal kernel times at the kernel's choice.

python benchmarks/tools/gemm_gaps.py --shapes 8192x3584x4096,8192x4096x1536
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gemm_sources import own_gemm  # noqa: E402  (this folder, on the path as the script runs)

from jax_ub.bench.timing import round_order  # noqa: E402


def gemm_kernels(prof) -> list[tuple[float, float, str]]:
    """(start, end) in us and name of the GEMM kernels a torch profile recorded, in time
    order."""
    cuda = torch.autograd.DeviceType.CUDA
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == cuda and ("gemm" in e.name or "nvjet" in e.name)
    )


def measure(call, sync, seconds: float) -> str:
    """One implementation's loop time, then its kernels' time and the gaps between them."""
    start, calls, out = time.perf_counter(), 0, None
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            out = call()
        sync(out)
        calls += 10
    loop_ms = 1e3 * (time.perf_counter() - start) / calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            out = call()
        sync(out)
    ks = gemm_kernels(prof)
    cuda = torch.autograd.DeviceType.CUDA
    gemm_names = {name for _, _, name in ks}
    others = sorted(
        {e.name[:40] for e in prof.events() if e.device_type == cuda and e.name not in gemm_names}
    )
    kernel_us = np.median([end - begin for begin, end, _ in ks])
    gaps = [ks[i + 1][0] - ks[i][1] for i in range(len(ks) - 1)]
    names = sorted({name[:60] for _, _, name in ks})
    return (
        f"loop {loop_ms:.3f} ms | {len(ks)} kernels, median {kernel_us:.1f} us, gaps median "
        f"{np.median(gaps):.1f} max {np.max(gaps):.1f} us | {' '.join(names)}"
        + (f" | also: {', '.join(others)}" if others else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x3584x4096,8192x4096x1536", help="MxKxN,...")
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ub = own_gemm()
    dot = jax.jit(lambda a, b: a @ b)
    for shape in args.shapes.split(","):
        for r in range(args.rounds):
            for name, line in compare(ub, dot, shape, args.seconds, r == 0, r):
                print(f"{shape} round {r} {name:8s} {line}", flush=True)


def compare(ub, dot, shape: str, seconds: float, warm: bool, order_seed: int):
    """(name, measure's line) of each implementation at ``shape`` (``MxKxN``)."""
    m, k, n = map(int, shape.split("x"))
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16) * 0.01
    ta = torch.from_numpy(np.array(a.astype(jnp.float32))).cuda().bfloat16()
    tb = torch.from_numpy(np.array(b.astype(jnp.float32))).cuda().bfloat16()
    impls = {
        "jax_ub": (lambda: ub(a, b), lambda r: r.block_until_ready()),
        "xla_dot": (lambda: dot(a, b), lambda r: r.block_until_ready()),
        "torch": (lambda: torch.mm(ta, tb), lambda r: torch.cuda.synchronize()),
    }
    for _ in range(30 if warm else 0):  # compiled, past jax_ub's kernel trials
        for call, sync in impls.values():
            sync(call())
    order = round_order(impls, order_seed)
    return [(name, measure(*impls[name], seconds)) for name in order]


if __name__ == "__main__":
    main()
