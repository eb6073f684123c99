"""Many calls in flight on CPU devices, in a process of its own (for test_repeated_calls.py).

argv: mode num_devices num_calls
  mode "ops": jax_ub imported before JAX makes its CPU client. Loops of num_calls calls
    with no sync in between (each op alone, the two alternating, and a chain in which each
    call consumes the last one's result), the results checked against XLA's.
  mode "late": JAX makes its CPU client first, jax_ub is imported after: creating a
    communicator warns that the client has too few worker threads (no loop is run).
Prints "OK <json>" on success; exits non-zero with the error text otherwise.

The parent sets NPROC=1, which XLA reads as the machine's CPU count when it sizes the CPU
client's worker pool: every machine then starts from the pool of a 1-core one, the worst
case, and the test does not depend on how many cores CI has.
"""

import json
import os
import sys
import warnings

mode, ndev, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ["JAX_PLATFORMS"] = "cpu"
# A deadlock shows up in seconds, not after the default 30 s.
os.environ.setdefault("JAX_UB_TIMEOUT_S", "10")

import jax  # noqa: E402

if mode == "late":
    jax.devices()  # the CPU client exists before jax_ub is imported

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402
from jax_ub._src.runtime import cpu_runtime  # noqa: E402

mesh = Mesh(np.array(jax.devices()[:ndev]), ("tp",))
rng = np.random.default_rng(ndev)


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def put(a, spec):
    return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))


def rel_err(a, b) -> float:
    a, b = (np.asarray(v, np.float32) for v in (a, b))
    assert np.all(np.isfinite(a)), "result has NaN/Inf"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ops(impl):
    """The issue's two ops: AG+GEMM on x (256, 128) @ w (128, 256) bf16, GEMM+RS on its
    transpose-shaped partner."""
    ag = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl),
        (P("tp", None), P(None, "tp")),
        P(None, "tp"),
    )
    rs = smap(
        lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", impl=impl),
        (P(None, "tp"), P("tp", None)),
        P("tp", None),
    )
    return ag, rs


def step(impl):
    """One training-like step whose result feeds the next: x [m, k] rows over tp ->
    all_gather_matmul -> tanh -> matmul_reduce_scatter -> x' [m, k] in the same layout,
    driven by a term that changes with the step t, so that no two steps are alike."""

    def body(x, w1, w2, c, t):
        y = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
        z = jax_ub.matmul_reduce_scatter(jnp.tanh(y), w2, "tp", impl=impl)
        return 0.5 * jnp.tanh(z) + 0.1 * x + jnp.sin(t) * c

    specs = (P("tp", None), P(None, "tp"), P("tp", None), P("tp", None), P())
    return smap(body, specs, P("tp", None))


def run_ops() -> dict:
    bf16 = jnp.bfloat16
    xs = [put(rng.standard_normal((256, 128)), P("tp", None)).astype(bf16) for _ in range(3)]
    w = put(rng.standard_normal((128, 256)) * 0.1, P(None, "tp")).astype(bf16)
    hs = [put(rng.standard_normal((256, 256)), P(None, "tp")).astype(bf16) for _ in range(3)]
    v = put(rng.standard_normal((256, 128)) * 0.1, P("tp", None)).astype(bf16)
    (ag, rs), (ag_ref, rs_ref) = ops("ub"), ops("xla")
    want_ag = [np.asarray(ag_ref(x, w), np.float32) for x in xs]
    want_rs = [np.asarray(rs_ref(h, v), np.float32) for h in hs]
    errs: dict = {}

    # The loop: one op, `calls` dispatches, one sync at the end.
    for name, f, args, want in (("ag", ag, xs, want_ag), ("rs", rs, hs, want_rs)):
        ws = w if name == "ag" else v
        outs = [f(args[i % 3], ws) for i in range(calls)]
        jax.block_until_ready(outs[-1])
        errs[name] = max(rel_err(o, want[i % 3]) for i, o in enumerate(outs))

    # Two ops alternating.
    outs = [ag(xs[i % 3], w) if i % 2 == 0 else rs(hs[i % 3], v) for i in range(calls)]
    jax.block_until_ready(outs[-1])
    errs["alternating"] = max(
        rel_err(o, (want_ag if i % 2 == 0 else want_rs)[i % 3]) for i, o in enumerate(outs)
    )

    # A chain: every call consumes the previous result (no host read of it in between).
    # Weights of spectral norm about 1 make the step contractive, so that rounding
    # differences between jax_ub's and XLA's sums do not grow along the chain.
    scale = 1 / (np.sqrt(32) + np.sqrt(16 * ndev))
    x0 = put(rng.standard_normal((64 * ndev, 32)), P("tp", None))
    c = put(rng.standard_normal((64 * ndev, 32)), P("tp", None))
    w1 = put(rng.standard_normal((32, 16 * ndev)) * scale, P(None, "tp"))
    w2 = put(rng.standard_normal((16 * ndev, 32)) * scale, P("tp", None))
    ts = [put(np.float32(0.37 * i), P()) for i in range(calls)]
    chains = {}
    for impl in ("ub", "xla"):
        f, x, outs = step(impl), x0, []
        for t in ts:
            x = f(x, w1, w2, c, t)
            outs.append(x)
        chains[impl] = [np.asarray(o) for o in outs]  # read once all are dispatched
    errs["chain"] = max(rel_err(a, b) for a, b in zip(chains["ub"], chains["xla"]))
    return errs


if mode == "ops":
    threads, through_jax_ub = cpu_runtime.client_threads(ndev)
    assert through_jax_ub, "the CPU client was not created through jax_ub's factory"
    assert threads >= 2 * ndev, f"the CPU client has {threads} worker threads for {ndev} devices"
    assert os.environ.get("NPROC") == "1", "NPROC was not restored after creating the client"
    errs = run_ops()
    limits = {"ag": 2e-2, "rs": 2e-2, "alternating": 2e-2, "chain": 1e-4}
    bad = {k: e for k, e in errs.items() if not e < limits[k]}
    assert not bad, f"results differ from XLA's: {bad}"
    print("OK " + json.dumps({"threads": threads, "errs": errs}))
elif mode == "late":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ag, _ = ops("ub")
        ag.lower(
            jax.ShapeDtypeStruct((256, 128), jnp.float32),
            jax.ShapeDtypeStruct((128, 256), jnp.float32),
        )
    texts = [str(c.message) for c in caught if "worker threads" in str(c.message)]
    assert len(texts) == 1, [str(c.message) for c in caught]
    print("OK " + json.dumps({"warning": texts[0]}))
else:
    sys.exit(f"unknown mode {mode!r}")
