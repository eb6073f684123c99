"""Kernel time and GPU idle time of back-to-back bf16 GEMM calls on one GPU: jax_ub's own
GEMM (an op on a group of one), XLA's dot and torch.mm (cuBLAS's heuristic pick). Tells a
slower kernel from a host that cannot keep the GPU busy: a loop of async calls is
host-bound where the median gap between kernels grows, or single gaps reach a kernel's
length. A device investigation tool, not part of the library.

Per shape and round, each in turn (in an order shuffled by the round): a loop of at least
``--seconds`` (ms per call, as the benchmarks time calls); after every round, each one's 20
calls enqueued back to back with one sync at the end, their kernels read through CUPTI
(torch's profiler, which sees JAX's kernels too): their names, launches (grid, block, shared
memory, registers), median time and the gaps between them. Equal kernels and unequal loops point
at the host; unequal kernel times at the kernel's choice, or, under one name, at its launch.

python benchmarks/tools/gemm_gaps.py --shapes 8192x3584x4096,8192x4096x1536
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gemm_sources import jax_loop, loop_ms, own_gemm  # noqa: E402  (this folder, on the path as the script runs)

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


def launch_configs(prof) -> list[str]:
    """The GEMM kernels' launches in a profile (its trace's kernel records: grid, block,
    shared memory, registers): one kernel by name can run with another configuration."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    configs = set()
    for e in events:
        name, a = e.get("name", ""), e.get("args", {})
        if e.get("cat") == "kernel" and ("gemm" in name or "nvjet" in name):
            configs.add(
                f"grid {a.get('grid')} block {a.get('block')} smem {a.get('shared memory')} "
                f"regs {a.get('registers per thread')}"
            )
    return sorted(configs)


def kernels(step, sync) -> str:
    """20 calls back to back under CUPTI: the GEMM kernels' names, launch configurations,
    median time and the gaps between them, and the other kernels the calls ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        sync()
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
        f"{len(ks)} kernels, median {kernel_us:.1f} us, gaps median {np.median(gaps):.1f} max "
        f"{np.max(gaps):.1f} us | {' '.join(names)} | {'; '.join(launch_configs(prof))}"
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
        impls = implementations(ub, dot, shape)
        # Every loop of the shape before its profiles: none runs just after CUPTI's.
        for r in range(args.rounds):
            for name in round_order(impls, r):
                print(f"{shape} round {r} {name:8s} loop {loop_ms(*impls[name], args.seconds):.3f} "
                      "ms", flush=True)  # fmt: skip
        for name, (step, sync) in impls.items():
            print(f"{shape} kernels {name:8s} {kernels(step, sync)}", flush=True)


def implementations(ub, dot, shape: str) -> dict:
    """name -> (step, sync) of each implementation at ``shape`` (``MxKxN``), as loop_ms takes
    them, each past its compilation and jax_ub's kernel trials."""
    m, k, n = map(int, shape.split("x"))
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16) * 0.01
    ta = torch.from_numpy(np.array(a.astype(jnp.float32))).cuda().bfloat16()
    tb = torch.from_numpy(np.array(b.astype(jnp.float32))).cuda().bfloat16()
    impls = {
        "jax_ub": jax_loop(ub, a, b),
        "xla_dot": jax_loop(dot, a, b),
        "torch": (lambda: torch.mm(ta, tb), torch.cuda.synchronize),
    }
    for _ in range(30):
        for step, sync in impls.values():
            step()
            sync()
    return impls


if __name__ == "__main__":
    main()
