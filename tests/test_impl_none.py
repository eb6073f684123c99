"""impl="none": every op's GEMMs with the communication removed (the no-communication
bound): a gather is ``tp`` copies of the local rows, a reduce-scatter the sum of the
product's row blocks, an all-reduce the local product. Its numbers, its gradients' shapes,
and programs with no collective, from the ops up to the Llama model; on XLA's GEMMs and on
jax_ub's own (``configure(bound_gemms="ub")``: the ops' calls on groups of one device)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import llama_step_texts
from conftest import rel_err, smap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_grad_matrix import MODES, OPS, check, make_operands, run
from test_hlo import _collectives, _custom_call_targets

import jax_ub

TP, M, K, N = 2, 4, 8, 6


@pytest.fixture(params=["xla", "ub"], ids=["xla_gemms", "ub_gemms"])
def gemms(request):
    """Whose GEMMs the bound runs (conftest's _restore_config undoes the setting)."""
    jax_ub.configure(bound_gemms=request.param)
    return request.param


def _ub_calls(text: str) -> list[str]:
    return [t for t in _custom_call_targets(text) if t.startswith("jax_ub")]


def _copies(x, seq_axis=0):
    return np.concatenate([np.asarray(x)] * TP, axis=seq_axis)


def _block_sum(y, seq_axis=0):
    y = np.asarray(y)
    return sum(np.split(y, TP, axis=seq_axis))


@pytest.mark.parametrize("seq_axis", [0, 1])
def test_each_op_is_its_local_gemms(mesh1d, rand, seq_axis, gemms):
    """Inside shard_map, on one rank's shards: the ops' local math, bias and GELU kept."""
    mesh = mesh1d(TP)
    shape = (M, 3, K) if seq_axis == 0 else (3, M, K)
    x, w, b = rand(*shape), rand(K, N), rand(N)
    w_up, w_down = rand(K, 2 * N), rand(2 * N, K)
    kw = dict(impl="none", seq_axis=seq_axis)

    def body(x, w, b, w_up, w_down):
        return (
            jax_ub.all_gather_matmul(x, w, "tp", bias=b, activation="gelu", **kw),
            jax_ub.matmul_reduce_scatter(_copies_jnp(x, seq_axis), w, "tp", bias=b, **kw),
            jax_ub.matmul_all_reduce(x, w, "tp", bias=b, **kw),
            jax_ub.gelu_mlp(x, w_up, w_down, "tp", **kw),
        )

    # Every rank gets the same operands (replicated specs), so rank 0's results are every
    # rank's: stacked over tp on a new dim for the check.
    rep = P()
    f = smap(body, mesh, (rep,) * 5, (P("tp"),) * 4)
    ag, rs, ar, mlp = (np.split(np.asarray(r), TP)[0] for r in f(x, w, b, w_up, w_down))
    local = _copies(x, seq_axis) @ np.asarray(w) + np.asarray(b)
    assert rel_err(ag, jax.nn.gelu(local)) < 1e-5
    # The reduce-scatter's input was tp copies of x: its row blocks sum to tp * (x @ w).
    assert rel_err(rs, TP * (np.asarray(x) @ np.asarray(w)) + np.asarray(b)) < 1e-5
    assert rel_err(ar, np.asarray(x) @ np.asarray(w) + np.asarray(b)) < 1e-5
    hidden = jax.nn.gelu(_copies(x, seq_axis) @ np.asarray(w_up))
    assert rel_err(mlp, _block_sum(hidden @ np.asarray(w_down), seq_axis)) < 1e-5


def _copies_jnp(x, seq_axis):
    return jnp.concatenate([x] * TP, axis=seq_axis)


def test_gated_mlp_is_its_local_gemms(mesh1d, rand, gemms):
    mesh = mesh1d(TP)
    x, w_gate_up, w_down = rand(M, K), rand(K, 2, N), rand(N, K)
    f = smap(lambda *a: jax_ub.gated_mlp(*a, "tp", impl="none"), mesh, (P(),) * 3, P("tp"))
    got = np.split(np.asarray(f(x, w_gate_up, w_down)), TP)[0]
    want = _block_sum(jax_ub.gated_mlp_reference(_copies(x), w_gate_up, w_down))
    assert rel_err(got, want) < 1e-5


def test_global_arrays_forward_and_backward_communicate_nothing(mesh1d, rand, gemms):
    """On global arrays under a mesh, forward and backward of a column-then-row pair:
    gradients of the operands' shapes, finite, and no collective in the lowered or
    compiled program; jax_ub's calls only on its own GEMMs (four: each op's forward and
    its input gradient), whose gradients equal those on XLA's."""
    mesh = mesh1d(TP)
    x, w1, w2 = rand(TP * M, 3, K), rand(K, TP * N), rand(TP * N, K)

    def loss(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp", impl="none")
        return jnp.sum(jnp.sin(jax_ub.matmul_reduce_scatter(h, w2, "tp", impl="none")))

    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("tp")))
        w1 = jax.device_put(w1, NamedSharding(mesh, P(None, "tp")))
        w2 = jax.device_put(w2, NamedSharding(mesh, P("tp", None)))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        grads = step(x, w1, w2)
        lowered = step.lower(x, w1, w2)
        texts = {"lowered": lowered.as_text(), "compiled": lowered.compile().as_text()}
    for g, a in zip(grads, (x, w1, w2)):
        assert g.shape == a.shape and np.all(np.isfinite(np.asarray(g)))
    for kind, text in texts.items():
        assert _collectives(kind, text) == [], kind
        assert len(_ub_calls(text)) == (4 if gemms == "ub" else 0), (kind, _ub_calls(text))
    if gemms == "ub":
        jax_ub.configure(bound_gemms="xla")
        with jax.set_mesh(mesh):
            want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
        for g, r in zip(grads, want):
            assert rel_err(g, r) < 1e-5


def test_explain_impl_says_none():
    choice = jax_ub.explain_impl("all_gather_matmul", (M, K), (K, N), jnp.float32, 2, impl="none")
    assert choice.impl == "none" and "removes the communication" in choice.reason
    jax_ub.configure(bound_gemms="ub")
    choice = jax_ub.explain_impl("all_gather_matmul", (M, K), (K, N), jnp.float32, 2, impl="none")
    assert choice.impl == "none" and "jax_ub's GEMMs" in choice.reason


def test_a_bound_on_gemms_jax_ub_cannot_run_is_named(mesh1d):
    """bound_gemms="ub" on operands jax_ub's GEMM does not take: an error naming why."""
    jax_ub.configure(bound_gemms="ub")
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="none"),
        mesh1d(TP),
        (P("tp"), P(None, "tp")),
        P(None, "tp"),
    )
    x, w = jnp.ones((M, K), jnp.float32), jnp.ones((K, N), jnp.bfloat16)
    with pytest.raises(ValueError, match="bound_gemms='ub' cannot run jax_ub's GEMM here: x and w"):
        f(x, w)


def test_bound_gemms_is_validated():
    with pytest.raises(
        ValueError, match=r"bound_gemms must be one of \('xla', 'ub'\), got 'cublas'"
    ):
        jax_ub.configure(bound_gemms="cublas")


@pytest.mark.slow  # a whole model: the slow tier (conftest.py)
def test_llama_step_has_no_row_collectives(mesh2d, gemms):
    """The model with impl="none" (the model benchmark's bounds): none of the ops' gathers
    and reduce-scatters (JAX's names for them, which impl="xla" shows) in its compiled
    step, and jax_ub's calls only on its own GEMMs. What stays: the loss's all-reduces over
    the vocabulary's split and dp's (the gradients', the embedding table's scatter-add
    over dp)."""
    rows = r'op_name="[^"]*shard_map/(all_gather|reduce_scatter)"'
    found = {}
    for impl in ("xla", "none"):
        _, compiled = llama_step_texts(mesh2d(2, 2), impl=impl)
        found[impl] = set(re.findall(rows, compiled))
        if impl == "none":
            assert bool(_ub_calls(compiled)) == (gemms == "ub")
    assert found == {"xla": {"all_gather", "reduce_scatter"}, "none": set()}, found


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPS))
def test_the_bound_on_jax_ubs_gemms_is_the_bound_on_xlas(rand, name, mode):
    """Every op, in every way to call it (the gradient matrix's), with its biases: the value
    and gradients of impl="none" on jax_ub's GEMMs equal those on XLA's (the same local
    math, other GEMM kernels)."""
    op = OPS[name]
    operands, cot = make_operands(rand, op, 0, bias=bool(op.biases))
    got = {}
    for gemms in ("xla", "ub"):
        jax_ub.configure(bound_gemms=gemms)
        got[gemms] = run(op, mode, "none", 0, operands, cot)
    check(got["ub"], got["xla"], f"{name} {mode}", 1e-5)
