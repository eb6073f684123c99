"""Layer benchmark: one sequence-parallel transformer layer, jax_ub against XLA and the
no-communication bound, forward and forward+backward.

``python -m jax_ub.bench.layer --sizes HIDDENxFFNxSEQ,...`` builds, per size, one layer
under ``jit`` + ``shard_map`` over a 1-D ``tp`` mesh (bf16 by default)::

    h = rms_norm(x)                      x [seq/tp, batch, hidden]: the rank's rows
    q, k, v = all_gather_matmul(h, w_qkv)        [seq, batch, 3 * hidden/tp]
    o = dot_product_attention(q, k, v, is_causal=True)   (cuDNN on GPUs)
    x = x + matmul_reduce_scatter(o, w_o)        [seq/tp, batch, hidden]
    u = all_gather_matmul(rms_norm(x), w_up)     [seq, batch, ffn/tp]
    y = x + matmul_reduce_scatter(gelu(u), w_down)   (jax_ub: gelu_mlp, GELU and its
                                                       gradient in GEMM epilogues)

three ways, timed in the same interleaved rounds (:func:`jax_ub.bench.timing.measure`):
``jax_ub`` (the ops with ``impl="ub"``), ``xla`` (``impl="xla"``: XLA's all-gather then
dot, dot then reduce-scatter) and ``bound``: the same GEMMs with every collective replaced
by a local op of the same shapes (the all-gather by ``tp`` copies of the local rows, the
reduce-scatter by the sum of the product's ``tp`` row blocks), so no data crosses devices.
``bound`` computes other numbers; ``jax_ub``'s outputs and gradients are checked against
``xla``'s. ``--batch-major`` adds ``jax_ub_batch_major``: the same layer on batch-major
activations ``[batch, seq/tp, hidden]`` (the ops with ``seq_axis=1``, attention on its
``[batch, seq, ...]`` layout without a transpose), entered and left through a swap of the
rank's rows so that it takes and returns what the others do. The forward+backward pass
is the VJP of the layer for a fixed random output gradient: the gradients of x and of
every weight. Each rank holds its own copy of the norms' gains (so no variant all-reduces
their gradient; a model would, 2 x hidden floats).
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub.bench.impls import AXIS, _put, _random, _smap, configured, parse_variants, variant_name
from jax_ub.bench.timing import bar_chart, measure

GPU_SIZES = "8192x28672x8192,4096x14336x8192,3072x12288x8192"
CPU_SIZES = "64x128x32"  # the host protocol's GEMM is a plain loop: tiny on CPU
VARIANTS = ("bound", "xla", "jax_ub")
BATCH_MAJOR = "jax_ub_batch_major"
PASSES = ("fwd", "fwd+bwd")


# ------------------------------------------------------------------ the layer


def collectives(variant: str):
    """(all-gather matmul, matmul reduce-scatter, GELU MLP) of a variant: ``(x, w) -> y``
    for the first two, ``(x, w_up, w_down) -> y`` for the MLP. The bound is the ops with
    ``impl="none"``: the same GEMMs, each gather a stack of ``tp`` copies of the local rows
    and each reduce-scatter a sum of row blocks (in the named scope
    ``unfused.NO_COMMUNICATION_SCOPE``: work the bound does and an overlapped op does
    not, which a profile of the bound sums by that name)."""
    impl = {"jax_ub": "ub", "xla": "xla", BATCH_MAJOR: "ub", "bound": "none"}[variant]
    kw = dict(axis_name=AXIS, impl=impl, seq_axis=int(variant == BATCH_MAJOR))
    return (
        functools.partial(jax_ub.all_gather_matmul, **kw),
        functools.partial(jax_ub.matmul_reduce_scatter, **kw),
        functools.partial(jax_ub.gelu_mlp, **kw),
    )


def rms_norm(x: jax.Array, gain: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / rms(x) * gain`` over the last dim, computed in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    scale = lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * scale * gain.astype(jnp.float32)).astype(x.dtype)


def layer(x: jax.Array, params: dict, variant: str, head_dim: int) -> jax.Array:
    """One pre-norm transformer layer on a rank's rows ``x [seq/tp, batch, hidden]``, with
    the rank's weight shards (``params``: :func:`param_specs`); returns ``[seq/tp, batch,
    hidden]``."""
    if variant == BATCH_MAJOR:
        return jnp.swapaxes(_batch_major_layer(jnp.swapaxes(x, 0, 1), params, head_dim), 0, 1)
    ag, rs, mlp = collectives(variant)
    qkv = ag(rms_norm(x, params["norm1"][0]), params["w_qkv"])  # [seq, b, 3 * hidden/tp]
    seq, batch = qkv.shape[:2]
    # [seq, b, 3, heads/tp, head_dim] -> three [b, seq, heads/tp, head_dim] (BTNH).
    q, k, v = jnp.transpose(qkv.reshape(seq, batch, 3, -1, head_dim), (2, 1, 0, 3, 4))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    o = jnp.swapaxes(o, 0, 1).reshape(seq, batch, -1)  # [seq, b, hidden/tp]
    x = x + rs(o, params["w_o"])
    # [seq, b, ffn/tp] in between
    return x + mlp(rms_norm(x, params["norm2"][0]), params["w_up"], params["w_down"])


def _batch_major_layer(x: jax.Array, params: dict, head_dim: int) -> jax.Array:
    """:func:`layer` on batch-major rows ``x [batch, seq/tp, hidden]``."""
    ag, rs, mlp = collectives(BATCH_MAJOR)
    qkv = ag(rms_norm(x, params["norm1"][0]), params["w_qkv"])  # [b, seq, 3 * hidden/tp]
    batch, seq = qkv.shape[:2]
    q, k, v = jnp.moveaxis(qkv.reshape(batch, seq, 3, -1, head_dim), 2, 0)  # BTNH each
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, seq, -1)
    x = x + rs(o, params["w_o"])
    return x + mlp(rms_norm(x, params["norm2"][0]), params["w_up"], params["w_down"])


def param_specs() -> dict:
    """Column-parallel QKV and up-projection, row-parallel out- and down-projection; the
    norms' gains one copy per rank (``[tp, hidden]``)."""
    return {
        "norm1": P(AXIS),
        "w_qkv": P(None, AXIS),
        "w_o": P(AXIS, None),
        "norm2": P(AXIS),
        "w_up": P(None, AXIS),
        "w_down": P(AXIS, None),
    }


def layer_inputs(mesh: Mesh, hidden: int, ffn: int, seq: int, batch: int, dtype, seed: int):
    """Global, sharded (x, params, dy), random (normal). ``w_qkv``'s columns are laid out
    per rank as [q, k, v] of that rank's heads."""
    tp = mesh.shape[AXIS]
    rng = iter(range(seed, seed + 16))
    x = _random(next(rng), (seq, batch, hidden), dtype)
    dy = _random(next(rng), (seq, batch, hidden), dtype)
    params = {
        "norm1": np.tile(1 + 0.1 * _random(next(rng), (1, hidden), np.float32), (tp, 1)),
        "w_qkv": _random(next(rng), (hidden, 3 * hidden), dtype, 1 / math.sqrt(hidden)),
        "w_o": _random(next(rng), (hidden, hidden), dtype, 1 / math.sqrt(hidden)),
        "norm2": np.tile(1 + 0.1 * _random(next(rng), (1, hidden), np.float32), (tp, 1)),
        "w_up": _random(next(rng), (hidden, ffn), dtype, 1 / math.sqrt(hidden)),
        "w_down": _random(next(rng), (ffn, hidden), dtype, 1 / math.sqrt(ffn)),
    }
    specs = param_specs()
    params = {name: _put(a.astype(dtype), mesh, specs[name]) for name, a in params.items()}
    return _put(x, mesh, P(AXIS)), params, _put(dy, mesh, P(AXIS))


def build(mesh: Mesh, variant: str, head_dim: int):
    """(fwd, fwd_bwd) of a variant, jitted: ``fwd(x, params) -> y`` and ``fwd_bwd(x,
    params, dy) -> (dx, dparams)``, the VJP of the layer at ``dy``; all global arrays."""
    specs = param_specs()

    def fwd(x, params):
        return layer(x, params, variant, head_dim)

    def fwd_bwd(x, params, dy):
        _, vjp = jax.vjp(fwd, x, params)
        return vjp(dy)

    return (
        _smap(mesh, fwd, (P(AXIS), specs), P(AXIS)),
        _smap(mesh, fwd_bwd, (P(AXIS), specs, P(AXIS)), (P(AXIS), specs)),
    )


# ------------------------------------------------------------------ command line


DESCRIPTION = (
    "Layer benchmark: times one sequence-parallel transformer layer (RMS norm, QKV "
    "projection, causal attention, output projection, RMS norm, GELU MLP), forward and "
    "forward+backward, on a 1-D "
    "tensor-parallel mesh of this host's devices, three ways: jax_ub's ops (impl='ub'), "
    "XLA's collectives (impl='xla'), and the bound, the same GEMMs with every collective "
    "replaced by a local op of the same shapes. The ways run interleaved round by round; "
    "each reported time is the median over the rounds, and jax_ub's outputs and gradients "
    "are checked against XLA's. On CPU devices it checks the benchmark, not speed."
)
DTYPES = ("bfloat16", "float16", "float32")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jax_ub.bench.layer", description=DESCRIPTION)
    ap.add_argument(
        "--sizes",
        default="",
        help=f"comma-separated HIDDENxFFNxSEQ (default: {GPU_SIZES} on GPUs, {CPU_SIZES} "
        "on CPU devices)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences per step: the batch dimension of the activations "
        "[seq/tp, batch, hidden] (default: %(default)s)",
    )
    ap.add_argument(
        "--head-dim",
        type=int,
        default=0,
        help="attention head size; HIDDEN must be a multiple of it (default: 128, 16 on CPU "
        "devices)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=DTYPES,
        help="the activations' and weights' dtype (default: %(default)s)",
    )
    ap.add_argument("--tp", type=int, default=0, help="use the first TP devices (default: all)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds, interleaved across the ways; each time reported is the median "
        "over them (default: %(default)s)",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=10,
        help="async calls per timed loop, after a warm-up (default: %(default)s)",
    )
    ap.add_argument(
        "--loop-seconds",
        type=float,
        default=0.0,
        help="make every timed loop last at least this long (as python -m jax_ub.bench)",
    )
    ap.add_argument(
        "--ub-variants",
        default="",
        help="EXPERIMENTAL: more jax_ub columns, each under other internal tuning choices "
        "or GEMM choice file (gemm_cache=PATH), "
        'in the same interleaved rounds (as python -m jax_ub.bench): "name=value,...;..."',
    )
    ap.add_argument(
        "--batch-major",
        action="store_true",
        help=f"add {BATCH_MAJOR}: jax_ub on batch-major activations (seq_axis=1)",
    )
    ap.add_argument(
        "--json",
        default="",
        metavar="PATH",
        help="write the results (times, spreads, errors, ratios to the bound per size and "
        "pass) to this JSON file, rewritten after each one so that a later failure loses "
        "nothing",
    )
    ap.add_argument(
        "--png",
        default="",
        metavar="PATH",
        help="write a bar chart of each way's time over the bound, per size and pass, to "
        "this PNG file (needs matplotlib)",
    )
    return ap


def _sizes(ap, args, tp: int, head_dim: int, on_cpu: bool) -> list[tuple[int, int, int]]:
    text = args.sizes or (CPU_SIZES if on_cpu else GPU_SIZES)
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        ap.error(f"--sizes: {text!r} is not HIDDENxFFNxSEQ,...")
    for size in sizes:
        if len(size) != 3 or min(size) <= 0:
            ap.error(f"--sizes: {size} is not three positive sizes HIDDENxFFNxSEQ")
        hidden, ffn, seq = size
        if hidden % head_dim or (hidden // head_dim) % tp or ffn % tp or seq % tp:
            ap.error(
                f"--sizes: {size}: hidden must be a multiple of head_dim ({head_dim}), the "
                f"heads ({hidden // head_dim}), ffn and seq multiples of the {tp} devices"
            )
    return sizes


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m jax_ub.bench.layer``: see ``--help``. Returns the JSON rows."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1 or args.batch < 1:
        ap.error("--rounds, --iters and --batch must be >= 1")
    try:
        tunings = parse_variants(args.ub_variants)
    except ValueError as e:
        ap.error(f"--ub-variants: {e}")
    devices = jax.devices()[: args.tp or None]
    mesh = Mesh(np.array(devices), (AXIS,))
    tp, on_cpu = len(devices), devices[0].platform == "cpu"
    head_dim = args.head_dim or (16 if on_cpu else 128)
    sizes = _sizes(ap, args, tp, head_dim, on_cpu)
    dtype = jnp.dtype(args.dtype)
    say = functools.partial(print, flush=True)
    say(f"devices: {tp} x {devices[0].device_kind}; jax {jax.__version__}; dtype {dtype}")
    if on_cpu:
        say("CPU devices: this checks the benchmark and the host protocol, not speed")
    rows = []
    for hidden, ffn, seq in sizes:
        size = dict(hidden=hidden, ffn=ffn, seq=seq, batch=args.batch, head_dim=head_dim, tp=tp)
        say(f"layer {size}: compiling and checking ...")
        x, params, dy = layer_inputs(mesh, hidden, ffn, seq, args.batch, dtype, hidden + ffn)
        built = {v: build(mesh, v, head_dim) for v in VARIANTS}
        for i, name in enumerate(PASSES):
            args_of = (x, params) if name == "fwd" else (x, params, dy)
            impls = {v: (built[v][i], args_of) for v in VARIANTS}
            if args.batch_major:
                impls[BATCH_MAJOR] = (build(mesh, BATCH_MAJOR, head_dim)[i], args_of)
            for settings in tunings:
                # Communicators take their tuning when created, at lowering: compile now.
                with configured(settings):
                    f = build(mesh, "jax_ub", head_dim)[i].lower(*args_of).compile()
                impls[variant_name(settings)] = (f, args_of)
            m = measure(
                impls,
                impls["xla"],
                args.rounds,
                args.iters,
                args.loop_seconds,
                unchecked=("bound",),
            )
            rows.append(_row(size, name, m, dtype))
            if args.json:  # as it goes: a later failure loses nothing
                with open(args.json, "w") as fh:
                    json.dump(dict(device=devices[0].device_kind, results=rows), fh, indent=1)
        _print_size(rows[-2:], args, say)
    if args.png:
        _plot(rows, args.png, say)
    return rows


def _row(size: dict, name: str, m, dtype) -> dict:
    """One size and pass's JSON row (a variant that failed its check has no time)."""
    t = m.times
    return {
        **size,
        "dtype": str(dtype),
        "pass": name,
        "times_ms": t,
        "spread": m.spread,
        "rel_err": m.errs,
        "over_bound": {v: t[v] / t["bound"] for v in t},
        "speedup_vs_xla": t["xla"] / t["jax_ub"] if {"xla", "jax_ub"} <= set(t) else None,
    }


def _print_size(rows: list[dict], args, say) -> None:
    r0 = rows[0]
    say(
        f"\nhidden={r0['hidden']} ffn={r0['ffn']} seq={r0['seq']} batch={r0['batch']} "
        f"tp={r0['tp']}: per variant, per-device ms (median of {args.rounds} rounds), x its "
        "ratio to bound, the rounds' spread"
    )
    say(f"  {'pass':8s}" + "".join(f"{v:>25s}" for v in VARIANTS) + "   xla/jax_ub  rel_err")
    for r in rows:
        cells = "".join(
            f"{r['times_ms'][v]:11.3f} x{r['over_bound'][v]:5.3f} {100 * r['spread'][v]:5.1f}%"
            if v in r["times_ms"]
            else f"{'failed':>25s}"
            for v in VARIANTS
        )
        err, speedup = r["rel_err"].get("jax_ub"), r["speedup_vs_xla"]
        err_text = f"{err:.1e}" if err is not None else "failed"
        speedup_text = f"{speedup:9.3f}" if speedup is not None else f"{'-':>9s}"
        say(f"  {r['pass']:8s}{cells}   {speedup_text}  {err_text}")
    for r in rows:  # --ub-variants
        for v in (v for v in r["times_ms"] if v not in VARIANTS):
            t = r["times_ms"]
            say(
                f"  {r['pass']:8s}{v}: {t[v]:.3f} x{r['over_bound'][v]:5.3f} "
                f"{100 * r['spread'][v]:4.1f}%, jax_ub / it {t['jax_ub'] / t[v]:.3f}"
            )


def _plot(rows: list[dict], path: str, say) -> None:
    """Per pass, every variant's time over the bound, per size."""
    panels = []
    for name in PASSES:
        mine = [r for r in rows if r["pass"] == name]
        names = list(dict.fromkeys(v for r in mine for v in r["over_bound"]))
        series = {v: [r["over_bound"].get(v, np.nan) for r in mine] for v in names}
        labels = [f"{r['hidden']}x{r['ffn']}x{r['seq']}" for r in mine]
        panels.append((f"layer {name}, tp={mine[0]['tp']}", labels, series))
    bar_chart(path, panels, "time / no-communication bound", say)


if __name__ == "__main__":
    main()
