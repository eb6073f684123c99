"""Calls with no data path between them run in the program's order on every CPU device.

XLA's CPU runtime may start independent work in any order once its inputs are ready, so
two jax_ub calls with no data path between them could meet a peer's other call ("ranks
disagree on the call"). The ops carry a JAX ordered effect on CPU devices: a token threads
every call in trace order (jit, shard_map, custom_vjp, remat, scan), and each custom call
takes and returns it. The HLO test below is what fails without the chain; the runs check
that the chained programs compute the reference's results, also where each device's inputs
become ready at different times (this machine's runtime did not reorder those programs
without the chain either: it runs small programs in sequence)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import rel_err, smap
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
from jax_ub._src.primitives import CALL_ORDER

TP = 4
M, K, N = 8, 32, 48
SPIN = 400  # steps of a serial loop per rank index: a delay that differs per device


def _late(a, steps):
    """``a`` unchanged in value, ready only after ``steps`` serial iterations."""

    def body(_, v):
        return jnp.sin(v) * 0 + v

    return lax.fori_loop(0, steps, body, a)


def _two_independent_calls(x, w, y, v):
    """An all-gather on x, then a reduce-scatter on y, no data between them: on rank r the
    first call's input is ready after ``r`` delays and the second's after ``TP - 1 - r``,
    so without ordering the last rank would start the reduce-scatter first."""
    r = lax.axis_index("tp")
    first = jax_ub.all_gather_matmul(_late(x, r * SPIN), w, "tp", impl="ub")
    second = jax_ub.matmul_reduce_scatter(_late(y, (TP - 1 - r) * SPIN), v, "tp", impl="ub")
    return first, second


def test_independent_calls_run_in_program_order(mesh1d, rand):
    """Eight runs with per-device delays that invert the readiness order across ranks give
    the reference's results (no rank meets another call than its peers)."""
    mesh = mesh1d(TP)
    x, w = rand(TP * M, K), rand(K, TP * N)
    y, v = rand(TP * M, TP * K), rand(TP * K, N)
    f = smap(
        _two_independent_calls,
        mesh,
        (P("tp"), P(None, "tp"), P(None, "tp"), P("tp")),
        (P(None, "tp"), P("tp")),
    )
    for _ in range(8):
        first, second = f(x, w, y, v)
        assert rel_err(first, x @ w) < 1e-5
        assert rel_err(second, y @ v) < 1e-5


def test_the_calls_carry_the_ordered_effect_and_a_token_chain(mesh1d, rand):
    """The jaxpr carries the effect; in the HLO each custom call takes a token, and the
    second takes the one the first returns."""
    mesh = mesh1d(TP)
    args = (rand(TP * M, K), rand(K, TP * N), rand(TP * M, TP * K), rand(TP * K, N))
    specs = (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"))
    f = smap(_two_independent_calls, mesh, specs, (P(None, "tp"), P("tp")))
    assert CALL_ORDER in jax.make_jaxpr(f)(*args).effects
    hlo = f.lower(*args).as_text()
    calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @jax_ub_" in line]
    assert len(calls) == 2, calls
    first, second = calls
    assert "!stablehlo.token" in first and "!stablehlo.token" in second
    token_out = first.split("=")[0].strip().split(":")[0]  # "%3" of "%3:4 = ..."
    assert f"{token_out}#" in second.split("custom_call")[1], (first, second)


def test_ordering_holds_under_grad_remat_and_scan(mesh1d, rand):
    """The effect passes custom_vjp, jax.checkpoint and lax.scan: two scanned layers of
    all_gather_matmul then matmul_reduce_scatter, rematerialized, give the reference's
    gradients."""
    mesh = mesh1d(TP)
    x = rand(TP * M, K)
    w1, w2 = rand(2, K, TP * N, scale=0.2), rand(2, TP * N, K, scale=0.2)

    def block(impl):
        @jax.checkpoint
        def layer(h, ws):
            a, b = ws
            u = jax_ub.all_gather_matmul(h, a, "tp", impl=impl)
            return jax_ub.matmul_reduce_scatter(u, b, "tp", impl=impl), None

        def loss(x, w1, w2):
            h, _ = lax.scan(layer, x, (w1, w2))
            return jnp.sum(h * h)

        specs = (P("tp"), P(None, None, "tp"), P(None, "tp"))
        return smap(jax.grad(loss, argnums=(0, 1, 2)), mesh, specs, specs)

    got = block("ub")(x, w1, w2)
    want = block("xla")(x, w1, w2)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-4


def test_flax_attention_with_a_constant_output_gradient(mesh1d):
    """The case that showed the gap: the attention block in fp8 with delayed scales and a
    loss ``sum(y * ct)``, whose output projection's backward needs nothing of the forward.
    Its gradients are finite and equal those of the same model on XLA's collectives."""
    mesh = mesh1d(TP)
    seq, batch, d = 16, 2, 32
    x = jax.random.normal(jax.random.key(1), (seq, batch, d))
    ct = jax.random.normal(jax.random.key(2), (seq, batch, d))

    def grads(impl):
        model = ubf.ParallelSelfAttention(
            d, TP, mesh=mesh, fp8="delayed", impl=impl, rngs=nnx.Rngs(0)
        )

        def loss(model):
            return jnp.sum(model(x).astype(jnp.float32) * ct)

        return nnx.jit(nnx.grad(loss))(model)

    for _ in range(3):
        got = grads("ub")
    want = grads("xla")
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    for g, r in pairs:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
        if np.any(np.asarray(r) != 0):
            assert rel_err(g, r) < 2e-2


def test_a_call_traced_without_the_effect_still_lowers_on_cpu(mesh1d, rand, monkeypatch):
    """A call traced as if for GPUs (no effect) but lowered for CPU devices takes a fresh
    token: it compiles and computes the product."""
    from jax_ub._src import primitives

    monkeypatch.setattr(primitives, "_ordered", lambda: False)
    mesh = mesh1d(TP)
    x, w = rand(TP * M, K), rand(K, TP * N)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        (P("tp"), P(None, "tp")),
        P(None, "tp"),
    )
    assert CALL_ORDER not in jax.make_jaxpr(f)(x, w).effects
    assert rel_err(f(x, w), x @ w) < 1e-5


def test_a_compiled_program_runs_again_and_again(mesh1d, rand):
    """``jit(f).lower(...).compile()`` called repeatedly: JAX passes the ordering token on
    every call (its C++ path for compiled programs with only ordered effects would not)."""
    mesh = mesh1d(TP)
    x, w = rand(TP * M, K), rand(K, TP * N)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        (P("tp"), P(None, "tp")),
        P(None, "tp"),
    )
    compiled = f.lower(x, w).compile()
    for _ in range(4):
        assert rel_err(compiled(x, w), x @ w) < 1e-5


def test_partial_auto_layouts_go_without_the_token(mesh2d, rand):
    """Inside a shard_map that leaves "dp" automatic the calls carry no effect (a token
    crossing it fails XLA's sharding check); the program compiles and computes the
    product."""
    mesh = mesh2d(2, 2)
    x, w = rand(2 * M, 2, K), rand(K, 2 * N)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        (P("tp"), P(None, "tp")),
        P(None, None, "tp"),
        axis_names={"tp"},
    )
    assert CALL_ORDER not in jax.make_jaxpr(f)(x, w).effects
    assert rel_err(f(x, w), jnp.einsum("mbk,kn->mbn", x, w)) < 1e-5
