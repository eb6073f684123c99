"""Where the TP transformer's training step spends its GPU time, jax_ub vs XLA collectives.

python benchmarks/tools/profile_train_step.py --hidden 8192 --seq 8192 --layers 1 --batch 1 \\
    --heads 64 --vocab 1024 [--steps 8] [--out DIR]

Trains `examples/train_tp_transformer.py`'s model for a few steps per impl, traces the last
three with JAX's profiler (CUPTI, no nsys needed) and prints, per step and GPU, the summed
duration of the device kernels by kind (GEMMs, attention, collectives, copies, jax_ub's own
kernels, other XLA fusions) and the largest kernels. Kernels on different streams overlap,
so the sums can exceed the step time. Per GPU it also prints how much of the traced steps
some kernel was running (copies excluded) and how long the GPU sat idle.

With ``--model llama`` it profiles instead the Llama-style model's step of ``python -m
jax_ub.bench.model`` (the arguments after ``--model llama`` are that benchmark's: preset,
layers, seq, batch, tp, remat, fp8, scan unroll, variants, dtypes), each variant in turn
(jax_ub, xla, bound: every GEMM kept, the collectives removed), and ends with a table of the
variants side by side: step time, busy and idle time per GPU, and time per kernel kind.
Per HLO instruction it gives wall and kernel time, jax_ub's custom calls summed by op,
shape and where JAX traced them (forward, backward, remat), and the kernels of the largest;
the idle time that ends as a copy on another stream ends; for the bound, its stand-ins' time;
``--no-command-buffers`` (before ``--model``) makes XLA name every instruction instead of
its CUDA graphs. Under ``device_run.sh`` the compiled step's HLO is written to ``$OUT``.

    python benchmarks/tools/profile_train_step.py --no-command-buffers --model llama \\
        --preset llama3-8b --layers 4 --seq 8192 --batch 1 --param-dtype bfloat16 \\
        --scan-unroll 0
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import pathlib
import re
import sys
import tempfile

from profile_kernels import busy_and_span, idle_gaps, kernels
from step_trace import (
    TRACED_STEPS,
    arrival_skew,
    by_hlo_op,
    call_timelines,
    gaps_at_copy_ends,
    gaps_by_hlo_op,
    host_time,
    peer_copies,
    time_in_scope,
    uneven_gpus,
)

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tp_transformer.py"
TOP_KERNELS = 14
KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("attention (cuDNN)", r"cudnn|fmha|flash|sdpa"),
    ("NCCL collective", r"nccl"),
    ("peer copy", r"memcpy|memset"),
    ("jax_ub kernels", r"verifycall|sumchunks|jax_ub|spin"),
    ("GEMM", r"nvjet|gemm|cutlass|xmma|sm90|cublas|triton_.*dot|dot_general"),
    ("other XLA fusions", r"."),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next(kind for kind, pattern in KINDS if re.search(pattern, low))


def short(name: str) -> str:
    """A kernel's kind and the start of its name, for tables."""
    return f"[{kind_of(name)}] {name[:48]}"


def load_example():
    spec = importlib.util.spec_from_file_location("train_tp_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(label: str, step_ms: float, trace_dir: str, ndev: int) -> dict[str, float]:
    """Print where one variant's traced steps spent their GPU time; return its summary
    (ms per step and GPU): span, busy, idle and the time per kernel kind."""
    per_kind: dict[str, float] = collections.defaultdict(float)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, us in kernels(trace_dir):
        per_kind[kind_of(name)] += us
        per_name[name].append(us)
    scale = 1e-3 / TRACED_STEPS / ndev  # us -> ms per step per GPU
    print(f"\n{label}: {step_ms:.2f} ms/step (timed outside the trace)")
    spans = busy_and_span(trace_dir)
    for gpu, (busy, span) in sorted(spans.items()):
        print(
            f"  GPU pid {gpu}: traced steps span {span * 1e-3 / TRACED_STEPS:.2f} ms/step, "
            f"some kernel running {busy * 1e-3 / TRACED_STEPS:.2f}, idle "
            f"{(span - busy) * 1e-3 / TRACED_STEPS:.2f}"
        )
    # Where the idle time sits: gaps summed by the kinds of kernel around them.
    around: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for gaps in idle_gaps(trace_dir).values():
        for us, before, after in gaps:
            around[(short(before), short(after))].append(us)
    print("  idle gaps >= 5 us by (kernel before -> kernel after): ms/step/GPU, gaps/step/GPU")
    for (before, after), v in sorted(around.items(), key=lambda kv: -sum(kv[1]))[:12]:
        per_step = len(v) / TRACED_STEPS / ndev
        print(f"    {sum(v) * scale:6.2f}  {per_step:5.1f}  {before} -> {after}")
    for kind, _ in KINDS:
        print(f"  {kind:20s} {per_kind[kind] * scale:8.2f} ms/step/GPU")
    print("  largest kernels (ms/step/GPU, calls/step/GPU, name):")
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    for name, v in top:
        print(f"    {sum(v) * scale:7.2f}  {len(v) / TRACED_STEPS / ndev:5.1f}  {name[:90]}")
    uneven_gpus(trace_dir)
    busy = sum(b for b, _ in spans.values()) * scale
    span = sum(t for _, t in spans.values()) * scale
    return {"step": step_ms, "span": span, "busy": busy, "idle": span - busy} | {
        kind: per_kind[kind] * scale for kind, _ in KINDS
    }


def side_by_side(summaries: dict[str, dict[str, float]]) -> None:
    """The variants' summaries as one table, ms per step and GPU."""
    names = list(summaries)
    width = {n: max(12, len(n) + 2) for n in names}  # --ub-variants' names are long
    print("\nms per step and GPU" + "".join(f"{n:>{width[n]}s}" for n in names))
    for row in next(iter(summaries.values())):
        print(f"  {row:20s}" + "".join(f"{summaries[n][row]:{width[n]}.2f}" for n in names))


def profile_example(args) -> None:
    """The TP transformer example's step, per impl."""
    example = load_example()
    devices = example.default_devices()
    ndev = len(devices)
    config = dict(seq=args.seq, batch=args.batch, hidden=args.hidden, layers=args.layers,
                  heads=args.heads, vocab=args.vocab, dtype="bfloat16")  # fmt: skip
    print(f"{ndev} x {devices[0].device_kind}, tp={ndev}, {config}")
    summaries = {}
    for impl in args.impls.split(","):
        trace_dir = tempfile.mkdtemp(dir=args.out or None, prefix=f"trace_step_{impl}_")
        result = example.train(
            impl=impl, steps=args.steps, lr=3e-4, devices=devices, progress=False,
            trace_dir=trace_dir, log_every=args.log_every, **config,
        )  # fmt: skip
        label = f"impl={impl} (mean over all steps)"
        summaries[impl] = report(label, 1e3 * result.step_time_s, trace_dir, ndev)
    side_by_side(summaries)


def profile_llama(argv: list[str], out: str) -> None:
    """The Llama-style model's step (jax_ub.bench.model), per variant, one at a time."""
    import time

    import jax

    from jax_ub._src.lowering.unfused import NO_COMMUNICATION_SCOPE as STAND_IN_SCOPE
    from jax_ub.bench import model, timing

    margs = model._parser().parse_args(argv)
    cfg, mesh, tokens = model.setup(margs)
    ndev = mesh.devices.size
    print(f"{ndev} x {mesh.devices.flat[0].device_kind}, mesh {dict(mesh.shape)}, {cfg}")
    summaries = {}
    # --ub-variants: jax_ub under other tuning choices, after the named variants.
    variants = [v for v in margs.variants.split(",") if v] + list(margs.ub_variants)
    for variant in variants:
        tag = re.sub(r"[^\w.-]", "_", variant)  # for file names
        step, state, _ = model.compiled_step(variant, cfg, mesh, tokens, margs)
        for _ in range(1 + margs.warmup):  # past autotuning and jax_ub's GEMM trials
            state, loss = step(state, tokens)
        jax.block_until_ready(loss)
        before = timing.host_times()
        t0 = time.perf_counter()
        for _ in range(margs.steps):
            state, loss = step(state, tokens)
        dispatch_ms = (time.perf_counter() - t0) / margs.steps * 1e3
        jax.block_until_ready(loss)
        step_ms = (time.perf_counter() - t0) / margs.steps * 1e3
        # Host-bound if the host needs about as long to enqueue a step as the GPUs to run it.
        print(f"{variant}: the host enqueued a step in {dispatch_ms:.2f} ms (of {step_ms:.2f})")
        for gpu, (calls, total_s, await_s) in sorted(timing.host_times().items()):
            c0, t0_s, a0_s = before.get(gpu, (0, 0.0, 0.0))
            if calls > c0:
                n = calls - c0
                print(
                    f"  GPU {gpu}: {n / margs.steps:.0f} jax_ub calls/step, host "
                    f"{(total_s - t0_s) / n * 1e6:.0f} us/call, of which "
                    f"{(await_s - a0_s) / n * 1e6:.0f} us waiting for the other GPUs' threads"
                )
        trace_dir = tempfile.mkdtemp(dir=out or None, prefix=f"trace_llama_{tag}_")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(TRACED_STEPS):
                state, loss = step(state, tokens)
            jax.block_until_ready(loss)
        del state  # one variant's params and optimizer state on the devices at a time
        label = f"{variant} (loss {float(loss):.5f}, mean of {margs.steps} steps)"
        summaries[variant] = report(label, step_ms, trace_dir, ndev)
        # The bound's copies and sums in place of the collectives: work that an overlapped
        # op does not do, so the bound less them is the GEMMs' own bound.
        hlo = step.as_text()  # megabytes of text for a real model: made once
        stand_in_ms, launches = time_in_scope(trace_dir, ndev, hlo, STAND_IN_SCOPE)
        summaries[variant]["bound's stand-ins"] = stand_in_ms
        if stand_in_ms:
            print(
                f"  the bound's stand-ins for the collectives (copies of rows, row-block sums, "
                f"their gradients): {stand_in_ms:.2f} ms/step/GPU in {launches:.0f} "
                f"kernels/step/GPU; the step less their time: {step_ms - stand_in_ms:.2f} ms"
            )
        by_hlo_op(trace_dir, ndev, hlo)
        gaps_by_hlo_op(trace_dir, ndev, hlo)
        gaps_at_copy_ends(trace_dir, ndev, hlo)
        peer_copies(trace_dir, hlo)
        call_timelines(trace_dir, hlo)
        arrival_skew(trace_dir, hlo)
        host_time(trace_dir)
        hlo_dir = out or os.environ.get("OUT")  # device_run.sh's output folder
        if hlo_dir:  # the compiled step, for reading what ran
            pathlib.Path(hlo_dir, f"hlo_{tag}.txt").write_text(hlo)
    side_by_side(summaries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="example",
        choices=["example", "llama"],
        help="example: examples/train_tp_transformer.py (default); llama: "
        "jax_ub.bench.model's step, the arguments that follow being that benchmark's",
    )
    for name, default in (("seq", 8192), ("batch", 1), ("hidden", 8192), ("layers", 1),
                          ("heads", 64), ("vocab", 1024), ("steps", 8)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--impls", default="auto,xla")
    ap.add_argument("--log-every", type=int, help="the example's: wait for the loss every N steps")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="run every HLO instruction as its own launch (no CUDA graphs), so the per-"
        "instruction table names each fusion and GEMM instead of command_buffer_N",
    )
    argv = sys.argv[1:]
    # After "--model llama" every argument is the model benchmark's (--seq, --layers and
    # --batch mean the same there, for another model).
    cut = next((i for i in range(len(argv) - 1) if argv[i : i + 2] == ["--model", "llama"]), None)
    args = ap.parse_args(argv if cut is None else argv[: cut + 2])
    if args.no_command_buffers:  # read when JAX starts its GPU backend, so set it first
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
        )
    if args.model == "llama":
        profile_llama(argv[cut + 2 :], args.out)
        return
    profile_example(args)


if __name__ == "__main__":
    main()
