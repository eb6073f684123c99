"""Train a Llama-style model (jax_ub.bench.llama) with jax_ub's overlapped ops, and check
its losses against the same model on XLA's collectives (same init, same data).

Gated (SwiGLU) MLPs, grouped-query attention with rotary embeddings, layers under
nnx.scan with rematerialization, AdamW; batch over dp, tensor (and sequence) parallel over
tp. Runs on all GPUs when there are any, else on 4 CPU devices (dp=2 x tp=2, the tiny
preset, float32):

    python3 examples/train_llama.py
    python3 examples/train_llama.py --preset llama3-8b --layers 2 --seq 8192 --dtype bfloat16

With ``--fp8 current`` (or ``delayed``) it trains jax_ub's model in fp8 and, from
``--seeds`` other inits, the same model without fp8, and says whether the fp8 loss curve
stays within the bf16 runs' seed-to-seed spread. With ``--generate N`` it then continues
the first training sequence's opening greedily for N tokens with both trained models
(decoding from their key/value caches) and prints the continuations:

    python3 examples/train_llama.py --steps 40 --generate 16
"""

from __future__ import annotations

import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Only affects the CPU backend: with no GPU, simulate 4 devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub.bench import llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama.add_shape_args(parser)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="computation dtype (params stay float32; default float32)",
    )
    parser.add_argument(
        "--fp8",
        choices=["current", "delayed"],
        help="train in fp8 and compare the loss curve with --seeds runs without fp8",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="runs without fp8 for --fp8's spread (default 3)"
    )
    parser.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="after training, greedily decode N tokens from the opening of the training "
        "data with each trained model and print them (default 0: none)",
    )
    args = parser.parse_args()
    if args.generate and args.fp8:
        parser.error("--generate goes with the ub/xla comparison, not --fp8")

    cfg = llama.PRESETS[args.preset]
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    devices = jax.devices()
    dp = len(devices) // args.tp
    mesh = Mesh(np.array(devices[: dp * args.tp]).reshape(dp, args.tp), ("dp", "tp"))
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab)
    print(
        f"{cfg}\nmesh dp={dp} x tp={args.tp} on {devices[0].platform}, "
        f"tokens {tokens.shape}, remat={args.remat}, dtype={args.dtype}"
    )

    def train(name, impl, seed=0, fp8=False):
        model = llama.Llama(
            cfg,
            impl=impl,
            fp8=fp8,
            remat=args.remat,
            dtype=jnp.dtype(args.dtype),
            rngs=nnx.Rngs(seed),
        )
        optimizer = llama.make_optimizer(model, 3e-3)
        losses = [float(llama.train_step(model, optimizer, tokens))]
        t0 = time.perf_counter()
        for _ in range(args.steps - 1):
            losses.append(float(llama.train_step(model, optimizer, tokens)))
        step_ms = (time.perf_counter() - t0) / max(args.steps - 1, 1) * 1e3
        print(
            f"{name:12s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{step_ms:.1f} ms/step (host-synchronous loop, not a benchmark)"
        )
        return np.array(losses), model

    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        if args.fp8:
            fp8, _ = train(f"ub fp8 {args.fp8}", "ub", 0, args.fp8)
            runs = np.stack([train(f"ub seed {s}", "ub", s)[0] for s in range(args.seeds)])
            low, high = runs.min(axis=0), runs.max(axis=0)
            outside = np.maximum(low - fp8, fp8 - high).clip(min=0)
            print(
                f"fp8 ({args.fp8}) against {args.seeds} runs without fp8 (seeds "
                f"0..{args.seeds - 1}): largest step-to-step seed spread "
                f"{np.max(high - low):.4f}, fp8 outside that spread at "
                f"{int(np.sum(outside > 0))} of {args.steps} steps (by at most "
                f"{np.max(outside):.4f}); final loss fp8 {fp8[-1]:.4f}, without "
                f"{low[-1]:.4f}..{high[-1]:.4f}"
            )
            return
        runs = {impl: train(impl, impl) for impl in ("ub", "xla")}
        ub, xla = runs["ub"][0], runs["xla"][0]
        print(
            f"largest relative loss difference, jax_ub vs XLA: "
            f"{np.max(np.abs(ub - xla) / np.abs(xla)):.2e}"
        )
        if args.generate:
            generate(runs, tokens, args.generate)


def generate(runs: dict, tokens: jax.Array, steps: int) -> None:
    """Greedy continuations of the first training sequence's opening (a quarter of it,
    at least one token), from each trained model, next to what the data has there."""
    prompt = tokens[:, : max(tokens.shape[1] // 4, 1)]
    n = prompt.shape[1]
    print(f"greedy decoding of {steps} tokens after a prompt of {n} (first sequence):")
    print(f"  {'prompt':8s} {np.asarray(prompt[0]).tolist()}")
    data = np.asarray(tokens[0, n : n + steps]).tolist()
    print(f"  {'data':8s} {data}" + (" (shorter: the data ends)" if len(data) < steps else ""))
    out = {}
    for impl, (_, model) in runs.items():
        t0 = time.perf_counter()
        out[impl] = np.asarray(llama.greedy_generate(model, prompt, steps))
        ms = (time.perf_counter() - t0) * 1e3
        print(f"  {impl:8s} {out[impl][0, n:].tolist()} ({ms:.0f} ms, compiles included)")
    same = np.array_equal(out["ub"], out["xla"])
    print(f"jax_ub and XLA decode the same tokens (whole batch): {same}")


if __name__ == "__main__":
    main()
