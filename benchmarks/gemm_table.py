"""The per-GPU GEMMs of Llama 3 8B, 70B and 405B's projections at tp 1-8, timed on one GPU:
jax_ub's own GEMM (an op on a group of one: no communication) beside XLA's dot and torch's
cuBLAS (its heuristic pick), forward and forward + backward (the input's and the weight's
gradients: ``dY @ W^T`` and ``X^T @ dY``), bf16; with ``--fp8``, the forward GEMM in
float8_e4m3fn beside XLA's fp8 dot and ``torch._scaled_mm``.

Each projection at each tp is the GEMM one rank runs for ``--tokens`` gathered rows:
column-parallel (qkv, gate/up: all-gather then GEMM) ``tokens x hidden x out/tp``,
row-parallel (o, down: GEMM then reduce-scatter) ``tokens x in/tp x hidden``.

Method: per row, every implementation in turn, a loop of async calls lasting at least
``--seconds`` (synced after every >= 30 ms of calls: a sync drains the GPU, and JAX's next
program waits for its dispatch), ``--rounds`` rounds interleaved (with ``--slot-ms``, each
round in slots of loops that long, the implementations in turn, each slot weighed against its
turn's mean: a power-capped clock's dips slow a turn's slots alike, not one whole loop; in a
simulated H100 clock, 20% slower 0.3 s of each second, one loop a round read ratios up to
18% off, slots true, ``test_gemm_table_slots.py``); the median of the rounds (ms per
GEMM), and the spread (max - min over median) of the row's slowest-moving implementation.
jax_ub's ratio is to the fastest of XLA and torch in the same row. That minimum of two noisy
medians reads low, so every ratio to it reads high: XLA's own program is timed a second time
as another implementation, and its ratio to the same fastest ("XLA again") is what an equal
GEMM scores; jax_ub is slower only by what it exceeds that. Each call runs ``--per-call``
GEMMs of the row on as many distinct inputs (one jitted program for JAX, as a training step
dispatches its ops; torch launches each): at 1, a loop of small GEMMs also times JAX's
dispatch of one program per GEMM, and jax_ub's handler (its host time per call is printed:
where it and the dispatch exceed the GEMM, the GPU waits for the host). The last column names
the kernel jax_ub runs for the forward GEMM (its description and place in cuBLASLt's heuristic
list: ``device_run.sh gemm M,K,N`` times every place). With ``--ub-variant``, jax_ub's
programs again under other tuning choices (``autotune_gemm=False``: cuBLASLt's first pick,
untuned), as "variant /" columns, and its kernel in a last column. Last, the
rows' ratios as one table (a projection a line, a tp a column), torch / XLA beside them, the
variant's in brackets.

python benchmarks/gemm_table.py [--models 8b,70b] [--tp 1,2,4,8] [--projections qkv,o]
    [--fp8] [--seconds 0.3] [--slot-ms 30] [--per-call 8] [--ub-variant autotune_gemm=False]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # torch shares the GPU
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gemm_sources import check_close, jax_loop, loop_ms, own_gemm  # noqa: E402

from jax_ub._src.settings.options import current_options  # noqa: E402
from jax_ub.bench.impls import compiled_with, configured, parse_variants  # noqa: E402

# name: (hidden, qkv out, ffn); Llama 3's (head dim 128, 8 kv heads).
MODELS = {
    "tiny": (256, 384, 512),
    "8b": (4096, 6144, 14336),
    "70b": (8192, 10240, 28672),
    "405b": (16384, 18432, 53248),
}


def projections(model: str, tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of one rank's forward GEMM for each projection of ``model``."""
    h, qkv, ffn = MODELS[model]
    return [
        (f"{model} qkv", tokens, h, qkv // tp),
        (f"{model} o", tokens, h // tp, h),
        (f"{model} gate/up", tokens, h, 2 * ffn // tp),
        (f"{model} down", tokens, ffn // tp, h),
    ]


def _each(f):
    """``f`` over a list of inputs sharing the second operand, as one jitted program."""
    return jax.jit(lambda xs, w: [f(x, w) for x in xs])


def bf16_impls(m: int, k: int, n: int, torch, per_call: int, variant: dict | None) -> dict:
    """name -> (step, sync) for the forward and the forward + backward of each source, each
    step ``per_call`` GEMMs (forward) or GEMM triples on distinct inputs; with ``variant``
    (tuning choices), jax_ub's programs again, compiled under it, as the source "var"."""
    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, jnp.bfloat16)

    # Distinct inputs per GEMM: XLA would compute identical dots once (jax_ub's calls have
    # a side effect and never merge), which is not the work being timed.
    As = [normal(m, k) for _ in range(per_call)]
    b = normal(k, n, scale=0.02)
    Gs = [normal(m, n) for _ in range(per_call)]

    def with_grads(f):
        def run(As, b, Gs):
            out = []
            for a, g in zip(As, Gs, strict=True):
                y, vjp = jax.vjp(f, a, b)
                out.append((y, *vjp(g)))
            return out

        return jax.jit(run)

    matmul, ub = (lambda a, b: a @ b), own_gemm()
    fwd = {"xla": _each(matmul), "ub": _each(ub)}
    grads = {"xla": with_grads(matmul), "ub": with_grads(ub)}
    fwd["again"], grads["again"] = fwd["xla"], grads["xla"]  # timed twice: the noise gauge
    sources = ["xla", "ub", "again"]
    if variant is not None:
        # A communicator takes its tuning when it is made, at lowering: compiled now.
        fwd["var"] = compiled_with(variant, fwd["ub"], As, b)
        grads["var"] = compiled_with(variant, grads["ub"], As, b, Gs)
        sources.append("var")
    impls = {}
    for src in sources:
        impls[f"{src} fwd"] = jax_loop(fwd[src], As, b)
        impls[f"{src} fwd+bwd"] = jax_loop(grads[src], As, b, Gs)
    ours = [
        f"{src} {kind}" for src in sources if src in ("ub", "var") for kind in ("fwd", "fwd+bwd")
    ]
    for name in ours:  # past the op's kernel trials
        for _ in range(-(-40 // per_call)):
            impls[name][0]()
        impls[name][1]()
    # The timed programs themselves, checked on every GEMM of a call.
    check_close("bf16 fwd", fwd["ub"](As, b), fwd["xla"](As, b))
    check_close("bf16 fwd+bwd", grads["ub"](As, b, Gs), grads["xla"](As, b, Gs))
    if variant is not None:
        check_close("bf16 fwd, the variant", fwd["var"](As, b), fwd["xla"](As, b))
        check_close("bf16 fwd+bwd, the variant", grads["var"](As, b, Gs), grads["xla"](As, b, Gs))
    if torch is not None:

        def to_torch(x):  # the same device memory, no host round trip
            return torch.from_dlpack(x)

        tAs, tb, tGs = [to_torch(a) for a in As], to_torch(b), [to_torch(g) for g in Gs]
        sync = torch.cuda.synchronize

        def t_fwd():
            return [torch.mm(ta, tb) for ta in tAs]

        def t_all():  # what autograd runs for y = a @ b
            return [
                (torch.mm(ta, tb), torch.mm(tg, tb.t()), torch.mm(ta.t(), tg))
                for ta, tg in zip(tAs, tGs, strict=True)
            ]

        impls["torch fwd"], impls["torch fwd+bwd"] = (t_fwd, sync), (t_all, sync)
    return impls


def fp8_impls(m: int, k: int, n: int, torch, per_call: int) -> dict:
    """name -> (step, sync): the fp8 forward GEMM (operands already quantized, bf16 out),
    ``per_call`` of them on distinct inputs per step."""
    from jax_ub import fp8  # noqa: PLC0415
    from jax_ub.bench.impls import _fp8_scales  # noqa: PLC0415

    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((m, k), np.float32) for _ in range(per_call)]
    w = rng.standard_normal((k, n), np.float32) * 0.02
    sx, sw, scales = _fp8_scales(xs[0], w)
    xqs = [fp8.quantize(jnp.asarray(x), sx) for x in xs]
    wq = fp8.quantize(jnp.asarray(w), sw)
    ub, xla = _each(own_gemm("ub", fp8=scales)), _each(own_gemm("xla", fp8=scales))
    impls = {"xla fp8": jax_loop(xla, xqs, wq), "ub fp8": jax_loop(ub, xqs, wq)}
    impls["again fp8"] = jax_loop(xla, xqs, wq)  # the noise gauge
    check_close("fp8", ub(xqs, wq), xla(xqs, wq))
    for _ in range(-(-40 // per_call)):
        impls["ub fp8"][0]()
    impls["ub fp8"][1]()
    if torch is not None:
        tas = [
            torch.from_numpy(np.array(xq.astype(jnp.float32))).cuda().to(torch.float8_e4m3fn)
            for xq in xqs
        ]
        # _scaled_mm takes its second operand column-major.
        tb = torch.from_numpy(np.asarray(wq.astype(jnp.float32)).T.copy()).cuda()
        tb = tb.to(torch.float8_e4m3fn).t()
        tsx = torch.tensor(float(sx), device="cuda")
        tsw = torch.tensor(float(sw), device="cuda")

        def t_fp8():
            return [torch._scaled_mm(ta, tb, tsx, tsw, out_dtype=torch.bfloat16) for ta in tas]

        impls["torch fp8"] = (t_fp8, torch.cuda.synchronize)
    return impls


def time_row(
    impls: dict, seconds: float, rounds: int, per_call: int, slot_s: float = 0.0
) -> tuple[dict, dict]:
    """Per implementation: ms per GEMM (per ``per_call``-GEMM step) in each round; and per
    jax_ub implementation, the host us of its handler per op call (all loops). Each round
    runs every implementation for ``seconds``: one loop each, or with ``slot_s``, in slots
    of loops that long, every implementation in turn (the turns alternate direction) until
    each ran its ``seconds``, the round's time its slots' median share of their turns' mean:
    a power-capped clock's dips (on one H100 ~20% for ~0.3 s of every second) then slow all
    of a turn's slots alike, not one implementation's whole loop."""
    from jax_ub.bench.timing import _host_ms_per_call, host_times, round_order  # noqa: PLC0415

    times: dict[str, list[float]] = {name: [] for name in impls}
    host: dict[str, list[float]] = {}

    def loop(name: str, loop_s: float) -> float:
        step, sync = impls[name]
        before = host_times() if name.startswith("ub") else None
        ms = loop_ms(step, sync, loop_s) / per_call
        # None without GPUs (the CPU ops keep no such count)
        per = _host_ms_per_call(before, host_times()) if before is not None else None
        if per is not None:
            host.setdefault(name, []).append(1e3 * per[0])
        return ms

    slot = slot_s if slot_s > 0 else seconds  # without slots: one loop of seconds a round
    for r in range(rounds):
        order = round_order(impls, r)
        # Turns until every implementation ran its seconds (a slot of a row's longest calls
        # outlasts slot_s: its first block is 10 calls).
        slots: dict[str, list[float]] = {name: [] for name in impls}
        spent = dict.fromkeys(impls, 0.0)
        turn = 0
        while min(spent.values()) < seconds:
            for name in order if turn % 2 == 0 else order[::-1]:
                began = time.perf_counter()
                slots[name].append(loop(name, slot))
                spent[name] += time.perf_counter() - began
            turn += 1
        # Each slot over its turn's geometric mean, the median of that over the turns, times
        # the turns' median mean: a turn (tens of ms) runs at one clock, and a dip that takes
        # most of a round's slots (0.3 s of a 0.4 s round) then moves no ratio. One loop a
        # round is one turn: its own time.
        turns = len(min(slots.values(), key=len))
        means = [statistics.geometric_mean(ms[t] for ms in slots.values()) for t in range(turns)]
        for name, ms in slots.items():
            share = statistics.median(ms[t] / means[t] for t in range(turns))
            times[name].append(share * statistics.median(means))
    return times, host


def picked(m: int, k: int, n: int, options) -> str:
    """The kernel jax_ub runs for the forward GEMM on its communicators made with `options`
    (the op's, or the variant's): its description (``col``: C^T = B^T A^T, column-major;
    ``row``: row-major) and place in cuBLASLt's heuristic list, which ``device_run.sh gemm
    M,K,N`` times one by one ("?" while its trials still compare; empty without GPUs)."""
    from jax_ub.bench.timing import kernel_choices  # noqa: PLC0415

    picks = {f"{'row' if row else 'col'} #{i}{'?' if deciding else ''}"
             for _, row, i, deciding in kernel_choices(options).get((m, k, n), [])}  # fmt: skip
    return ", ".join(sorted(picks))


def medians(times: dict[str, list[float]], kinds: tuple[str, ...]) -> tuple[dict, dict]:
    """Each implementation's median ms, and per kind the fastest peer's (XLA or torch)."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = {
        kind: min(med[f"{s} {kind}"] for s in ("xla", "torch") if f"{s} {kind}" in med)
        for kind in kinds
    }
    return med, fastest


def report(label: str, times: dict[str, list[float]], kinds: tuple[str, ...], host: dict) -> str:
    """One table row: per kind, each source's median ms, jax_ub / the fastest peer and XLA
    again / the same; then the spread and jax_ub's host us per op call (first kind)."""
    med, fastest_of = medians(times, kinds)
    spread = max((max(ts) - min(ts)) / statistics.median(ts) for ts in times.values())
    cells = [label]
    for kind in kinds:
        fastest = fastest_of[kind]
        ub = med[f"ub {kind}"]
        cells += [f"{med.get(f'{s} {kind}', float('nan')):.3f}" for s in ("xla", "torch")]
        cells += [f"{ub:.3f}", f"{ub / fastest:.3f}", f"{med[f'again {kind}'] / fastest:.3f}"]
        if f"var {kind}" in med:
            cells.append(f"{med[f'var {kind}'] / fastest:.3f}")
    cells.append(f"{100 * spread:.1f}%")
    us = host.get(f"ub {kinds[0]}")
    cells.append(f"{statistics.median(us):.0f}" if us else "")
    return "| " + " | ".join(cells) + " |"


def ratios(times: dict[str, list[float]], kinds: tuple[str, ...]) -> str:
    """A summary cell: per kind jax_ub / the fastest of XLA and torch ("; " between kinds),
    the variant's in brackets (where one ran), then torch / XLA of the first kind in
    parentheses (where torch ran)."""
    med, fastest = medians(times, kinds)
    cells = [f"{med[f'ub {kind}'] / fastest[kind]:.3f}" for kind in kinds]
    if f"var {kinds[0]}" in med:
        var = "; ".join(f"{med[f'var {kind}'] / fastest[kind]:.3f}" for kind in kinds)
        cells[-1] += f" [{var}]"
    torch_ms = med.get(f"torch {kinds[0]}")
    vs_torch = f" ({torch_ms / med[f'xla {kinds[0]}']:.3f})" if torch_ms is not None else ""
    return "; ".join(cells) + vs_torch


def summary(cells: dict[tuple[str, int], str], tps: list[int]) -> str:
    """The rows' ratios as one table, a projection a line and a tp a column."""
    names = list(dict.fromkeys(name for name, _ in cells))
    lines = ["| projection | " + " | ".join(f"tp={tp}" for tp in tps) + " |"]
    lines.append("|" + " --- |" * (len(tps) + 1))
    for name in names:
        lines.append(f"| {name} | " + " | ".join(cells.get((name, tp), "") for tp in tps) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8b,70b,405b")
    ap.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes")
    ap.add_argument("--tokens", type=int, default=8192, help="gathered rows per GEMM")
    ap.add_argument(
        "--most-tflop",
        type=float,
        default=8.0,
        help="skip a row whose forward GEMM is more TFLOP than this",
    )
    ap.add_argument(
        "--projections",
        default="qkv,o,gate/up,down",
        help="which projections of each model (comma list)",
    )
    ap.add_argument("--fp8", action="store_true", help="fp8 forward rows instead of bf16")
    ap.add_argument(
        "--ub-variant",
        default="",
        help='jax_ub again under other tuning choices, e.g. "autotune_gemm=False" (bf16)',
    )
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--slot-ms",
        type=float,
        default=0.0,
        help="each round in slots this long, the implementations in turn (0: a loop each)",
    )
    ap.add_argument(
        "--per-call",
        type=int,
        default=8,
        help="GEMMs per timed call, on distinct inputs (1: one dispatch per GEMM)",
    )
    args = ap.parse_args()
    if args.per_call < 1:
        ap.error(f"--per-call must be at least 1, got {args.per_call}")
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        torch = None
    wanted = set(args.projections.split(","))
    if not wanted <= {"qkv", "o", "gate/up", "down"}:
        ap.error(f"--projections: qkv, o, gate/up or down, got {args.projections!r}")
    kinds = ("fp8",) if args.fp8 else ("fwd", "fwd+bwd")
    try:
        variants = parse_variants(args.ub_variant)
    except ValueError as e:
        ap.error(f"--ub-variant: {e}")
    if len(variants) > 1 or (variants and args.fp8):
        ap.error(f"--ub-variant: one variant, of the bf16 rows; got {args.ub_variant!r}")
    variant = variants[0] if variants else None
    head = ["projection M x K x N (tp)"]
    for kind in kinds:
        head += [f"{kind}: XLA ms", "torch ms", "jax_ub ms", "jax_ub / fastest", "XLA again /"]
        head += ["variant /"] if variant is not None else []
    head += ["spread", "jax_ub host us/op call", "jax_ub kernel"]
    head += ["variant kernel"] if variant is not None else []
    # The communicators' options, the op's and the variant's: whose kernels each column names.
    made_with = [current_options()]
    if variant is not None:
        with configured(variant):
            made_with.append(current_options())
    print(f"GEMMs per call: {args.per_call}")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head), flush=True)
    cells: dict[tuple[str, int], str] = {}
    tps = [int(tp) for tp in args.tp.split(",")]
    for model in args.models.split(","):
        for tp in tps:
            for name, m, k, n in projections(model, tp, args.tokens):
                if name.split(" ")[1] not in wanted or 2 * m * k * n > args.most_tflop * 1e12:
                    continue
                if args.fp8:
                    impls = fp8_impls(m, k, n, torch, args.per_call)
                else:
                    impls = bf16_impls(m, k, n, torch, args.per_call, variant)
                times, host = time_row(
                    impls, args.seconds, args.rounds, args.per_call, args.slot_ms / 1e3
                )
                row = report(f"{name} {m}x{k}x{n} (tp{tp})", times, kinds, host)
                cells[(name, tp)] = ratios(times, kinds)
                kernels = " | ".join(picked(m, k, n, options) for options in made_with)
                print(f"{row} {kernels} |", flush=True)
                # This row's inputs and each loop's last outputs go before the next row's
                # come: a 70B row holds ~20 GB, and two of them ran an H100's share (0.4 of
                # 80 GB) out of memory.
                del impls
                if torch is not None:
                    torch.cuda.empty_cache()
    print(f"\njax_ub / the fastest of XLA and torch, {'; '.join(kinds)} (torch / XLA, {kinds[0]}):")
    print(summary(cells, tps))


if __name__ == "__main__":
    main()
