"""Many calls in a row: loops in one program and dispatches without a sync, a rank that
arrives late, calls with no data dependency between them, and bitwise-identical results
from run to run. Stale flags, early buffer reuse and arrival-order sums show up here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, bits, op_call, op_fn, op_operands, op_specs, place
from conftest import rel_err, smap
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter
N_ITERS = 20


def test_repeated_calls_scan(mesh2d, rand):
    """20 back-to-back calls in one program, each on new data, both ops sharing one buffer.

    A rank that reads a peer's chunk before it is rewritten (stale flag) or overwrites a
    chunk still being read shows up as a mismatch in some iteration.
    """
    mesh = mesh2d(2, 4)
    m, k, n = 4, 16, 12
    xs = rand(N_ITERS, 2 * 4 * m, k)
    w1 = rand(k, 4 * n)
    w2 = rand(4 * n, k, scale=0.2)

    def f(impl):
        def body(xs, w1, w2):
            def step(carry, x):
                y = AG(x + carry, w1, "tp", impl=impl)  # [4m, n]
                z = RS(y, w2, "tp", impl=impl)  # [m, k]
                return 0.1 * jnp.tanh(z), (y, z)

            _, (ys, zs) = lax.scan(step, jnp.zeros_like(xs[0]), xs)
            return ys, zs

        return smap(
            body,
            mesh,
            in_specs=(P(None, ("dp", "tp")), P(None, "tp"), P("tp")),
            out_specs=(P(None, "dp", "tp"), P(None, ("dp", "tp"))),
        )(xs, w1, w2)

    (ys, zs), (ys_ref, zs_ref) = f("ub"), f("xla")
    for i in range(N_ITERS):
        assert rel_err(ys[i], ys_ref[i]) < 1e-5, f"iteration {i}"
        assert rel_err(zs[i], zs_ref[i]) < 1e-5, f"iteration {i}"


def test_repeated_calls_fori_loop(mesh1d, rand):
    """20 dependent calls in one program; each iteration's input depends on the last output."""
    n_dev, m, k = 4, 4, 8
    mesh = mesh1d(n_dev)
    x0 = rand(n_dev * m, n_dev * k)
    w = rand(n_dev * k, n_dev * k, scale=0.3)

    def f(impl):
        def body(x, w):
            def step(i, x):
                y = RS(x, w, "tp", impl=impl)  # [m, n_dev*k], row block of x @ w
                # back to the column-sharded layout with new, iteration-dependent values
                y = lax.all_to_all(y, "tp", 1, 0, tiled=True)
                return jnp.tanh(y + 0.01 * i.astype(y.dtype))

            return lax.fori_loop(0, N_ITERS, step, x)

        return smap(body, mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P(None, "tp"))(x0, w)

    out, ref = f("ub"), f("xla")
    # Check the loop ran: 20 tanh-steps of a random map do not return the input.
    assert rel_err(out, x0) > 0.1
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("op", OPS)
def test_repeated_calls_python_loop(mesh1d, rand, op):
    """20 dispatches of one compiled program with changing data, no sync in between."""
    mesh = mesh1d(8)
    f_ub, f_ref = op_fn(op, mesh, "ub"), op_fn(op, mesh, "xla")
    x_shape, w_shape = ((8 * 4, 16), (16, 8 * 4)) if op == "ag" else ((8 * 2, 8 * 4), (8 * 4, 8))
    w = rand(*w_shape)
    xs = [rand(*x_shape) for _ in range(N_ITERS)]
    outs = [f_ub(x, w) for x in xs]  # all dispatched before any is read
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert rel_err(out, f_ref(x, w)) < 1e-5, f"iteration {i}"


def _make_late(x, m):
    """x, after a few milliseconds of busy work that x's value does not depend on."""
    y = lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ m), m)
    return x + (0.0 * y[0, 0]).astype(x.dtype)


@pytest.mark.parametrize("late", ["first", "last"])
@pytest.mark.parametrize("op", OPS)
def test_skewed_arrival(mesh1d, rand, op, late):
    """One rank reaches the op late: the others must wait for its data, not use stale data.

    Three rounds with new inputs, so a rank that reads before the late rank's data lands
    would see either nothing (round 1) or the previous round's values.
    """
    n_dev = 4
    late_rank = 0 if late == "first" else n_dev - 1
    mesh = mesh1d(n_dev)
    m = rand(64, 64, scale=0.1)
    (x_spec, w_spec), out_spec = op_specs(op)

    def f(impl):
        def body(x, w, m):
            x = lax.cond(lax.axis_index("tp") == late_rank, _make_late, lambda x, m: x, x, m)
            return op_call(op)(x, w, "tp", impl=impl)

        return smap(body, mesh, in_specs=(x_spec, w_spec, P()), out_specs=out_spec)

    f_ub, f_ref = f("ub"), f("xla")
    _, w = op_operands(rand, op, n_dev, 8, 16, 8)
    for i in range(3):
        x, _ = op_operands(rand, op, n_dev, 8, 16, 8)
        assert rel_err(f_ub(x, w, m), f_ref(x, w, m)) < 1e-5, f"round {i}"


@pytest.mark.parametrize("op", OPS)
def test_back_to_back_independent_calls(mesh1d, rand, op):
    """30 calls in one program whose inputs do not depend on each other, on 8 ranks.

    Nothing orders a fast rank's next call after a slow rank's current one except the
    protocol's flags: a rank that frees its buffer too early gets it overwritten by the
    next call's data while it still reads it (caught here as a wrong iteration).
    """
    mesh = mesh1d(8)
    m, k, n = (16, 16, 32) if op == "ag" else (32, 16, 32)
    x_shape, w_shape = ((8 * m, k), (k, 8 * n)) if op == "ag" else ((8 * m, 8 * k), (8 * k, n))
    xs, w = rand(30, *x_shape), rand(*w_shape)  # the 30 calls' x along a leading axis
    (x_spec, w_spec), out_spec = op_specs(op)

    def f(impl):
        def body(xs, w):
            return lax.scan(lambda c, x: (c, op_call(op)(x, w, "tp", impl=impl)), 0.0, xs)[1]

        return smap(body, mesh, in_specs=(P(None, *x_spec), w_spec), out_specs=P(None, *out_spec))

    f_ub = f("ub")
    ref = np.asarray(f("xla")(xs, w))
    for run in range(2):
        out = np.asarray(f_ub(xs, w))
        bad = [i for i in range(xs.shape[0]) if rel_err(out[i], ref[i]) > 1e-5]
        assert not bad, f"run {run}: wrong iterations {bad}"


def test_independent_ops_in_one_program(mesh1d, rand):
    """Several ub ops with no data dependency between them in one program, repeated: the
    CPU runtime may schedule them freely, yet every device must pair its calls with its
    peers' in the same order (else the descriptor check fails the run)."""
    mesh = mesh1d(8)

    def body(x, w, v):
        def ops(impl):
            return [
                AG(x, w, "tp", impl=impl),
                AG(x * 2, w, "tp", impl=impl),
                RS(jnp.tile(x, (8, 1)), v, "tp", impl=impl),
                AG(x + 1, w, "tp", impl=impl),
            ]

        pairs = zip(ops("ub"), ops("xla"))
        err = sum(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)) for a, b in pairs)
        return lax.pmax(err, "tp")

    f = smap(body, mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(), check_vma=False)
    w, v = rand(16, 8 * 4), rand(16, 16)
    for _ in range(10):
        assert float(f(rand(8 * 4, 16), w, v)) < 1e-5


# --------------------------------------------------------------------------- determinism


def _both_ops(x, w, h, v):
    return AG(x, w, "tp", impl="ub"), RS(h, v, "tp", impl="ub")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_bitwise_deterministic(mesh1d, rand, tp, dtype):
    """Both ops, five runs of one compiled program: identical bits every time (partials are
    summed in rank order, not arrival order, and 8 device threads on 2 cores arrive in a
    different order every run)."""
    mesh = mesh1d(tp)
    m, k, n = 16, 64, 32
    specs = (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"))
    f = smap(_both_ops, mesh, specs, (P(None, "tp"), P("tp")))
    args = (
        place(mesh, P("tp"), rand(tp * m, k, dtype=dtype)),
        place(mesh, P(None, "tp"), rand(k, tp * n, dtype=dtype)),
        place(mesh, P(None, "tp"), rand(tp * m, tp * k, dtype=dtype)),
        place(mesh, P("tp"), rand(tp * k, n, dtype=dtype)),
    )
    first = [bits(o) for o in f(*args)]
    for run in range(4):
        for i, o in enumerate(f(*args)):
            np.testing.assert_array_equal(bits(o), first[i], err_msg=f"run {run}, output {i}")


def test_bitwise_deterministic_across_groups_and_reinitialization(mesh2d, rand):
    """On a 2x4 mesh both tp groups get the same inputs: their outputs agree bit for bit, and
    so do the outputs after finalize() (a new communicator and a new compile)."""
    mesh = mesh2d(2, 4)
    specs = (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"))
    f = smap(_both_ops, mesh, specs, (P("dp", "tp"), P(("dp", "tp"))))
    x, w = rand(4 * 16, 64), rand(64, 4 * 32)
    h, v = rand(4 * 16, 4 * 64), rand(4 * 64, 32)
    ag1, rs1 = (bits(o) for o in f(x, w, h, v))
    for out in (ag1, rs1):
        half = out.shape[0] // 2
        np.testing.assert_array_equal(out[:half], out[half:])  # group 0 == group 1
    jax_ub.finalize()
    ag2, rs2 = (bits(o) for o in f(x, w, h, v))
    np.testing.assert_array_equal(ag2, ag1)
    np.testing.assert_array_equal(rs2, rs1)


# --------------------------------------------------------------------- many calls in flight
# XLA's CPU client blocks one of its worker threads per device once a device has 32 calls
# queued; with only as many threads as devices, a call whose parts wait for each other (a
# jax_ub op, or XLA's own all-gather) then deadlocks. jax_ub sizes the pool when JAX creates
# the client (jax_ub/_src/runtime/cpu_runtime.py). These loops dispatch far more than 32 calls
# before the first sync. In this process the client has 8 devices, so the 8-device mesh is the one
# that deadlocked (on machines of fewer than 16 CPUs); the subprocess tests below start from
# 2 and 4 devices and a pool sized as on one CPU, which deadlocked on any machine.

IN_FLIGHT = 300


def _in_flight_operands(rand, mesh, op, n_dev, count=3):
    """`count` different x and one w for `op` on `n_dev` ranks, placed with their shardings."""
    (x_spec, w_spec), _ = op_specs(op)
    pairs = [op_operands(rand, op, n_dev, 8, 16, 8) for _ in range(count)]
    xs = [place(mesh, x_spec, x) for x, _ in pairs]
    return xs, place(mesh, w_spec, pairs[0][1])


@pytest.mark.parametrize("op", OPS)
def test_hundreds_of_calls_in_flight(mesh1d, rand, op):
    """300 dispatches of one op on 8 devices and one sync at the end (the issue's loop; it
    timed out after some 40 calls): every result equals XLA's."""
    mesh = mesh1d(8)
    xs, w = _in_flight_operands(rand, mesh, op, 8)
    f_ub, f_ref = op_fn(op, mesh, "ub"), op_fn(op, mesh, "xla")
    outs = [f_ub(xs[i % len(xs)], w) for i in range(IN_FLIGHT)]
    jax.block_until_ready(outs[-1])
    want = [f_ref(x, w) for x in xs]
    bad = [i for i, o in enumerate(outs) if not rel_err(o, want[i % len(xs)]) < 1e-5]
    assert not bad, f"wrong calls: {bad}"


def test_two_ops_alternating_in_flight(mesh1d, rand):
    """Two programs, all_gather_matmul's and matmul_reduce_scatter's, alternating for 300
    calls with no sync in between."""
    mesh = mesh1d(8)
    (xs_ag, w_ag), (xs_rs, w_rs) = (_in_flight_operands(rand, mesh, op, 8) for op in OPS)
    ag, rs = op_fn("ag", mesh, "ub"), op_fn("rs", mesh, "ub")
    outs = [
        ag(xs_ag[i % 3], w_ag) if i % 2 == 0 else rs(xs_rs[i % 3], w_rs) for i in range(IN_FLIGHT)
    ]
    jax.block_until_ready(outs[-1])
    want_ag = [op_fn("ag", mesh, "xla")(x, w_ag) for x in xs_ag]
    want_rs = [op_fn("rs", mesh, "xla")(x, w_rs) for x in xs_rs]
    bad = [
        i
        for i, o in enumerate(outs)
        if not rel_err(o, (want_ag if i % 2 == 0 else want_rs)[i % 3]) < 1e-5
    ]
    assert not bad, f"wrong calls: {bad}"


def test_chained_calls_in_flight(mesh1d, rand):
    """300 steps of a training-like loop, each consuming the previous step's result and never
    read back in between: x -> all_gather_matmul -> tanh -> matmul_reduce_scatter -> x'.
    Every step equals XLA's (the step is contractive, so rounding does not grow; a term that
    changes with the step keeps the steps apart)."""
    n_dev, m, k, n = 8, 8, 16, 8
    mesh = mesh1d(n_dev)
    scale = 1 / (np.sqrt(k) + np.sqrt(n_dev * n))  # weights of spectral norm ~1

    def chain(impl):
        def body(x, w1, w2, c, t):
            y = AG(x, w1, "tp", impl=impl)
            z = RS(jnp.tanh(y), w2, "tp", impl=impl)
            return 0.5 * jnp.tanh(z) + 0.1 * x + jnp.sin(t) * c

        specs = (P("tp"), P(None, "tp"), P("tp"), P("tp"), P())
        return smap(body, mesh, specs, P("tp"))

    x0, c = (place(mesh, P("tp"), rand(n_dev * m, k)) for _ in range(2))
    w1 = place(mesh, P(None, "tp"), rand(k, n_dev * n, scale=scale))
    w2 = place(mesh, P("tp"), rand(n_dev * n, k, scale=scale))
    ts = [place(mesh, P(), np.float32(0.37 * i)) for i in range(IN_FLIGHT)]
    steps = {}
    for impl in ("ub", "xla"):
        f, x, outs = chain(impl), x0, []
        for t in ts:
            x = f(x, w1, w2, c, t)
            outs.append(x)
        steps[impl] = [np.asarray(o) for o in outs]  # read once all 300 are dispatched
    bad = [i for i, (a, b) in enumerate(zip(steps["ub"], steps["xla"])) if not rel_err(a, b) < 1e-4]
    assert not bad, f"wrong steps: {bad}"


_WORKER = Path(__file__).with_name("_inflight_worker.py")


def _run_in_own_process(cmd, env_changes, timeout_s=300) -> str:
    """stdout of `cmd` run with NPROC=1 (XLA then sizes the CPU client's worker pool as on
    a 1-core machine: the worst case, on any CI machine) and `env_changes`; fails the test
    with the output's tail unless the process succeeded."""
    env = dict(os.environ, NPROC="1", **env_changes)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    assert done.returncode == 0, f"rc={done.returncode}:\n{tail}"
    return done.stdout


@pytest.mark.parametrize("n_dev", [2, 4])
def test_hundreds_in_flight_on_a_client_of_few_devices(n_dev):
    """The issue's loops where they failed, a process whose CPU client has 2 (4) devices:
    300 calls of each op, the two alternating, and a 300-step chain, no sync in between;
    the client got 2 worker threads per device and every result equals XLA's."""
    out = _run_in_own_process([sys.executable, str(_WORKER), "ops", str(n_dev), str(IN_FLIGHT)], {})
    (line,) = [x for x in out.splitlines() if x.startswith("OK ")]
    result = json.loads(line[3:])
    assert result["threads"] >= 2 * n_dev, result


def test_warns_when_the_cpu_client_predates_jax_ub():
    """A CPU client created before jax_ub was imported keeps XLA's pool: the first
    communicator on it warns, once, and says what to do."""
    out = _run_in_own_process([sys.executable, str(_WORKER), "late", "4", "0"], {})
    (line,) = [x for x in out.splitlines() if x.startswith("OK ")]
    warning = json.loads(line[3:])["warning"]
    assert "4 worker threads for 4 devices" in warning and "NPROC=8" in warning, warning


def test_bench_loops_on_four_devices():
    """python -m jax_ub.bench --loop-seconds on 4 CPU devices: loops of hundreds of async
    calls of every implementation, XLA's own all-gather included (it aborted in XLA's
    rendezvous before jax_ub sized the CPU client's pool)."""
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jax_ub.bench", "--loop-seconds", "0.3", "--shapes", "32x32x32"]
    out = _run_in_own_process([*cmd, "--rounds", "1", "--ops", "ag"], flags)
    rows = [x.split()[0] for x in out.splitlines() if x.startswith("  ") and "vs xla_seq" in x]
    assert {"gemm", "comm", "xla_seq", "jax_ub"} <= set(rows), out


@pytest.mark.parametrize("calls", [26])
def test_many_unrolled_calls_on_global_arrays_with_a_data_axis(rand, calls):
    """26 unrolled calls on global arrays under a (data, tp) mesh, each a shard_map of its
    own: values and gradients equal to XLA's. With the data axis left automatic, every
    call needed lowering's nested shard_map, and XLA's Shardy partitioner then refused the
    24th ("Side-effect ops cannot be replicated"); the calls now split their rows over it."""
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layers = calls // 2
    ws = [(rand(16, 16, scale=0.3), rand(16, 16, scale=0.3)) for _ in range(layers)]
    x = rand(8, 4, 16)  # [seq, batch, features]

    def loss(ws, x, impl):
        for w_up, w_down in ws:
            h = jnp.tanh(AG(x, w_up, "tp", impl=impl))
            x = x + RS(h, w_down, "tp", impl=impl)
        return jnp.sum(x**2)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(lambda ws, x: loss(ws, x, "ub")))(ws, x)
        want = jax.jit(jax.value_and_grad(lambda ws, x: loss(ws, x, "xla")))(ws, x)
    assert rel_err(got[0], want[0]) < 1e-5
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("regions", [23, 24])
def test_xla_loses_the_manual_axes_of_the_24th_nested_shard_map(regions):
    """Plain JAX, no jax_ub: why RELIABILITY's gap 14 exists. XLA's Shardy export
    (shard_map_export.cc) keeps a reference to a map entry for each nested shard_map while it
    adds the entry of the nested one's parent; where that parent is a top-level shard_map met
    for the first time and the map grows just then (at its 48th, 96th, ... entry: the 24th,
    48th, ... such parent with one nested shard_map), the nested one loses its parent's manual
    axes and the program fails to compile. A jax_ub call in a partial-auto shard_map is such a
    nested shard_map (lowering's, over the automatic axes). Once 24 compiles, XLA is fixed:
    drop the gap."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))

    def inner(x):  # every axis manual: the rank in dp, as a value
        return x + lax.axis_index("dp").astype(x.dtype)

    def region(x):
        return jax.shard_map(
            inner, in_specs=P(None, "dp"), out_specs=P(None, "dp"), axis_names={"dp"}
        )(x)

    def f(x):
        for _ in range(regions):
            x = jax.shard_map(
                region, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), axis_names={"tp"}
            )(x)
        return x

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 3)), jnp.float32)
    with jax.set_mesh(mesh):
        if regions < 24:
            want = x + regions * jnp.arange(2, dtype=jnp.float32)[None, :, None]
            np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
        else:
            with pytest.raises(jax.errors.JaxRuntimeError, match="PartitionId"):
                jax.jit(f)(x)
