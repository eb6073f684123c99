"""Where a Llama step's time goes, by sublayer: the attention sublayer (RMSNorm, GQA with
rotary embeddings, projections) and the gated-MLP sublayer of one block
(jax_ub.models.llama), each alone, forward and backward (jit of its VJP), with jax_ub's
ops, with XLA's collectives, and with the no-communication bound (``impl="none"``), timed
as the op benchmark times (``jax_ub.bench.timing.measure``: interleaved rounds, loop
averages, medians); ratios to the bound.

    python3 benchmarks/tools/llama_block_parts.py --seq 8192 --batch 1   # GPUs
    python3 benchmarks/tools/llama_block_parts.py --preset tiny --seq 64  # CPU check
"""

from __future__ import annotations

import argparse
import os

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
from jax_ub.bench.timing import measure
from jax_ub.models import llama


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
    print(
        f"{args.preset} sublayers, seq {args.seq}, batch {args.batch}, tp {args.tp}, bf16, "
        f"{'seq' if args.seq_major else 'batch'}-major, forward+backward, "
        f"{jax.devices()[0].device_kind}; median of {args.rounds} rounds"
    )
    for kind in ("attention", "mlp"):
        runs = {}
        for variant in ("jax_ub", "xla", "bound"):
            with jax.set_mesh(mesh):
                impl = {"xla": "xla", "bound": "none"}.get(variant, "ub")
                graphdef, params = nnx.split(sublayer(kind, cfg, impl, dtype, seq_axis))

                def step(params, x, ct, graphdef=graphdef, kind=kind):
                    def apply(params, x):
                        layer = nnx.merge(graphdef, params)
                        return layer(x, is_causal=True) if kind == "attention" else layer(x)

                    y, vjp = jax.vjp(apply, params, x)
                    return y, vjp(ct)

                compiled = jax.jit(step).lower(params, x, ct).compile()
            runs[variant] = (compiled, (params, x, ct))
        # The bound multiplies copies of the local rows: no reference to check it against.
        m = measure(runs, runs["xla"], args.rounds, args.iters, unchecked=("bound",))
        for variant in runs:
            err = m.errs.get(variant)
            print(
                f"  {kind:9s} {variant:6s} {m.times[variant]:8.3f} ms (spread "
                f"{100 * m.spread[variant]:4.1f}%) {m.times[variant] / m.times['bound']:6.3f}x "
                f"bound" + ("" if err is None else f", output and grads vs XLA {err:.1e}")
            )


if __name__ == "__main__":
    main()
