"""End-to-end training step of the Llama-style model (jax_ub.models.llama) per way of
communicating: jax_ub's overlapped ops (``jax_ub_keep``: with ``keep_gathered`` on, which
keeps the gathered inputs instead of gathering them again), XLA's collectives with default
flags, XLA with the flags a MaxText user sets for overlap (in a process of its own: XLA flags
are per process), and the no-communication bound (the model with ``impl="none"``: every GEMM
kept, the ops' and the embedding's collectives removed; the loss's all-reduces over the
vocabulary's split stay), on XLA's GEMMs (``bound``) and on jax_ub's own (``bound_ub``), so
that a faster GEMM is not taken for overlap.

Run as ``python -m jax_ub.bench.model`` (``--help`` for the options). In-process variants
run in interleaved rounds on the same data from the same init; each prints step time
(median of the rounds, and their spread), tokens/s, MFU (model FLOPs over the devices'
stated peak), the compiled step's memory (XLA's estimate: arguments, outputs and
temporaries), the ratios to the bounds and to the best XLA variant, and the first step's
loss, which for jax_ub and XLA must agree; each round also prints the host's ms to enqueue a
step. ``--processes N`` repeats the rounds in N fresh processes, one after another: on the
same GPUs jax_ub's step has differed by a few percent between processes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import statistics
import sys
import time

from jax_ub.bench.model_processes import over_processes, run_child
from jax_ub.bench.model_report import report
from jax_ub.bench.timing import round_order

DESCRIPTION = (
    "Benchmark one training step of a Llama-style model (GQA with rotary embeddings, SwiGLU, "
    "layers under nnx.scan with remat, AdamW) with jax_ub's overlapped ops, with XLA's "
    "collectives, with XLA's collectives and MaxText's overlap flags (in a process of its "
    "own), and with every collective removed (the bound), over a (dp, tp) mesh of this "
    "process's devices; print step time, tokens/s, MFU, memory and the ratios to the bound "
    "and to the best XLA variant. Variants in this process run in interleaved rounds from "
    "the same init on the same tokens; a variant whose first loss differs from XLA's ends the "
    "run with an error."
)
VARIANTS = ("jax_ub", "jax_ub_keep", "xla", "xla_overlap", "bound", "bound_ub")
# The variants that run jax_ub's calls (its ub[...] tuning variants too).
_UB_CALLS = ("jax_ub", "bound_ub")
# What a MaxText user sets on GPUs for collective/compute overlap: the latency-hiding
# scheduler and the windowed-einsum collective matmul at every size.
OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_threshold_for_windowed_einsum_mib=0"
)


def _parser() -> argparse.ArgumentParser:
    from jax_ub.models import llama_args

    ap = argparse.ArgumentParser(prog="python -m jax_ub.bench.model", description=DESCRIPTION)
    llama_args.add_shape_args(ap)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="computation dtype (default bfloat16)",
    )
    ap.add_argument(
        "--param-dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="the params' dtype (default float32; AdamW's moments are float32 either way)",
    )
    ap.add_argument(
        "--fp8",
        default="none",
        choices=["none", "current", "delayed"],
        help="the blocks' projections in fp8 with current or delayed scaling (jax_ub: its "
        "fp8 ops; xla and xla_overlap: XLA's collectives and fp8 GEMMs of the same "
        "quantized operands; bound: xla's fp8 GEMMs without the communication, bound_ub: "
        "jax_ub's; default none)",
    )
    ap.add_argument(
        "--variants",
        default="jax_ub,xla,bound,bound_ub",
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: "
        "jax_ub,xla,bound,bound_ub; jax_ub_keep: jax_ub with keep_gathered on, keeping the "
        "gathered x for the backward; bound: the model with its communication removed, "
        "on XLA's GEMMs, bound_ub: on jax_ub's own (jax_ub.configure(bound_gemms='ub')); "
        "xla_overlap needs GPUs)",
    )
    ap.add_argument(
        "--scan-unroll",
        type=llama_args.count_arg(0),
        default=1,
        help="blocks per iteration of the scan over them (0: all, no loop; default 1)",
    )
    at_least_one = llama_args.count_arg(1)
    ap.add_argument("--rounds", type=at_least_one, default=5, help="interleaved timing rounds")
    ap.add_argument(
        "--steps", type=at_least_one, default=5, help="steps timed per round and variant"
    )
    ap.add_argument(
        "--warmup",
        type=llama_args.count_arg(0),
        default=20,
        help="untimed steps per variant after its first (default 20: past the GEMM "
        "kernel trials of jax_ub's ops, a dozen calls of each shape, and a shape may run "
        "once a step)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="each device's peak for MFU (default: 989 on H100/H200, dense "
        "bf16 by the datasheet; none on CPU)",
    )
    ap.add_argument(
        "--overlap-flags",
        default=OVERLAP_FLAGS,
        help="XLA_FLAGS of the xla_overlap variant's process",
    )
    ap.add_argument(
        "--park-states",
        action="store_true",
        help="keep the variants' params and optimizer states in host memory while the "
        "others run, so that one variant's state at a time fills the devices (moved "
        "outside the timed loops); the parked states share JAX's pinned host pool, 64 GB "
        "a process unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says more (Llama 3 8B's 8 "
        "blocks at tp=1 hold about 28 GB a variant)",
    )
    ap.add_argument(
        "--ub-variants",
        type=_tuned,
        default="",
        help="EXPERIMENTAL: more jax_ub variants, each under other internal tuning choices "
        "or GEMM choice file (gemm_cache=PATH) "
        '(as python -m jax_ub.bench\'s: "name=value,...;name=value"), timed in the same rounds',
    )
    ap.add_argument(
        "--processes",
        type=at_least_one,
        default=1,
        help="time the variants but xla_overlap in this many fresh processes in turn, each "
        "its own rounds; report each one's times and ratios, and per variant the median "
        "over them (jax_ub's step differs between processes; default 1: this process)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # variants (JSON), in a process of their own
    return ap


def _tuned(text: str) -> dict[str, dict]:
    """``--ub-variants`` parsed (argparse names a bad one): variant name -> its tuning
    choices."""
    from jax_ub.bench.impls import parse_variants, variant_name

    try:
        return {variant_name(t): t for t in parse_variants(text)}
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _tuning_of(variant: str, args):
    """A context with `variant`'s tuning choices (a jax_ub[...] variant's), which its
    communicator is created with; the defaults for the others."""
    from jax_ub.bench.impls import configured

    tuning = args.ub_variants.get(variant)
    return configured(tuning) if tuning else contextlib.nullcontext()


def _config(args):
    """The preset's shapes, with ``--layers``."""
    from jax_ub.models import llama

    cfg = llama.PRESETS[args.preset]
    return cfg if args.layers is None else dataclasses.replace(cfg, layers=args.layers)


def setup(args):
    """(model config, (dp, tp) mesh, the batch of tokens sharded over dp) of the run."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ub.models import llama_args

    cfg = _config(args)
    devices = jax.devices()
    problem = llama_args.mesh_problem(cfg, args.tp, len(devices), args.batch)
    if problem:
        raise SystemExit(problem)
    dp = len(devices) // args.tp
    mesh = Mesh(np.array(devices[: dp * args.tp]).reshape(dp, args.tp), ("dp", "tp"))
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
    return cfg, mesh, tokens


def compiled_step(variant: str, cfg, mesh, tokens, args):
    """(jitted step, state) of one variant: the model and AdamW state in one pytree, the
    step donating it; and the compiled step's memory estimate in bytes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_ub
    from jax_ub.models import llama

    # The bounds: the same model, its communication removed (jax_ub's impl="none"), on
    # XLA's GEMMs or on jax_ub's (bound_gemms, read when the step is traced).
    bounds = ("bound", "bound_ub")
    impl = "none" if variant in bounds else "xla" if variant.startswith("xla") else "ub"
    with jax.set_mesh(mesh):
        model = llama.Llama(
            cfg,
            impl=impl,
            fp8=False if args.fp8 == "none" else args.fp8,
            remat=args.remat,
            scan_unroll=args.scan_unroll or True,
            dtype=jnp.dtype(args.dtype),
            param_dtype=jnp.dtype(args.param_dtype),
            rngs=nnx.Rngs(0),
        )
        optimizer = llama.make_optimizer(model)
        graphdef, state = nnx.split((model, optimizer))

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss = llama.loss_and_update(model, optimizer, tokens)
        return nnx.state((model, optimizer)), loss

    step = jax.jit(step, donate_argnums=0)
    # jax_ub_keep: the ops keep all_gather(x), not x's shard, for the weight gradients
    # (read when the step is traced).
    before = {name: getattr(jax_ub.config, name) for name in ("keep_gathered", "bound_gemms")}
    jax_ub.configure(
        keep_gathered=variant == "jax_ub_keep" or before["keep_gathered"],
        bound_gemms="ub" if variant == "bound_ub" else "xla",
    )
    try:
        with jax.set_mesh(mesh), _tuning_of(variant, args):
            compiled = step.lower(state, tokens).compile()
    finally:
        jax_ub.configure(**before)
    _check_calls(variant, compiled.as_text(), mesh)
    memory = compiled.memory_analysis()
    used = None
    if memory is not None:
        used = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
    return compiled, state, used


def _check_calls(variant: str, hlo: str, mesh) -> None:
    """A jax_ub variant's step runs jax_ub's calls (at tp=1 its own GEMMs), the others none,
    so that no row of the table times something other than it says."""
    calls = len(re.findall(r'custom_call_target="jax_ub_', hlo))
    runs_ub = variant.startswith(_UB_CALLS)
    if runs_ub and not calls:
        raise SystemExit(
            f"variant {variant}: the compiled step has no jax_ub call (mesh {dict(mesh.shape)}); "
            "its time would be XLA's"
        )
    if not runs_ub and calls:
        raise SystemExit(f"variant {variant}: the compiled step has {calls} jax_ub calls")


def _run(variants: list[str], args, say) -> dict:
    """Compile each variant, then time them in interleaved rounds."""
    import jax

    if "xla_overlap" in variants and jax.default_backend() != "gpu":
        sys.exit(
            f"xla_overlap needs GPUs: its flags ({args.overlap_flags}) set XLA's GPU "
            f"scheduler, and this process runs on {jax.default_backend()} devices"
        )
    cfg, mesh, tokens = setup(args)
    steps, states, first_loss, memory, placement = {}, {}, {}, {}, {}
    park = args.park_states and len(variants) > 1

    def to_host(v):  # the variant's params and optimizer state wait in host memory
        states[v] = jax.device_put(
            states[v], jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), placement[v])
        )
        jax.block_until_ready(states[v])

    def to_device(v):
        states[v] = jax.block_until_ready(jax.device_put(states[v], placement[v]))

    for v in variants:
        t0 = time.perf_counter()
        steps[v], states[v], memory[v] = compiled_step(v, cfg, mesh, tokens, args)
        states[v], loss = steps[v](states[v], tokens)
        first_loss[v] = float(loss)
        for _ in range(args.warmup):
            states[v], loss = steps[v](states[v], tokens)
        jax.block_until_ready(loss)
        placement[v] = jax.tree.map(lambda a: a.sharding, states[v])
        if park:
            to_host(v)
        say(
            f"  {v}: compiled and ran {1 + args.warmup} steps in {time.perf_counter() - t0:.1f} s, "
            f"loss {first_loss[v]:.5f}"
        )
    times: dict[str, list[float]] = {v: [] for v in variants}
    issued: dict[str, list[float]] = {v: [] for v in variants}  # host ms/step to enqueue
    for r in range(args.rounds):
        for v in round_order(variants, r):
            if park:
                to_device(v)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[v], loss = steps[v](states[v], tokens)
            issued[v].append((time.perf_counter() - t0) / args.steps * 1e3)
            jax.block_until_ready(loss)
            times[v].append((time.perf_counter() - t0) / args.steps * 1e3)
            if park:
                to_host(v)
        # Host-bound where the host needs about as long to enqueue a step as to run it.
        cells = (f"{v} {times[v][-1]:.2f} ms (issued {issued[v][-1]:.0f})" for v in variants)
        say(f"  round {r + 1}/{args.rounds}: " + ", ".join(cells))
    from jax_ub._src.runtime import communicator
    from jax_ub._src.settings import options

    # jax_ub's symmetric buffers live outside XLA's allocator: reported beside its estimate,
    # per variant those of the communicators made with its options (--ub-variants: its own),
    # outgrown ones too (held until finalize by the programs compiled on them).
    def userbuffers(v):
        with _tuning_of(v, args):
            made_with = options.current_options()
        return sum(c.capacity_bytes for c in communicator.all_communicators(made_with))

    stats = mesh.devices.flat[0].memory_stats() or {}
    return {
        v: {
            "step_ms": statistics.median(times[v]),
            "spread": (max(times[v]) - min(times[v])) / statistics.median(times[v]),
            "issued_ms": statistics.median(issued[v]),
            "first_loss": first_loss[v],
            "memory_bytes": memory[v],
            "userbuffer_bytes": userbuffers(v) if v.startswith("jax_ub") else 0,
        }
        for v in variants
    } | {
        "_config": dataclasses.asdict(cfg),
        "_devices": [str(d) for d in mesh.devices.flat],
        "_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    say = (
        (lambda *a, **k: print(*a, **k, file=sys.stderr, flush=True))
        if args.child
        else (lambda *a, **k: print(*a, **k, flush=True))
    )
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    variants += [v for v in args.ub_variants if v not in variants]
    if args.child:
        print("MODEL_RESULT " + json.dumps(_run(json.loads(args.child), args, say)), flush=True)
        return
    say(f"variants {variants}: compiling ...")
    results = {}
    # Other processes first, before this one takes the devices' memory.
    if "xla_overlap" in variants:
        say(f"  xla_overlap: in its own process, XLA_FLAGS+={args.overlap_flags!r}")
        child = run_child(["xla_overlap"], argv, say, args.overlap_flags)
        results["xla_overlap"] = child.get("xla_overlap")
    here = [v for v in variants if v != "xla_overlap"]
    if here and args.processes > 1:
        per_process = []
        for i in range(args.processes):
            say(f"process {i + 1}/{args.processes}: {','.join(here)}")
            per_process.append(run_child(here, argv, say))
        results = over_processes(per_process, say) | results
    elif here:
        results = _run(here, args, say) | results
    report(results, args, _config(args), say)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
