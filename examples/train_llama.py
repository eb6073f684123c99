"""Train a Llama-style model (jax_ub.models.llama) with jax_ub's overlapped ops, and check
its losses against the same model on XLA's collectives (same init, same data).

Gated (SwiGLU) MLPs, grouped-query attention with rotary embeddings, layers under
nnx.scan with rematerialization, AdamW; batch over dp, tensor (and sequence) parallel over
tp. Runs on all GPUs when there are any, else on 4 CPU devices (dp=2 x tp=2, the tiny
preset, float32):

    python3 examples/train_llama.py
    python3 examples/train_llama.py --preset llama3-8b --layers 2 --seq 8192 --dtype bfloat16

The data (``--data``) is a synthetic language, fresh batches every step: a fixed random Markov
chain over the vocabulary in which each token has four likely successors, so the loss falls
from chance (log vocab) towards the chain's entropy (1.28 nats) as the model learns it;
``--data repeat`` trains on one random batch again and again instead (memorizing it). Every
run sees the same batches.

With ``--fp8 current`` (or ``delayed``) it trains jax_ub's model in fp8 and, from
``--seeds`` other inits, the same model without fp8, and says whether the fp8 loss curve
stays within the runs' seed-to-seed spread: at each step, whether fp8's loss is no further
from the seeds' mean than the seeds are from each other (their max - min). With
``--generate N`` it then continues the first training sequence's opening greedily for N
tokens with both trained models (decoding from their key/value caches), prints the
continuations and checks they agree as the dtype allows: in float32 every token; in
bfloat16 each row up to a near-tie, where its two candidates' logits are within
``NEAR_TIE`` (2^-5) of the largest, a few bfloat16 roundings (``decode_agreement``):

    python3 examples/train_llama.py --steps 40 --generate 16
"""

from __future__ import annotations

import argparse
import json
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
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub.models import llama, llama_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama_args.add_shape_args(parser)
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
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="steps of linear learning-rate warm-up from 0 (default 0: none)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every run's losses to PATH")
    parser.add_argument(
        "--data",
        default="markov",
        choices=["markov", "repeat"],
        help="markov: fresh batches of a synthetic language every step (default); repeat: "
        "one random batch every step",
    )
    args = parser.parse_args()
    if args.generate and args.fp8:
        parser.error("--generate goes with the ub/xla comparison, not --fp8")

    cfg = llama.PRESETS[args.preset]
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    devices = jax.devices()
    problem = llama_args.mesh_problem(cfg, args.tp, len(devices), args.batch)
    if problem:
        parser.error(problem)
    dp = len(devices) // args.tp
    mesh = Mesh(np.array(devices[: dp * args.tp]).reshape(dp, args.tp), ("dp", "tp"))
    if args.data == "markov":
        batches = markov_batches(cfg.vocab, args.steps, args.batch, args.seq)
    else:
        batches = np.asarray(
            jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab)
        )[None].repeat(args.steps, axis=0)
    print(
        f"{cfg}\nmesh dp={dp} x tp={args.tp} on {devices[0].platform}, "
        f"batches {batches.shape[1:]} ({args.data}), remat={args.remat}, dtype={args.dtype}"
    )

    schedule = optax.linear_schedule(0.0, args.lr, args.warmup) if args.warmup else args.lr
    curves = {}

    def train(name, impl, seed=0, fp8=False):
        model = llama.Llama(
            cfg,
            impl=impl,
            fp8=fp8,
            remat=args.remat,
            dtype=jnp.dtype(args.dtype),
            rngs=nnx.Rngs(seed),
        )
        optimizer = llama.make_optimizer(model, schedule)
        losses = [float(llama.train_step(model, optimizer, tokens[0]))]
        t0 = time.perf_counter()
        for step in range(1, args.steps):
            losses.append(float(llama.train_step(model, optimizer, tokens[step])))
        step_ms = (time.perf_counter() - t0) / max(args.steps - 1, 1) * 1e3
        print(
            f"{name:12s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{step_ms:.1f} ms/step (host-synchronous loop, not a benchmark)"
        )
        curves[name] = losses
        return np.array(losses), model

    with jax.set_mesh(mesh):
        tokens = jax.device_put(batches, NamedSharding(mesh, P(None, "dp", None)))
        if args.fp8:
            fp8, _ = train(f"ub fp8 {args.fp8}", "ub", 0, args.fp8)
            runs = np.stack([train(f"ub seed {s}", "ub", s)[0] for s in range(args.seeds)])
            print(spread_summary(fp8, runs, f"fp8 ({args.fp8})"))
            save(args.json, curves)
            return
        runs = {impl: train(impl, impl) for impl in ("ub", "xla")}
        ub, xla = runs["ub"][0], runs["xla"][0]
        print(
            f"largest relative loss difference, jax_ub vs XLA: "
            f"{np.max(np.abs(ub - xla) / np.abs(xla)):.2e}"
        )
        save(args.json, curves)
        if args.generate:
            generate(runs, tokens[0], args.generate, args.dtype)


def save(path: str | None, curves: dict) -> None:
    """Each run's losses, by its name, as JSON (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(curves, f)


def markov_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 1) -> np.ndarray:
    """``[steps, batch, seq]`` tokens of a fixed random Markov chain: each token is followed
    by one of its four successors (drawn once per token) with probabilities 0.4, 0.3, 0.2,
    0.1, an entropy of 1.28 nats per token; the first token of a sequence is uniform."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    choice = rng.choice(4, size=(steps * batch, seq), p=[0.4, 0.3, 0.2, 0.1])
    out = np.empty((steps * batch, seq), np.int32)
    out[:, 0] = rng.integers(0, vocab, size=steps * batch)
    for t in range(1, seq):
        out[:, t] = successors[out[:, t - 1], choice[:, t]]
    return out.reshape(steps, batch, seq)


def spread_summary(curve: np.ndarray, seeds: np.ndarray, name: str) -> str:
    """Whether ``curve`` (``[steps]``) stays within the seed-to-seed spread of ``seeds``
    (``[runs, steps]``): at each step, no further from the seeds' mean than the seeds are
    from each other (max - min); and the same over the last quarter's mean losses."""
    mean, spread = seeds.mean(axis=0), seeds.max(axis=0) - seeds.min(axis=0)
    inside = np.abs(curve - mean) <= spread
    tail = slice(-max(len(curve) // 4, 1), None)
    tails = seeds[:, tail].mean(axis=1)
    tail_gap = curve[tail].mean() - tails.mean()
    return (
        f"{name} against {len(seeds)} runs without it (seeds 0..{len(seeds) - 1}): within "
        f"the seeds' spread (|loss - their mean| <= their max - min) at {int(inside.sum())} "
        f"of {len(curve)} steps; largest spread {spread.max():.4f}, largest distance "
        f"{np.abs(curve - mean).max():.4f}. Last quarter's mean loss: {name} "
        f"{curve[tail].mean():.4f}, seeds {tails.min():.4f}..{tails.max():.4f} "
        f"({tail_gap:+.4f} from their mean, seeds' spread {tails.max() - tails.min():.4f}); "
        f"final loss {curve[-1]:.4f}, seeds {seeds[:, -1].min():.4f}..{seeds[:, -1].max():.4f}"
    )


def generate(runs: dict, tokens: jax.Array, steps: int, dtype: str) -> None:
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
    model = runs["xla"][1]
    logits_at = lambda prefix: np.asarray(_forward(model, prefix)[:, -1], np.float32)  # noqa: E731
    ok, text = decode_agreement(out["ub"], out["xla"], n, logits_at, dtype)
    print(text)
    print(f"jax_ub and XLA decode as expected: {ok}")


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


# In bfloat16 two models that differ only in summation order (jax_ub's overlapped ops, XLA's
# collectives) give logits a few roundings apart: a row may take another token where its
# top two logits are that close, and its continuation differs from there on.
NEAR_TIE = 2.0**-5  # of the largest logit's magnitude: 8 bfloat16 roundings (2^-8 each)


def decode_agreement(ub, xla, prompt_len, logits_at, dtype) -> tuple[bool, str]:
    """Whether jax_ub's greedy tokens ``ub`` agree with XLA's ``xla`` (``[batch, prompt_len
    + steps]``) as far as ``dtype`` allows, and a report. float32 (and wider): every token
    equal. bfloat16 and float16: each row equal up to its first difference, and each
    first difference at a near-tie: in ``logits_at(xla[:, :t])[row]``, XLA's logits
    ``[batch, vocab]`` of the token after the row's common prefix, the two tokens within
    ``NEAR_TIE`` of the largest logit's magnitude."""
    diverged = [r for r, (a, b) in enumerate(zip(ub, xla)) if not np.array_equal(a, b)]
    if not diverged:
        return True, f"every row decodes the same {ub.shape[1] - prompt_len} tokens"
    if jnp.dtype(dtype).itemsize >= 4:
        return False, f"rows {diverged} differ; in {jnp.dtype(dtype)} none should"
    lines, ok = [], True
    for r in diverged:
        t = int(np.argmax(ub[r] != xla[r]))
        logits = logits_at(xla[:, :t])[r]
        gap = abs(float(logits[ub[r, t]] - logits[xla[r, t]]))
        tol = NEAR_TIE * float(np.max(np.abs(logits)))
        ok &= gap <= tol
        lines.append(
            f"  row {r} differs from token {t - prompt_len} (jax_ub {ub[r, t]}, XLA {xla[r, t]}): "
            f"their logits {gap:.3g} apart, {'a near-tie' if gap <= tol else 'NOT a near-tie'} "
            f"(<= {tol:.3g})"
        )
    head = (
        f"{len(diverged)} of {len(ub)} rows differ; in {jnp.dtype(dtype)} a row may, from a "
        f"token whose top two logits are within {NEAR_TIE:g} of the largest's magnitude:"
    )
    return ok, "\n".join([head, *lines])


if __name__ == "__main__":
    main()
