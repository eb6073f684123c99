"""Test helpers for scenarios run on both ops (operands, layouts, the jitted call), raw
bits and placement, leak counters, and NaN/Inf inputs with their check."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from conftest import rel_err, smap, to_f32, tol
from jax.sharding import PartitionSpec as P

import jax_ub

# ------------------------------------------------------------------ one scenario, both ops
# A test that runs the same scenario for all_gather_matmul and matmul_reduce_scatter takes
# `op` ("ag" or "rs") and builds its operands and layouts with these.

OPS = ["ag", "rs"]


def op_call(op: str):
    """jax_ub.all_gather_matmul for "ag", jax_ub.matmul_reduce_scatter for "rs"."""
    return {"ag": jax_ub.all_gather_matmul, "rs": jax_ub.matmul_reduce_scatter}[op]


def op_operands(rand, op, tp, m, k, n, *, batch=(), dp=1, dtype=jnp.float32, scale=1.0):
    """Global (x, w) whose product is x @ w, with m rows of x per rank and leading batch dims
    after the rows. "ag": x [dp*tp*m, *batch, k], w [k, tp*n] (n columns per rank);
    "rs": x [dp*tp*m, *batch, tp*k], w [tp*k, n] (k contracted per rank)."""
    kw = dict(dtype=dtype, scale=scale)
    if op == "ag":
        return rand(dp * tp * m, *batch, k, **kw), rand(k, tp * n, **kw)
    return rand(dp * tp * m, *batch, tp * k, **kw), rand(tp * k, n, **kw)


def op_specs(op, nbatch=0, dp=False):
    """(in_specs, out_specs) of op_operands' layout. "ag": x row-sharded, w column-sharded,
    the output column-sharded; "rs": x column-sharded, w row-sharded, the output
    row-sharded. dp: the rows of x (and of the output) also split over "dp"."""
    b = (None,) * nbatch
    if op == "ag":
        rows = ("dp", "tp") if dp else "tp"
        out = P("dp", *b, "tp") if dp else P(None, *b, "tp")
        return (P(rows, *b, None), P(None, "tp")), out
    x = P("dp", *b, "tp") if dp else P(None, *b, "tp")
    return (x, P("tp")), P(("dp", "tp")) if dp else P("tp")


def op_fn(op, mesh, impl="ub", *, nbatch=0, dp=False, jit=True, **kw):
    """shard_map (jitted unless jit=False) of `op` over "tp" in op_specs' layout."""
    fn = op_call(op)
    in_specs, out_specs = op_specs(op, nbatch, dp)
    return smap(lambda x, w: fn(x, w, "tp", impl=impl), mesh, in_specs, out_specs, jit=jit, **kw)


# ------------------------------------------------------------------ bits, placement, leaks


def bits(a) -> np.ndarray:
    """The raw bits of a float array (uint16 for 2-byte dtypes, uint32 for 4-byte ones)."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def place(mesh, spec, array):
    """Place a host array with its final sharding up front: an uncommitted input makes the
    first call compile a resharding program, which finalize()'s cache clearing throws away."""
    return jax.device_put(np.asarray(array), jax.sharding.NamedSharding(mesh, spec))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_names(prefix: str = "jax_ub_") -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


# ------------------------------------------------------------------ NaN and Inf


def special_inputs(op, tp, dtype, m=8, k=16, n=8):
    """(x, w) for `op` over tp ranks with NaN and Inf placed so that every rank's block holds
    some and the products meet NaN, +-Inf, Inf - Inf = NaN and 0 * Inf = NaN; for "rs" the
    partial sums of different ranks meet them too. Layouts as in op_operands."""
    if op == "ag":  # x [tp*m, k], w [k, tp*n]
        rng = np.random.default_rng(7)
        x = rng.standard_normal((tp * m, k)).astype(np.float32) + 0.1
        w = rng.standard_normal((k, tp * n)).astype(np.float32) + 0.1
        r = [b * m for b in range(tp)]  # first row of each rank's block
        x[r[0] + 1, 3] = np.nan
        x[r[1 % tp] + 2, 0] = np.inf
        x[r[-1] + 1, 5], x[r[-1] + 1, 6] = -np.inf, np.inf  # Inf - Inf where signs of w agree
        w[4, 1] = np.inf
        x[r[-1] + 3, 4] = 0.0  # 0 * Inf
        w[7, tp * n - 2] = np.nan  # a NaN column
    else:  # x [tp*m, tp*k], w [tp*k, n]
        rng = np.random.default_rng(8)
        x = rng.standard_normal((tp * m, tp * k)).astype(np.float32) + 0.1
        w = rng.standard_normal((tp * k, n)).astype(np.float32) + 0.1
        x[2, 5] = np.nan  # rank 0's columns
        x[m + 4, k + 1] = np.inf  # rank 1's columns ...
        x[m + 4, (tp - 1) * k + 2] = np.inf  # ... and the last rank's: partials of either sign
        w[(tp - 1) * k + 9, 3] = -np.inf
        x[tp * m - 1, (tp - 1) * k + 9] = 0.0  # 0 * -Inf
        w[k + 7, n - 1] = np.nan
    return x.astype(dtype), w.astype(dtype)


def assert_same_specials(got, want, dtype):
    """NaN exactly where `want` has NaN, Inf of the same sign where it has Inf, and the finite
    values equal up to the dtype's tolerance."""
    got, want = to_f32(got), to_f32(want)
    assert got.shape == want.shape
    nan_w, inf_w = np.isnan(want), np.isinf(want)
    # The test must prove something: the reference has NaN, Inf and finite entries.
    assert nan_w.any() and inf_w.any() and (~nan_w & ~inf_w).any()
    np.testing.assert_array_equal(np.isnan(got), nan_w, err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isinf(got), inf_w, err_msg="Inf positions differ")
    np.testing.assert_array_equal(got[inf_w], want[inf_w], err_msg="Inf signs differ")
    fin = ~nan_w & ~inf_w
    assert rel_err(got[fin], want[fin]) < tol(dtype)
