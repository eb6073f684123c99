"""The rows of benchmarks/te/compare.py (jax_ub, XLA, the bounds; TE's from te_rows), their
references, the timing (jax_ub.bench.timing.measure) and the printed tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import te_rows
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import fp8 as ub_fp8
from jax_ub._src.lowering.unfused import scaled_matmul
from jax_ub._src.lowering.wire_format import pack_scales
from jax_ub.bench.timing import measure

AXIS = te_rows.AXIS
F32, BF16, E4M3 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
HIGHEST = lax.Precision.HIGHEST
BOUNDS = ("gemm", "fp8_gemm")
# Per op: jax_ub's call, x's and w's specs, the result's, and x's for the GEMM alone.
OPS = {
    "ag": (jax_ub.all_gather_matmul, P(AXIS, None), P(None, AXIS), P(None, AXIS), P()),
    "rs": (
        jax_ub.matmul_reduce_scatter,
        P(None, AXIS),
        P(AXIS, None),
        P(AXIS, None),
        P(None, AXIS),
    ),
}
# rel_err above these is flagged: bf16 output rounding, or e4m3 operands (e5m2 gradients).
TOLERANCE = {
    False: dict(ag=1e-2, rs=1e-2, mlp_fwd=1e-2, mlp_bwd=1e-2),
    True: dict(ag=0.06, rs=0.06, mlp_fwd=0.1, mlp_bwd=0.15),
}
TITLES = {"ag": "AG+GEMM", "rs": "GEMM+RS", "mlp_fwd": "MLP forward", "mlp_bwd": "MLP fwd+bwd"}


class Bench:
    def __init__(self, mesh, args, te, say):
        self.mesh, self.args, self.te, self.say = mesh, args, te, say
        self.tp = mesh.shape[AXIS]
        self.fp8 = not args.no_fp8

    def sh(self, spec):
        return NamedSharding(self.mesh, spec)

    def smap(self, f, in_specs, out_specs, jit=True):
        g = jax.shard_map(
            f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return jax.jit(g) if jit else g

    def rand(self, seed, shape, spec, scale=1.0):
        """bf16 N(0, scale^2), generated on the devices, each its own shard."""
        f = lambda: (jax.random.normal(jax.random.key(seed), shape, F32) * scale).astype(BF16)  # noqa: E731
        return jax.jit(f, out_shardings=self.sh(spec))()

    def relayout(self, a, spec, f=lambda a: a):
        return jax.jit(f, out_shardings=self.sh(spec))(a)

    def amax(self, a) -> float:
        return float(jax.jit(lambda a: jnp.max(jnp.abs(a.astype(F32))))(a))

    def run(self, section, M):
        if section == "mlp":
            return self.mlp(M)
        return [self.gemm_op(section, M)]

    def _te(self, rows, name, build):
        """Add TE's row `name` (build() -> (compiled, args)); a failure is said, not fatal."""
        if self.te is None:
            return
        try:
            rows[name] = build()
        except Exception as e:  # noqa: BLE001
            text = (str(e).strip().splitlines() or [repr(e)])[0][:300]
            self.say(f"  {name}: not compiled: {type(e).__name__}: {text}")

    def gemm_op(self, op, M):
        K, N = self.args.k, self.args.n
        call, xs_spec, w_spec, out, gx_spec = OPS[op]
        x_shape, w_shape = ((M, K), (K, N)) if op == "ag" else ((M, N), (N, K))
        x = self.rand(M, x_shape, xs_spec)
        w = self.rand(M + 1, w_shape, w_spec, w_shape[0] ** -0.5)
        gx = self.relayout(x, gx_spec)

        def op_fn(impl, scales=None):
            return self.smap(
                lambda a, b: call(a, b, AXIS, impl=impl, fp8=scales), (xs_spec, w_spec), out
            )

        gemm_out = P(None, AXIS) if op == "ag" else P(AXIS, None)
        rows = {
            "gemm": (self.smap(lambda a, b: a @ b, (gx_spec, w_spec), gemm_out), (gx, w)),
            "xla": (op_fn("xla"), (x, w)),
            "jax_ub": (op_fn("ub"), (x, w)),
        }
        x3 = self.relayout(x, P(None, *xs_spec), lambda a: a[None])
        amax = (self.amax(x), self.amax(w))
        self._te(
            rows, "te", lambda: te_rows.gemm_row(self.te, self.mesh, op, None, True, x3, w, amax)
        )
        self._te(
            rows,
            "te_noov",
            lambda: te_rows.gemm_row(self.te, self.mesh, op, None, False, x3, w, amax),
        )
        if self.fp8:
            sx, sw = (a / float(jnp.finfo(E4M3).max) for a in amax)
            qx = self.relayout(gx, gx_spec, lambda a: ub_fp8.quantize(a, sx))
            qw = self.relayout(w, w_spec, lambda a: ub_fp8.quantize(a, sw))
            packed = pack_scales(sx, sw)
            mm = lambda a, b: scaled_matmul(a, b, packed, out_dtype=BF16)  # noqa: E731
            rows["fp8_gemm"] = (self.smap(mm, (gx_spec, w_spec), gemm_out), (qx, qw))
            rows["xla_fp8"] = (op_fn("xla", jax_ub.Fp8Scales()), (x, w))
            rows["jax_ub_fp8"] = (op_fn("ub", jax_ub.Fp8Scales()), (x, w))
            for kind in ("cs", "ds"):
                self._te(
                    rows,
                    f"te_fp8_{kind}",
                    lambda kind=kind: te_rows.gemm_row(
                        self.te, self.mesh, op, kind, True, x3, w, amax
                    ),
                )

        ref = jax.jit(
            lambda a, b: jnp.dot(a.astype(F32), b.astype(F32), precision=HIGHEST),
            out_shardings=self.sh(out),
        )
        return self.timed(op, M, rows, (ref, (x, w)))

    def mlp(self, M):
        K, N, tp = self.args.k, self.args.n, self.tp
        row, col = P(AXIS, None), P(None, AXIS)
        x, dy = self.rand(M, (M, K), row), self.rand(M + 3, (M, K), row)
        w1 = self.rand(M + 1, (K, N), col, K**-0.5)
        w2 = self.rand(M + 2, (N, K), row, N**-0.5)
        # The bound: each device's MLP GEMMs on the whole sequence (a copy of its own), no
        # communication, forward and backward.
        xb, dyb = self.rand(M + 4, (tp * M, K), row), self.rand(M + 5, (tp * M, K), row)

        def mlp_fn(impl, scales=None):
            if impl == "gemm":
                return self.smap(lambda x, a, b: (x @ a) @ b, (row, col, row), row, jit=False)
            s = scales

            def body(x, a, b):
                h = jax_ub.all_gather_matmul(x, a, AXIS, impl=impl, fp8=s)
                return jax_ub.matmul_reduce_scatter(h, b, AXIS, impl=impl, fp8=s)

            return self.smap(body, (row, col, row), row, jit=False)

        def pair(f):
            def grads(x, a, b, dy):
                loss = lambda x, a, b: jnp.sum(f(x, a, b).astype(F32) * dy.astype(F32))  # noqa: E731
                return jax.grad(loss, argnums=(0, 1, 2))(x, a, b)

            return jax.jit(f), jax.jit(grads)

        impls = [("gemm", None), ("xla", None), ("jax_ub", None)]
        if self.fp8:
            impls += [("xla_fp8", jax_ub.Fp8Scales()), ("jax_ub_fp8", jax_ub.Fp8Scales())]
        fwd, bwd = {}, {}
        for name, s in impls:
            f, g = pair(mlp_fn(name.split("_fp8")[0].replace("jax_ub", "ub"), s))
            a = (xb, w1, w2) if name == "gemm" else (x, w1, w2)
            fwd[name], bwd[name] = (f, a), (g, (*a, dyb if name == "gemm" else dy))
        x3, dy3 = (self.relayout(a, P(None, AXIS, None), lambda a: a[None]) for a in (x, dy))
        layers = [("jax_ub_layer", False)] + ([("jax_ub_layer_fp8", "current")] if self.fp8 else [])
        for name, fp8 in layers:
            fwd[name], bwd[name] = self.layer_rows(fp8, x3, w1, w2, dy3)
        for name, kind in [("te", None)] + ([("te_fp8_cs", "cs")] if self.fp8 else []):
            built = {}
            self._te(
                built,
                name,
                lambda kind=kind: te_rows.mlp_rows(self.te, self.mesh, kind, x3, w1, w2, dy3, None),
            )
            if name in built:
                fwd[name], bwd[name] = built[name]["fwd"], built[name]["fwd_bwd"]

        def ref(a, b, c):
            return jnp.dot(
                jnp.dot(a.astype(F32), b.astype(F32), precision=HIGHEST),
                c.astype(F32),
                precision=HIGHEST,
            )

        ref_f = jax.jit(ref, out_shardings=self.sh(row))
        ref_g = jax.jit(
            lambda a, b, c, d: jax.grad(
                lambda a, b, c: jnp.sum(ref(a, b, c) * d.astype(F32)), (0, 1, 2)
            )(a, b, c),
            out_shardings=(self.sh(row), self.sh(col), self.sh(row)),
        )
        return [
            self.timed("mlp_fwd", M, fwd, (ref_f, (x, w1, w2))),
            self.timed("mlp_bwd", M, bwd, (ref_g, (x, w1, w2, dy))),
        ]

    def layer_rows(self, fp8, x3, w1, w2, dy3):
        """jax_ub's Flax NNX ColumnParallelLinear then RowParallelLinear (no bias), their
        kernels w1 and w2, on x [1, M, K] split over the sequence: ((forward, args),
        (forward+backward, args)), both giving what the ops' rows give."""
        from flax import nnx  # noqa: PLC0415

        from jax_ub.flax import nnx as ubnnx  # noqa: PLC0415

        K, N = self.args.k, self.args.n
        common = dict(use_bias=False, impl="ub", mesh=self.mesh, axis_name=AXIS, seq_axis=1,
                      fp8=fp8, dtype=BF16, param_dtype=BF16, rngs=nnx.Rngs(0))  # fmt: skip
        col = ubnnx.ColumnParallelLinear(K, N, kernel_init=lambda *_: w1, **common)
        row = ubnnx.RowParallelLinear(N, K, kernel_init=lambda *_: w2, **common)
        graph, params, rest = nnx.split((col, row), nnx.Param, ...)

        def apply(x3, params):
            col, row = nnx.merge(graph, params, rest)
            return row(col(x3))

        def grads(x3, params, dy3):
            def loss(x3, params):
                return jnp.sum(apply(x3, params).astype(F32) * dy3.astype(F32))

            gx, gp = jax.grad(loss, argnums=(0, 1))(x3, params)
            return (gx[0], *jax.tree.leaves(gp))  # the kernels' gradients, w1's first

        return (jax.jit(lambda x3, p: apply(x3, p)[0]), (x3, params)), (
            jax.jit(grads),
            (x3, params, dy3),
        )

    def timed(self, section, M, rows, reference):
        """Time the rows interleaved, check them, print the table; return its JSON row."""
        a, say = self.args, self.say
        say(f"\n{TITLES[section]} M={M} K={a.k} N={a.n} tp={self.tp}: {', '.join(rows)}")
        m = measure(rows, reference, a.rounds, a.iters, 0.0, None, BOUNDS)
        say(f"  {'':16s} {'ms':>8s} {'/ bound':>8s} {'spread':>7s} {'rel_err':>8s}")
        for name in rows:
            if name not in m.times:
                say(f"  {name:16s} failed (said above)")
                continue
            t, e, fp8 = m.times[name], m.errs.get(name), "fp8" in name
            bound = m.times.get("fp8_gemm" if fp8 and section in OPS else "gemm", float("nan"))
            high = e is not None and e > TOLERANCE[fp8][section]
            say(
                f"  {name:16s} {t:8.3f} {t / bound:8.3f} {100 * m.spread[name]:6.1f}%"
                + (f" {e:8.1e}" if e is not None else f" {'-':>8s}")
                + ("  ABOVE TOLERANCE" if high else "")
            )
        return dict(
            section=section, M=M, K=a.k, N=a.n, tp=self.tp, times_ms=m.times,
            spread=m.spread, rel_err=m.errs,
        )  # fmt: skip
