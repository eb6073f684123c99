"""Which BLAS path and kernel a bf16 GEMM gets from XLA, torch's cuBLAS and cuBLASLt
backends and jax_ub (a group of one GPU), at one shape, timed in interleaved loops on one
GPU. A device investigation tool, not part of the library: used to see why jax_ub's own
GEMM ran about 2% slower than XLA's dot at some shapes.

python benchmarks/tools/gemm_sources.py --shape 8192x8192x28672 [--seconds 1 --rounds 3]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ub.bench.timing import round_order  # noqa: E402


def xla_gemm_calls(f, *args) -> list[str]:
    """The compiled HLO's GEMM custom calls: target and backend config (shortened)."""
    text = f.lower(*args).compile().as_text()
    calls = []
    for line in text.splitlines():
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if m and ("gemm" in m.group(1) or "matmul" in m.group(1) or "jax_ub" in m.group(1)):
            config = re.search(r"backend_config=(\{.*\})", line)
            calls.append(f"{m.group(1)} {config.group(1)[:600] if config else ''}")
    return calls


def own_gemm(impl: str = "ub", **op_kwargs):
    """jax_ub's own GEMM, jitted: all_gather_matmul on a group of one GPU, ``a @ b``
    (``impl="xla"``: XLA's dot of the same call; ``op_kwargs``: the op's, e.g. ``fp8``)."""
    import jax_ub  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    return jax.jit(
        jax.shard_map(
            lambda a, b: jax_ub.all_gather_matmul(a, b, "tp", impl=impl, **op_kwargs),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )


def loop_ms(step, sync, seconds: float, block_s: float = 0.03) -> float:
    """ms per call of `step` run back to back for at least `seconds`, in blocks of calls that
    keep the GPU busy for at least `block_s` each before one sync. Each sync drains the GPU,
    and the next block's first call then waits for its dispatch (JAX's program dispatch takes
    much longer than torch's single launch): short blocks time that latency as GEMM time."""
    step()
    sync()
    per_block, calls, start = 10, 0, time.perf_counter()
    while True:
        began = time.perf_counter()
        for _ in range(per_block):
            step()
        sync()
        calls += per_block
        now = time.perf_counter()
        if now - start >= seconds:
            return 1e3 * (now - start) / calls
        per_block = max(per_block, math.ceil(per_block * block_s / max(now - began, 1e-6)))


def jax_loop(f, *args):
    """(step, sync) for loop_ms: step calls jitted ``f`` without waiting, sync waits for the
    last call's outputs and lets them go: the loops of one table row take turns, and each
    one's last outputs kept (an 8B gate/up row's fwd+bwd: 6 GB) ran an H100's share (0.4 of
    80 GB) out of memory."""
    last: list = []

    def step():
        last[:] = [f(*args)]

    def sync():
        jax.block_until_ready(last)
        last.clear()

    return step, sync


@jax.jit
def _rel_err(got, want):
    """||got - want|| / ||want|| in float32, on the arrays' device: a big row's outputs are
    gigabytes, too many to fetch and sum on the host."""
    got, want = got.astype(jnp.float32).ravel(), want.astype(jnp.float32).ravel()
    return jnp.linalg.norm(got - want) / jnp.linalg.norm(want)


def check_close(what: str, got, want, most: float = 2e-2) -> None:
    """jax_ub's outputs against XLA's on the same random data (relative Frobenius error per
    leaf): a timing of wrong numbers is no result."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        err = float(_rel_err(g, w))
        if not err <= most:  # NaN fails too
            raise AssertionError(f"{what}: jax_ub's output is off XLA's by {err:.3g} (> {most})")


def torch_kernels(step) -> list[str]:
    import torch  # noqa: PLC0415

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if "gemm" in e.key or "nvjet" in e.key})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x8192x28672", help="MxKxN")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    m, k, n = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.01, jnp.bfloat16)
    dot = jax.jit(lambda a, b: a @ b)
    print("XLA:", *xla_gemm_calls(dot, a, b), sep="\n  ")

    ub = own_gemm()
    for _ in range(20):  # past the op's kernel trials
        ub(a, b).block_until_ready()

    import torch  # noqa: PLC0415

    ta = torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda().bfloat16()
    tb = torch.from_numpy(np.asarray(b.astype(jnp.float32))).cuda().bfloat16()

    def torch_step(lib):
        def step():
            torch.backends.cuda.preferred_blas_library(lib)
            return torch.mm(ta, tb)

        return step

    impls = {
        "xla_dot": jax_loop(dot, a, b),
        "jax_ub": jax_loop(ub, a, b),
        "torch_cublas": (torch_step("cublas"), torch.cuda.synchronize),
        "torch_cublaslt": (torch_step("cublaslt"), torch.cuda.synchronize),
    }
    for name in ("torch_cublas", "torch_cublaslt"):
        print(f"{name} kernels:", *torch_kernels(impls[name][0]), sep="\n  ")
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(args.rounds):
        for name in round_order(impls, r):
            times[name].append(loop_ms(*impls[name], args.seconds))
    base = statistics.median(times["xla_dot"])
    print(f"\n{args.shape}: median of {args.rounds} rounds of >= {args.seconds} s loops, ms")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) / med
        print(f"  {name:16s} {med:8.3f}  x{med / base:.3f} of xla_dot  spread {100 * spread:.1f}%")


if __name__ == "__main__":
    main()
