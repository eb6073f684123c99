"""What ``python -m jax_ub.bench.model`` prints once its variants have run: per variant the
step time, its spread, tokens/s, MFU, memory and the ratios to the no-communication bounds
and to the best XLA variant; then every variant's first loss against XLA's, which ends the
run with an error where one differs."""

from __future__ import annotations

import sys


def report(results: dict, args, cfg, say) -> None:
    """The table of the variants' results (`cfg`: the model's LlamaConfig), then the check
    of their first losses against XLA's."""
    import jax  # noqa: PLC0415

    device = jax.devices()[0]
    peak = args.peak_tflops
    if peak is None and any(kind in device.device_kind for kind in ("H100", "H200")):
        peak = 989.0  # H100/H200 SXM dense bf16, datasheet
    n_dev = (len(jax.devices()) // args.tp) * args.tp
    tokens = args.batch * args.seq
    rows = {v: r for v, r in results.items() if not v.startswith("_") and r}
    xla = [rows[v]["step_ms"] for v in ("xla", "xla_overlap") if v in rows]
    bound = rows.get("bound", {}).get("step_ms")
    bound_ub = rows.get("bound_ub", {}).get("step_ms")
    say(
        f"\n{args.preset} x{cfg.layers} layers, seq {args.seq}, batch {args.batch}, "
        f"{args.dtype} (params {args.param_dtype}), fp8 {args.fp8}, remat {args.remat}, "
        f"scan unroll {args.scan_unroll or 'all'}, "
        f"{n_dev} x {device.device_kind}"
        + (f", MFU against {peak:g} TFLOP/s per device" if peak else "")
    )
    say(
        f"{'variant':12s} {'step ms':>9s} {'spread':>7s} {'tokens/s':>10s} {'MFU':>6s} "
        f"{'XLA GiB':>8s} {'ub GiB':>7s} {'/bound':>7s} {'/bound_ub':>9s} {'/best XLA':>9s} "
        f"{'first loss':>11s}"
    )
    for v, r in rows.items():
        ms = r["step_ms"]
        tps = tokens / ms * 1e3
        mfu = cfg.flops_per_token(args.seq) * tps / (n_dev * peak * 1e12) if peak else None
        mem = r["memory_bytes"] / 2**30 if r["memory_bytes"] else float("nan")  # CPU: none
        ub = r.get("userbuffer_bytes", 0) / 2**30
        say(
            f"{v:12s} {ms:9.2f} {100 * r['spread']:6.1f}% {tps:10.0f} "
            f"{'' if mfu is None else f'{100 * mfu:5.1f}%':>6s} {mem:8.2f} {ub:7.2f} "
            f"{'' if not bound else f'{ms / bound:7.3f}':>7s} "
            f"{'' if not bound_ub else f'{ms / bound_ub:9.3f}':>9s} "
            f"{'' if not xla else f'{ms / min(xla):9.3f}':>9s} {r['first_loss']:11.5f}"
        )
    processes = results.get("_processes")
    if processes:
        say(
            f"step ms: the median over {processes} processes of each one's median round; "
            "spread: across those medians"
        )
    say(
        "XLA GiB: the compiled step's arguments, outputs and temporaries per device "
        "(XLA's memory analysis); ub GiB: jax_ub's userbuffers per device, allocated "
        "outside XLA; /bound, /bound_ub: step time over the no-communication bound's on "
        "XLA's GEMMs, on jax_ub's"
    )
    check_losses(rows, args, say)


def check_losses(rows: dict, args, say) -> None:
    """Every variant that computes the model (all but the bounds) has XLA's first loss,
    within the dtype's rounding: a run whose numbers are wrong times nothing worth having,
    so it ends with an error naming the variants."""
    if "xla" not in rows:
        return
    want = rows["xla"]["first_loss"]
    tol = 1e-4 if args.dtype == "float32" and args.fp8 == "none" else 5e-2
    wrong = []
    for v, r in rows.items():
        if v == "xla" or v.startswith("bound"):
            continue
        diff = abs(r["first_loss"] - want) / abs(want)
        say(f"first-step loss, {v} vs XLA: relative difference {diff:.2e}")
        if not diff <= tol:  # NaN too
            wrong.append(f"{v} {r['first_loss']:.6g}")
    if wrong:
        sys.exit(
            f"first-step losses differ from XLA's ({want:.6g}) by more than {tol:g}: "
            + ", ".join(wrong)
        )
