"""Where a Llama step's time goes, by sublayer: the attention sublayer (RMSNorm, GQA with
rotary embeddings, projections) and the gated-MLP sublayer of one block
(jax_ub.bench.llama), each alone, forward and backward (jit of its VJP), with jax_ub's
ops, with XLA's collectives, and with the no-communication bound (the model bench's
``bound_ops``). Interleaved rounds, loop averages, medians; ratios to the bound.

    python3 benchmarks/tools/llama_block_parts.py --seq 8192 --batch 1   # GPUs
    python3 benchmarks/tools/llama_block_parts.py --preset tiny --seq 64  # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf
from jax_ub.bench import llama
from jax_ub.bench.model import bound_ops


def sublayer(kind: str, cfg, impl: str, dtype, seq_axis: int) -> nnx.Module:
    """The block's attention or gated MLP, params in ``dtype``."""
    common = dict(impl=impl, seq_axis=seq_axis, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    if kind == "attention":
        return ubf.ParallelSelfAttention(
            cfg.hidden,
            cfg.heads,
            num_kv_heads=cfg.kv_heads,
            rope_theta=cfg.rope_theta,
            use_bias=False,
            **common,
        )
    return ubf.ParallelGatedMLP(cfg.hidden, cfg.ffn, **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(llama.PRESETS))
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--seq-major",
        action="store_true",
        help="activations [seq, batch, hidden] (default: batch-major, as the model)",
    )
    args = ap.parse_args()
    cfg = llama.PRESETS[args.preset]
    dtype = jnp.bfloat16
    mesh = Mesh(np.array(jax.devices()[: args.tp]).reshape(1, args.tp), ("dp", "tp"))
    keys = jax.random.split(jax.random.key(0), 2)
    seq_axis = 0 if args.seq_major else 1
    shape = (
        (args.seq, args.batch, cfg.hidden) if args.seq_major else (args.batch, args.seq, cfg.hidden)
    )
    spec = P("tp", "dp") if args.seq_major else P("dp", "tp")
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(keys[0], shape, dtype), NamedSharding(mesh, spec))
        ct = jax.device_put(jax.random.normal(keys[1], shape, dtype), NamedSharding(mesh, spec))
    runs, outputs = {}, {}
    for kind in ("attention", "mlp"):
        for variant in ("ub", "xla", "bound"):
            with jax.set_mesh(mesh):
                impl = "xla" if variant == "xla" else "ub"
                module = sublayer(kind, cfg, impl, dtype, seq_axis)
                graphdef, params = nnx.split(module)

                def step(params, x, ct, graphdef=graphdef, kind=kind):
                    def apply(params, x):
                        layer = nnx.merge(graphdef, params)
                        return layer(x, is_causal=True) if kind == "attention" else layer(x)

                    y, vjp = jax.vjp(apply, params, x)
                    return y, vjp(ct)

                bound = bound_ops() if variant == "bound" else contextlib.nullcontext()
                with bound:
                    compiled = jax.jit(step).lower(params, x, ct).compile()
                y, _ = compiled(params, x, ct)
                outputs[kind, variant] = np.asarray(y, np.float32)
            runs[kind, variant] = (compiled, params)
    for kind in ("attention", "mlp"):
        ref = outputs[kind, "xla"]
        err = np.linalg.norm(outputs[kind, "ub"] - ref) / np.linalg.norm(ref)
        print(f"{kind}: jax_ub vs XLA output, relative error {err:.2e}", flush=True)
    times: dict = {k: [] for k in runs}
    cpu = jax.devices()[0].platform == "cpu"
    for _ in range(args.rounds):
        for k, (compiled, params) in runs.items():
            jax.block_until_ready(compiled(params, x, ct))
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = compiled(params, x, ct)
                if cpu:  # XLA's CPU runtime may interleave two programs' calls
                    jax.block_until_ready(out)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / args.iters * 1e3)
    print(
        f"{args.preset} sublayers, seq {args.seq}, batch {args.batch}, tp {args.tp}, bf16, "
        f"{'seq' if args.seq_major else 'batch'}-major, forward+backward, "
        f"{jax.devices()[0].device_kind}; median of {args.rounds} rounds"
    )
    for kind in ("attention", "mlp"):
        bound = statistics.median(times[kind, "bound"])
        for variant in ("ub", "xla", "bound"):
            t = times[kind, variant]
            ms = statistics.median(t)
            spread = (max(t) - min(t)) / ms
            print(
                f"  {kind:9s} {variant:5s} {ms:8.3f} ms (spread {100 * spread:4.1f}%) "
                f"{ms / bound:6.3f}x bound"
            )


if __name__ == "__main__":
    main()
