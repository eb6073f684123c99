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

from profile_kernels import busy_and_span, device_events, idle_gaps, kernels, trace_events

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tp_transformer.py"
TRACED_STEPS = 3
TOP_KERNELS = 14
HLO_ROWS = 30
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


def uneven_gpus(trace_dir: str) -> None:
    """Print the kernels whose time differs most between the GPUs (ms/step, per GPU): the
    same program on every GPU, so a GPU doing more is slowed (clocks, memory traffic), and
    at each collective the others wait for it."""
    per: dict[str, dict[int, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    pids = set()
    for e in device_events(trace_dir):
        per[e["name"][:70]][e["pid"]] += float(e["dur"])
        pids.add(e["pid"])
    if len(pids) < 2:
        return
    pids = sorted(pids)
    spread = {n: max(v[p] for p in pids) - min(v[p] for p in pids) for n, v in per.items()}
    print("  kernels differing most between GPUs (ms/step per GPU):")
    for name in sorted(spread, key=lambda n: -spread[n])[:8]:
        cells = " ".join(f"{per[name][p] * 1e-3 / TRACED_STEPS:7.2f}" for p in pids)
        print(f"    {cells}  {name}")


def describe_custom_calls(hlo_text: str) -> dict[str, str]:
    """Custom-call instruction name -> its target, result shape and whether it is in the
    backward pass (``transpose(`` in its op name): one row per op and shape."""
    described = {}
    for line in hlo_text.splitlines():
        m = re.search(r"%?([\w.\-]+) = ((?:\([^)]*\))|\S+) custom-call\(", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if not (m and target):
            continue
        shape = re.sub(r"\{[\d,]*\}", "", m.group(2))  # layouts say nothing here
        bwd = " (bwd)" if "transpose(" in line else ""
        tw = " w.T" if "transpose_w = true" in line else ""
        # Where JAX traced it (autodiff, remat, scan), without the jit and the op itself.
        op_name = re.search(r'op_name="([^"]+)"', line)
        where = op_name.group(1).split("/")[1:-1] if op_name else []
        where = "/".join(w for w in where if w != "shard_map")
        described[m.group(1)] = (
            f"{target.group(1).removeprefix('jax_ub_')}{tw} -> {shape}{bwd} [{where}]"
        )
    return described


def by_hlo_op(trace_dir: str, ndev: int, hlo_text: str) -> None:
    """Print the HLO instructions whose kernels took the most GPU time (the trace's
    ``hlo_op`` annotation), custom calls of one target and shape summed over their
    instances (the layers'): which op's GEMMs run long, where kernel names do not say.
    Per row: the instances' wall time (_walls), their kernels' time without copies, and
    how many instructions it sums; then the kernels of the largest jax_ub rows."""
    described = describe_custom_calls(hlo_text)
    events: dict[tuple[int, str], list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        op = e.get("args", {}).get("hlo_op")
        if op:
            start = float(e["ts"])
            events[(e["pid"], op)].append((start, start + float(e["dur"]), e["name"]))
    if not events:
        print("  (the trace names no HLO instructions)")
        return
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    rows: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, set()])
    kernels_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    walls = _walls(trace_dir)
    for (pid, op), evs in events.items():
        row = rows[described.get(op, op)]
        row[0] += walls[(pid, op)]
        for a, b, name in evs:
            if not copy.search(name):
                row[1] += b - a
            kernels_of[described.get(op, op)][name[:60]] += b - a
            calls_of[described.get(op, op)][name[:60]] += 1
        row[2].add(op)
    scale = 1e-3 / TRACED_STEPS / ndev
    print(
        "  HLO instructions by wall time (ms/step/GPU: wall, kernels without copies; "
        "instructions; what):"
    )
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
    for what, (wall, busy, ops) in ranked[:HLO_ROWS]:
        print(f"    {wall * scale:7.2f} {busy * scale:7.2f}  {len(ops):4d}  {what}")
    for what, _ in [kv for kv in ranked if kv[0] in described.values()][:6]:
        print(f"  kernels of {what} (ms/step/GPU, launches/step/GPU):")
        for name, us in kernels_of[what].most_common(6):
            n = calls_of[what][name] / TRACED_STEPS / ndev
            print(f"      {us * scale:7.2f}  {n:5.1f}  {name}")


def gaps_by_hlo_op(trace_dir: str, ndev: int, hlo_text: str, min_us: float = 5.0) -> None:
    """Print the GPUs' idle stretches (no kernel running, copies aside) summed by the HLO
    instructions around them: a gap inside one jax_ub call (the same instruction on both
    sides) is that call waiting on a peer; one between instructions is XLA's or the host's."""
    described = describe_custom_calls(hlo_text)
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        if copy.search(e["name"]):
            continue
        op = e.get("args", {}).get("hlo_op", "?")
        start = float(e["ts"])
        per_gpu[e["pid"]].append((start, start + float(e["dur"]), described.get(op, op)))
    around: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for iv in per_gpu.values():
        iv.sort()
        end, last = iv[0][1], iv[0][2]
        for a, b, op in iv[1:]:
            if a - end >= min_us:
                around[(last, op)].append(a - end)
            if b > end:
                end, last = b, op
    # A gap the host caused: the kernel after it was launched (its API call on the host
    # began) only after the GPU had run out of work.
    launched = {}
    for e in trace_events(trace_dir):
        cid = e.get("args", {}).get("correlation_id")
        if cid is not None and e.get("ph") == "X" and e.get("pid") not in per_gpu:
            launched[int(cid)] = float(e["ts"])
    starved = [0.0, 0]
    for e_list in _gaps_after(trace_dir, min_us):
        for gap_start, gap_us, cid in e_list:
            if cid is not None and launched.get(cid, -1.0) > gap_start:
                starved[0] += gap_us
                starved[1] += 1
    scale = 1e-3 / TRACED_STEPS / ndev
    print(
        f"  idle waiting for the host's launch: {starved[0] * scale:.2f} ms/step/GPU in "
        f"{starved[1] / TRACED_STEPS / ndev:.1f} gaps/step/GPU (of the gaps >= {min_us} us)"
    )
    print("  idle gaps by HLO instruction (ms/step/GPU, gaps/step/GPU; before -> after):")
    for (before, after), v in sorted(around.items(), key=lambda kv: -sum(kv[1]))[:HLO_ROWS]:
        where = f"within {before}" if before == after else f"{before}  ->  {after}"
        print(f"    {sum(v) * scale:6.2f}  {len(v) / TRACED_STEPS / ndev:5.1f}  {where[:230]}")


def _gaps_after(trace_dir: str, min_us: float) -> list[list[tuple[float, float, int | None]]]:
    """Per GPU: (start, microseconds, correlation id of the kernel that ended it) of each
    idle stretch of at least `min_us` (copies aside)."""
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, int | None]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        if not copy.search(e["name"]):
            cid = e.get("args", {}).get("correlation_id")
            start = float(e["ts"])
            per_gpu[e["pid"]].append((start, start + float(e["dur"]), cid and int(cid)))
    out = []
    for iv in per_gpu.values():
        iv.sort()
        gaps, end = [], iv[0][1]
        for a, b, cid in iv[1:]:
            if a - end >= min_us:
                gaps.append((end, a - end, cid))
            end = max(end, b)
        out.append(gaps)
    return out


def _walls(trace_dir: str) -> dict[tuple[int, str], float]:
    """Per (GPU, HLO instruction): the summed wall time of its runs, a run lasting from its
    first kernel's start to its last event's end, and ending where another instruction's
    kernel starts (copies, on streams of their own, end none): a loop's instruction runs
    once per iteration."""
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, str, bool]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        op = e.get("args", {}).get("hlo_op")
        if op:
            start = float(e["ts"])
            per_gpu[e["pid"]].append(
                (start, start + float(e["dur"]), op, bool(copy.search(e["name"])))
            )
    walls: dict[tuple[int, str], float] = collections.defaultdict(float)
    for pid, evs in per_gpu.items():
        evs.sort()
        op, first, last = None, 0.0, 0.0
        for a, b, this, is_copy in evs + [(0.0, 0.0, None, False)]:
            if this == op:
                last = max(last, b)
            elif not is_copy:
                if op is not None:
                    walls[(pid, op)] += last - first
                op, first, last = this, a, b
    return walls


def side_by_side(summaries: dict[str, dict[str, float]]) -> None:
    """The variants' summaries as one table, ms per step and GPU."""
    names = list(summaries)
    print("\nms per step and GPU" + "".join(f"{n:>12s}" for n in names))
    for row in next(iter(summaries.values())):
        print(f"  {row:20s}" + "".join(f"{summaries[n][row]:12.2f}" for n in names))


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

    from jax_ub.bench import model, timing

    margs = model._parser().parse_args(argv)
    cfg, mesh, tokens = model.setup(margs)
    ndev = mesh.devices.size
    print(f"{ndev} x {mesh.devices.flat[0].device_kind}, mesh {dict(mesh.shape)}, {cfg}")
    summaries = {}
    for variant in margs.variants.split(","):
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
        trace_dir = tempfile.mkdtemp(dir=out or None, prefix=f"trace_llama_{variant}_")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(TRACED_STEPS):
                state, loss = step(state, tokens)
            jax.block_until_ready(loss)
        del state  # one variant's params and optimizer state on the devices at a time
        label = f"{variant} (loss {float(loss):.5f}, mean of {margs.steps} steps)"
        summaries[variant] = report(label, step_ms, trace_dir, ndev)
        by_hlo_op(trace_dir, ndev, step.as_text())
        gaps_by_hlo_op(trace_dir, ndev, step.as_text())
        hlo_dir = out or os.environ.get("OUT")  # device_run.sh's output folder
        if hlo_dir:  # the compiled step, for reading what ran
            pathlib.Path(hlo_dir, f"hlo_{variant}.txt").write_text(step.as_text())
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
