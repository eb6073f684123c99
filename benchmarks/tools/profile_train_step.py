"""Where the TP transformer's training step spends its GPU time, jax_ub vs XLA collectives.

python benchmarks/tools/profile_train_step.py --hidden 8192 --seq 8192 --layers 1 --batch 1 \\
    --heads 64 --vocab 1024 [--steps 8] [--out DIR]

Trains `examples/train_tp_transformer.py`'s model for a few steps per impl, traces the last
three with JAX's profiler (CUPTI, no nsys needed) and prints, per step and GPU, the summed
duration of the device kernels by kind (GEMMs, attention, collectives, copies, jax_ub's own
kernels, other XLA fusions) and the largest kernels. Kernels on different streams overlap,
so the sums can exceed the step time. Per GPU it also prints how much of the traced steps
some kernel was running (copies excluded) and how long the GPU sat idle.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import pathlib
import re
import tempfile

from profile_kernels import busy_and_span, idle_gaps, kernels

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_tp_transformer.py"
TRACED_STEPS = 3
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("seq", 8192), ("batch", 1), ("hidden", 8192), ("layers", 1),
                          ("heads", 64), ("vocab", 1024), ("steps", 8)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--impls", default="auto,xla")
    ap.add_argument("--log-every", type=int, help="the example's: wait for the loss every N steps")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    example = load_example()
    devices = example.default_devices()
    ndev = len(devices)
    config = dict(seq=args.seq, batch=args.batch, hidden=args.hidden, layers=args.layers,
                  heads=args.heads, vocab=args.vocab, dtype="bfloat16")  # fmt: skip
    print(f"{ndev} x {devices[0].device_kind}, tp={ndev}, {config}")
    for impl in args.impls.split(","):
        trace_dir = tempfile.mkdtemp(dir=args.out or None, prefix=f"trace_step_{impl}_")
        result = example.train(
            impl=impl, steps=args.steps, lr=3e-4, devices=devices, progress=False,
            trace_dir=trace_dir, log_every=args.log_every, **config,
        )  # fmt: skip
        per_kind: dict[str, float] = collections.defaultdict(float)
        per_name: dict[str, list[float]] = collections.defaultdict(list)
        for name, us in kernels(trace_dir):
            per_kind[kind_of(name)] += us
            per_name[name].append(us)
        scale = 1e-3 / TRACED_STEPS / ndev  # us -> ms per step per GPU
        print(f"\nimpl={impl}: {1e3 * result.step_time_s:.2f} ms/step (mean over all steps)")
        for gpu, (busy, span) in sorted(busy_and_span(trace_dir).items()):
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
        top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:14]
        for name, v in top:
            print(f"    {sum(v) * scale:7.2f}  {len(v) / TRACED_STEPS / ndev:5.1f}  {name[:90]}")


if __name__ == "__main__":
    main()
