#!/usr/bin/env python3
"""Train a small tensor-parallel transformer LM built from jax_ub.flax layers.

Every block is a sequence-parallel :class:`jax_ub.flax.ParallelSelfAttention` and
:class:`jax_ub.flax.ParallelMLP`, whose all-gathers and reduce-scatters are overlapped
with their matmuls by jax_ub. The data is synthetic: each sequence walks a fixed random
cycle through the vocabulary (``perm[i]`` is always followed by ``perm[i + 1]``), so the
next-token loss falls from ``log(vocab)`` towards zero as the model learns it.

Runs on all GPUs, or on 4 CPU devices (it sets ``XLA_FLAGS`` for that when run as a
script). ``--mesh dp=2,tp=2`` splits the devices into a data-parallel and a
tensor-parallel axis: the batch is sharded over ``dp`` and stays so through every layer
(XLA does the data-parallel part, jax_ub the tensor-parallel one). The layers are given
no mesh: they take the one set by ``jax.set_mesh``. With ``--compare-xla`` it trains the
same model again on XLA's collectives (``impl="xla"``) and prints the step-time speedup;
that comparison is meaningful on GPUs.

Usage::

    python examples/train_tp_transformer.py                  # CPU: 300 steps, ~1 minute
    python examples/train_tp_transformer.py --compare-xla --rounds 3  # GPUs: ub vs XLA,
                                                             # alternating, median ms/step
    python examples/train_tp_transformer.py --steps 50 --hidden 128 --heads 8 --dtype bfloat16
    python examples/train_tp_transformer.py --mesh dp=2,tp=2  # batch over dp, layers over tp
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import NamedTuple


def _ensure_host_devices(count: int = 4) -> None:
    """Ask XLA for `count` CPU devices unless told otherwise (GPUs are unaffected)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


if __name__ == "__main__":
    _ensure_host_devices()  # before JAX creates its CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
    import jax_ub.flax as ubf
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax_ub.flax as ubf

AXIS = "tp"
# Defaults per platform: small enough for 2 CPU cores, large enough to matter on GPUs.
CPU_CONFIG = dict(seq=32, batch=8, hidden=64, layers=2, heads=4, vocab=64, dtype="float32")
GPU_CONFIG = dict(seq=2048, batch=4, hidden=4096, layers=4, heads=32, vocab=1024, dtype="bfloat16")


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, hidden: int, heads: int, *, impl: str, dtype, fp8: bool, rngs: nnx.Rngs):
        tp = dict(axis_name=AXIS, impl=impl, dtype=dtype, fp8=fp8, rngs=rngs)
        self.ln1 = nnx.LayerNorm(hidden, rngs=rngs)
        self.attn = ubf.ParallelSelfAttention(hidden, heads, **tp)
        self.ln2 = nnx.LayerNorm(hidden, rngs=rngs)
        self.mlp = ubf.ParallelMLP(hidden, 4 * hidden, **tp)

    def __call__(self, x: jax.Array) -> jax.Array:
        # is_causal rather than a mask array: on GPUs this runs cuDNN's fused attention.
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.mlp(self.ln2(x))


class TransformerLM(nnx.Module):
    """Token ids ``[seq, batch]`` -> logits ``[seq, batch, vocab]``, sequence-parallel."""

    def __init__(
        self, *, vocab: int, seq: int, hidden: int, layers: int, heads: int, impl: str,
        dtype, fp8: bool = False, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
        # Sequence-sharded like the activations it is added to, so its gradient needs no
        # all-gather.
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (seq, 1, hidden)),
            out_sharding=(AXIS, None, None),
        )
        self.blocks = nnx.List(
            [
                Block(hidden, heads, impl=impl, dtype=dtype, fp8=fp8, rngs=rngs)
                for _ in range(layers)
            ]
        )
        self.ln_f = nnx.LayerNorm(hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TrainResult(NamedTuple):
    losses: list[float]  # one per step
    step_time_s: float  # mean over the steps after the first
    compile_time_s: float  # the first step: tracing, compiling, running once


def default_devices() -> list[jax.Device]:
    """All GPUs, or (up to) 4 CPU devices."""
    devices = jax.devices()
    return devices if devices[0].platform != "cpu" else devices[: min(4, len(devices))]


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar if tqdm is installed, else a plain text one; `update(n, text)`."""
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415
    except ImportError:
        tqdm = None
    if enabled and tqdm is not None:
        bar = tqdm(total=total, desc=desc, dynamic_ncols=True)

        def update(n: int, text: str) -> None:
            bar.set_postfix_str(text, refresh=False)
            bar.update(n - bar.n)

        return update, bar.close

    stream, done = sys.stderr, [0]
    live = stream.isatty()

    def update(n: int, text: str) -> None:
        done[0] = n
        if enabled:
            filled = int(30 * n / total)
            line = f"{desc} [{'#' * filled}{'.' * (30 - filled)}] {n}/{total} {text}"
            stream.write(("\r" + line) if live else (line + "\n"))
            stream.flush()

    def close() -> None:
        if enabled and live:
            stream.write("\n")

    return update, close


def train(
    *,
    steps: int = 300,
    impl: str = "auto",
    seq: int = CPU_CONFIG["seq"],
    batch: int = CPU_CONFIG["batch"],
    hidden: int = CPU_CONFIG["hidden"],
    layers: int = CPU_CONFIG["layers"],
    heads: int = CPU_CONFIG["heads"],
    vocab: int = CPU_CONFIG["vocab"],
    dtype: str = CPU_CONFIG["dtype"],
    fp8: bool = False,
    lr: float = 3e-3,
    seed: int = 0,
    devices: list[jax.Device] | None = None,
    mesh_shape: dict[str, int] | None = None,
    progress: bool = True,
    desc: str | None = None,
    trace_dir: str | None = None,
    log_every: int | None = None,
) -> TrainResult:
    """Train the model for `steps` steps of adamw on fresh synthetic batches.

    The same `seed` gives the same initial parameters and batches for every `impl`, so
    runs differ only in how the collectives are done. With `fp8`, the blocks' matmuls run in
    fp8 with current scaling (the layers' ``fp8=True``). With `trace_dir`, the last 3 steps
    are traced with JAX's profiler into it (benchmarks/tools/profile_train_step.py reads it).
    Every `log_every` steps (default: 50 times a run) the host waits for the loss to show
    it; in between, steps are dispatched ahead of the GPUs. `mesh_shape` (axis -> size,
    with a "tp" axis; default: every device on "tp") lays the devices out; the batch is
    sharded over every axis but "tp".
    """
    devices = default_devices() if devices is None else devices
    mesh = make_mesh(devices, mesh_shape or {AXIS: len(devices)})
    with jax.set_mesh(mesh):
        return _train(
            mesh,
            steps=steps,
            impl=impl,
            seq=seq,
            batch=batch,
            hidden=hidden,
            layers=layers,
            heads=heads,
            vocab=vocab,
            dtype=dtype,
            fp8=fp8,
            lr=lr,
            seed=seed,
            progress=progress,
            desc=desc,
            trace_dir=trace_dir,
            log_every=log_every,
        )


def make_mesh(devices: list[jax.Device], shape: dict[str, int]) -> Mesh:
    """A mesh of `devices` with axes `shape` (e.g. {"dp": 2, "tp": 2}); "tp" must be one."""
    problem = mesh_problem(shape, len(devices))
    if problem:
        raise ValueError(problem)
    return Mesh(np.array(devices).reshape(tuple(shape.values())), tuple(shape))


def _train(
    mesh: Mesh, *, steps, impl, seq, batch, hidden, layers, heads, vocab, dtype, fp8, lr, seed,
    progress, desc, trace_dir, log_every,
) -> TrainResult:  # fmt: skip
    devices = list(mesh.devices.flat)
    data_axes = tuple(a for a in mesh.axis_names if a != AXIS)
    model = TransformerLM(
        vocab=vocab, seq=seq, hidden=hidden, layers=layers, heads=heads, impl=impl,
        dtype=jnp.dtype(dtype), fp8=fp8, rngs=nnx.Rngs(seed),
    )  # fmt: skip
    graphdef, params = nnx.split(model, nnx.Param)
    # Place every parameter on the mesh: TP weights by their annotation, the rest replicated.
    params = jax.device_put(params, nnx.get_named_sharding(params, mesh))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(  # on the mesh too, the step counter included
        lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, replicated),
        tx.init(params),
    )
    # Steps hand back the state in the layout they got it in, so nothing recompiles.
    state_shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
    perm = jax.random.permutation(jax.random.key(seed + 1), vocab)
    # Sequence-parallel over tp, the batch over the data-parallel axes.
    tokens_sharding = NamedSharding(mesh, P(AXIS, data_axes or None))

    def make_batch(key):
        # Closed form, not a scan over seq: a loop of seq tiny steps would cost more than
        # the model on a GPU.
        start = jax.random.randint(key, (batch,), 0, vocab)
        tokens = perm[(start[None, :] + jnp.arange(seq + 1)[:, None]) % vocab]  # [seq+1, b]
        inputs, targets = tokens[:-1], tokens[1:]
        constrain = functools.partial(jax.lax.with_sharding_constraint, shardings=tokens_sharding)
        return constrain(inputs), constrain(targets)

    def loss_fn(params, inputs, targets):
        logits = nnx.merge(graphdef, params)(inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    donate = (0, 1) if devices[0].platform != "cpu" else ()

    @functools.partial(jax.jit, donate_argnums=donate, out_shardings=(*state_shardings, None))
    def train_step(params, opt_state, step):
        inputs, targets = make_batch(jax.random.fold_in(jax.random.key(seed), step))
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    desc = desc or f"impl={impl}" + (" fp8" if fp8 else "")
    update, close = _progress(steps, desc, progress)
    log_every = max(1, steps // 50) if log_every is None else max(1, log_every)
    losses = []
    start = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, 0)
    losses.append(loss)
    loss.block_until_ready()
    compile_time = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(1, steps):
        if trace_dir and step == max(1, steps - 3):
            jax.block_until_ready(loss)
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        params, opt_state, loss = train_step(params, opt_state, step)
        losses.append(loss)
        if step % log_every == 0 or step == steps - 1:
            value = float(loss)  # waits for this step
            ms = 1e3 * (time.perf_counter() - start) / step
            update(step + 1, f"loss {value:.4f} {ms:.1f} ms/step")
    jax.block_until_ready(loss)
    step_time = (time.perf_counter() - start) / max(1, steps - 1)
    if trace_dir and steps > 1:
        jax.profiler.stop_trace()
    close()
    return TrainResult([float(x) for x in losses], step_time, compile_time)


def mesh_problem(shape: dict[str, int], devices: int) -> str | None:
    """Why the axes ``shape`` (axis -> size) cannot lay out ``devices`` devices, or None:
    a ``"tp"`` axis, sizes that multiply to the number of devices."""
    size = int(np.prod(list(shape.values())))
    if AXIS not in shape:
        return f"mesh {shape} has no {AXIS!r} axis: name the tensor-parallel axis {AXIS!r}"
    if size != devices:
        return (
            f"mesh {shape}: its sizes multiply to {size}, but there are {devices} devices; "
            f"give sizes that multiply to {devices}, e.g. {AXIS}={devices}"
        )
    return None


def parse_mesh(text: str) -> dict[str, int]:
    """ "dp=2,tp=2" -> {"dp": 2, "tp": 2}."""
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise SystemExit(f'--mesh takes "axis=size,...", e.g. "dp=2,tp=2"; got {text!r}') from None


def main(argv: list[str] | None = None) -> dict[str, TrainResult]:
    """Command line entry point; returns the result of each run, keyed by impl."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--impl", choices=["auto", "ub", "xla"], default="auto")
    parser.add_argument("--compare-xla", action="store_true", help="also train with impl=xla")
    parser.add_argument(
        "--rounds", type=int, default=1, help="with --compare-xla: alternate the runs this often"
    )
    for name in ("seq", "batch", "hidden", "layers", "heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="default depends on the platform")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument(
        "--fp8", action="store_true", help="the blocks' matmuls in fp8 (current scaling)"
    )
    parser.add_argument(
        "--compare-bf16",
        action="store_true",
        help="with --fp8: also train without fp8 and compare the losses",
    )
    parser.add_argument(
        "--lr", type=float, help="default 3e-3 on CPU devices, 3e-4 for the larger GPU model"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--mesh", help='device layout, e.g. "dp=2,tp=2" (default: every device on tp)'
    )
    parser.add_argument(
        "--log-every", type=int, help="show the loss every N steps (waits for it); default steps/50"
    )
    args = parser.parse_args(argv)

    devices = default_devices()
    platform = devices[0].platform
    config = dict(CPU_CONFIG if platform == "cpu" else GPU_CONFIG)
    config.update({k: v for k, v in vars(args).items() if k in config and v is not None})
    shape = parse_mesh(args.mesh) if args.mesh else {AXIS: len(devices)}
    problem = mesh_problem(shape, len(devices))
    if problem:
        parser.error(f"--mesh {args.mesh}: {problem}")
    print(f"{len(devices)} {platform} devices, mesh {shape}; {config}")
    # The GPU model (hidden 4096) does not learn at 3e-3 in bf16: its loss stalls near ln(vocab).
    lr = args.lr if args.lr is not None else (3e-3 if platform == "cpu" else 3e-4)
    kw = dict(steps=args.steps, lr=lr, seed=args.seed, devices=devices, **config)
    kw["mesh_shape"] = shape
    kw["progress"] = not args.no_progress
    kw["log_every"] = args.log_every
    if args.compare_bf16:
        plain = train(impl=args.impl, fp8=False, **kw)
        print(f"impl={args.impl} without fp8: loss {plain.losses[0]:.4f} -> {plain.losses[-1]:.4f}")
    kw["fp8"] = args.fp8

    rounds = args.rounds if args.compare_xla else 1
    times: dict[str, list[float]] = {args.impl: [], "xla": []}
    results: dict[str, TrainResult] = {}
    for r in range(rounds):  # alternate, so drift on the machine hits both alike
        for impl in (args.impl, "xla") if args.compare_xla else (args.impl,):
            res = train(impl=impl, **kw)
            results.setdefault(impl, res)
            times[impl].append(res.step_time_s)
            print(
                f"round {r + 1}/{rounds} impl={impl}: loss {res.losses[0]:.4f} -> "
                f"{res.losses[-1]:.4f}, {1e3 * res.step_time_s:.2f} ms/step "
                f"(first step {res.compile_time_s:.1f} s)"
            )
    if args.compare_xla:
        if platform == "cpu":
            print("note: CPU devices share the host's cores; step times say nothing about GPUs")
        a, b = np.asarray(results[args.impl].losses), np.asarray(results["xla"].losses)
        early = min(10, len(a))
        t_impl, t_xla = float(np.median(times[args.impl])), float(np.median(times["xla"]))
        print(
            f"loss difference impl={args.impl} vs xla: max {np.max(np.abs(a - b)):.2e}, "
            f"first {early} steps {np.max(np.abs(a[:early] - b[:early])):.2e}"
        )
        print(
            f"median over {rounds} round(s): impl={args.impl} {1e3 * t_impl:.2f} ms/step, "
            f"xla {1e3 * t_xla:.2f} ms/step; speedup {t_xla / t_impl:.3f}x"
        )
    if args.compare_bf16:
        print(loss_gap_summary(results[args.impl].losses, plain.losses))
    return results


def loss_gap_summary(fp8_losses: list[float], plain_losses: list[float]) -> str:
    """How far the fp8 run's loss is from the run without fp8: the largest gap over all
    steps and the gap of the last 10 steps' means, relative to the latter's; then both
    losses at ten steps spread over the run."""
    a, b = np.asarray(fp8_losses), np.asarray(plain_losses)
    tail = min(10, len(a))
    rel = abs(a[-tail:].mean() - b[-tail:].mean()) / b[-tail:].mean()
    steps = sorted({int(i) for i in np.linspace(0, len(a) - 1, min(10, len(a)))})
    table = "\n".join(f"  step {i:5d}: fp8 {a[i]:.4f}  without {b[i]:.4f}" for i in steps)
    return (
        f"fp8 vs without: max |loss gap| {np.max(np.abs(a - b)):.3e}; last {tail} steps' mean "
        f"loss {a[-tail:].mean():.4f} vs {b[-tail:].mean():.4f} ({100 * rel:.2f}% apart)\n" + table
    )


if __name__ == "__main__":
    main()
