"""Every public op's value and gradients against ``jax.grad`` of the same math in plain,
unsharded JAX, in every way to call it: shard_map over every mesh axis and partial-auto
(tp manual, dp left to XLA), each with ``check_vma`` True and False, and plain ``jit`` on
global arrays under ``jax.set_mesh`` and with no mesh set (found from the arrays' shardings);
with and without biases, ``seq_axis`` 0 and 1, impl ``"ub"`` and ``"xla"`` (and ``"auto"``
under jit: ``MODE_IMPLS``). A (dp=2, tp=2) mesh of CPU devices, float32.

The oracle shares no code with jax_ub: a wrong scale of any gradient (the 1/tp of a
replicated output's cotangent under an unchecked shard_map, say) fails here whatever the
impl. The Flax layers' matrix is ``test_grad_matrix_flax.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh, rel_err, use_tuning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub

# seq, batch, features in, hidden, out: distinct, and split evenly by tp = 2, 4 and 8
S, B, K, F, N = 8, 4, 16, 24, 40
# "jit_nomesh": plain jit on arrays sharded over the mesh, with no mesh set (the mesh found
# in the arrays' types, its devices where the program lowers).
MODES = ["smap_vma", "smap_novma", "partial_vma", "partial_novma", "jit", "jit_nomesh"]
IMPLS = ["ub", "xla", "auto"]
TOL = 2e-5


@dataclasses.dataclass(frozen=True)
class Op:
    """One public op: how to call it, its dense math, and how its operands lie over tp.

    ``x_tp`` is which of x's dims tp splits ("seq" or "features"), likewise ``out_tp``
    ("seq", "features" or None: replicated); ``specs`` the weights' and biases' specs."""

    call: Callable
    dense: Callable
    x_tp: str
    out_tp: str | None
    weights: tuple[tuple[int, ...], ...]
    weight_specs: tuple[P, ...]
    biases: tuple[tuple[int, ...], ...] = ()
    bias_specs: tuple[P, ...] = ()


def _gelu(y):
    return jax.nn.gelu(y, approximate=True)


def _dense_gated(x, wgu, wd):
    return (jax.nn.silu(x @ wgu[:, 0]) * (x @ wgu[:, 1])) @ wd


OPS = {
    "all_gather_matmul": Op(
        call=lambda x, w, b=None, **kw: jax_ub.all_gather_matmul(x, w, "tp", bias=b, **kw),
        dense=lambda x, w, b=None: x @ w + (0 if b is None else b),
        x_tp="seq",
        out_tp="features",
        weights=((K, N),),
        weight_specs=(P(None, "tp"),),
        biases=((N,),),
        bias_specs=(P("tp"),),
    ),
    "matmul_reduce_scatter": Op(
        call=lambda x, w, b=None, **kw: jax_ub.matmul_reduce_scatter(x, w, "tp", bias=b, **kw),
        dense=lambda x, w, b=None: x @ w + (0 if b is None else b),
        x_tp="features",
        out_tp="seq",
        weights=((K, N),),
        weight_specs=(P("tp", None),),
        biases=((N,),),
        bias_specs=(P(),),
    ),
    "matmul_all_reduce": Op(
        call=lambda x, w, b=None, **kw: jax_ub.matmul_all_reduce(x, w, "tp", bias=b, **kw),
        dense=lambda x, w, b=None: x @ w + (0 if b is None else b),
        x_tp="features",
        out_tp=None,
        weights=((K, N),),
        weight_specs=(P("tp", None),),
        biases=((N,),),
        bias_specs=(P(),),
    ),
    "gelu_mlp": Op(
        call=lambda x, wu, wd, bu=None, bd=None, **kw: jax_ub.gelu_mlp(
            x, wu, wd, "tp", up_bias=bu, down_bias=bd, **kw
        ),
        dense=lambda x, wu, wd, bu=None, bd=None: (
            _gelu(x @ wu + (0 if bu is None else bu)) @ wd + (0 if bd is None else bd)
        ),
        x_tp="seq",
        out_tp="seq",
        weights=((K, F), (F, N)),
        weight_specs=(P(None, "tp"), P("tp", None)),
        biases=((F,), (N,)),
        bias_specs=(P("tp"), P()),
    ),
    "gated_mlp": Op(
        call=lambda x, wgu, wd, **kw: jax_ub.gated_mlp(x, wgu, wd, "tp", **kw),
        dense=_dense_gated,
        x_tp="seq",
        out_tp="seq",
        weights=((K, 2, F), (F, N)),
        weight_specs=(P(None, None, "tp"), P("tp", None)),
    ),
}


def activation_spec(ndim: int, seq_axis: int, tp: str | None, dp: bool) -> P:
    """The spec of ``[seq, batch, d]`` (or ``[batch, seq, d]``): ``tp`` splits "seq",
    "features" or nothing; with ``dp`` the batch is split over dp too."""
    spec: list = [None] * ndim
    if dp:
        spec[1 - seq_axis] = "dp"
    if tp == "seq":
        spec[seq_axis] = "tp"
    elif tp == "features":
        spec[-1] = "tp"
    return P(*spec)


def calls_jax_ub(op: Op, impl: str, mesh) -> bool:
    """Whether ``op`` runs jax_ub's calls: not with XLA's collectives nor the bound on XLA's
    GEMMs; matmul_all_reduce runs XLA's dot on a group of one and in either bound."""
    if impl == "xla" or (impl == "none" and jax_ub.config.bound_gemms == "xla"):
        return False
    all_reduce = op is OPS["matmul_all_reduce"]
    return not (all_reduce and (mesh.shape["tp"] == 1 or impl == "none"))


def run(op: Op, mode: str, impl: str, seq_axis: int, operands, cot, mesh=None):
    """``(value, grads of every operand)`` of ``sum(op(...) * cot)``, called as ``mode`` says,
    on ``mesh`` (axes ``("dp", "tp")``; default: 2 x 2 CPU devices)."""
    x, *params = operands
    n_w = len(op.weights)
    specs = op.weight_specs + op.bias_specs[: len(params) - n_w]
    mesh = make_mesh((2, "dp"), (2, "tp")) if mesh is None else mesh
    full_mesh = mode.startswith("smap")

    def body(x, *params):
        return op.call(x, *params, impl=impl, seq_axis=seq_axis)

    x_spec = activation_spec(3, seq_axis, op.x_tp, dp=full_mesh)
    out_spec = activation_spec(3, seq_axis, op.out_tp, dp=full_mesh)
    if mode.startswith("jit"):
        f = body
    else:
        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(x_spec, *specs),
            out_specs=out_spec,
            axis_names={"dp", "tp"} if full_mesh else {"tp"},
            check_vma=mode.endswith("_vma"),
        )

    def loss(*args):
        y = f(*args)
        return jnp.sum(jnp.sin(y) * cot), y

    placed = [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in zip(operands, (activation_spec(3, seq_axis, op.x_tp, True), *specs))
    ]
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(operands))), has_aux=True))
    if mode == "jit_nomesh":
        (_, y), grads = grad(*placed)
        plain = not calls_jax_ub(op, impl, mesh)
        assert ("custom_call @jax_ub_" in grad.lower(*placed).as_text()) != plain
    else:
        with jax.set_mesh(mesh):
            (_, y), grads = grad(*placed)
    return y, grads


def reference(op: Op, operands, cot):
    def loss(*args):
        y = op.dense(*args)
        return jnp.sum(jnp.sin(y) * cot), y

    argnums = tuple(range(len(operands)))
    with jax.default_matmul_precision("highest"):
        (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*operands)
    return y, grads


def make_operands(rand, op: Op, seq_axis: int, bias: bool):
    x = rand(S, B, K) if seq_axis == 0 else rand(B, S, K)
    params = [rand(*shape, scale=0.3) for shape in op.weights]
    if bias:
        params += [rand(*shape) for shape in op.biases]
    cot = rand(*x.shape[:-1], N)
    return (x, *params), cot


def check(got, want, what: str, tol: float = TOL) -> None:
    (y, grads), (y_ref, grads_ref) = got, want
    errors = {"value": rel_err(y, y_ref)}
    errors |= {f"d{i}": rel_err(g, g_ref) for i, (g, g_ref) in enumerate(zip(grads, grads_ref))}
    bad = {k: f"{e:.2e}" for k, e in errors.items() if not e < tol}
    assert not bad, f"{what}: relative errors {bad} (d0 is x's gradient)"


# On CPU devices impl="auto" runs the host protocol, as "ub" does: its column only in the
# modes where resolving it differs (the mesh from the context, from the arrays' types).
MODE_IMPLS = [(m, i) for m in MODES for i in IMPLS if i != "auto" or m in ("jit", "jit_nomesh")]


@pytest.mark.parametrize("mode,impl", MODE_IMPLS, ids=[f"{m}-{i}" for m, i in MODE_IMPLS])
@pytest.mark.parametrize("name", list(OPS))
def test_op_gradients(rand, name, mode, impl):
    """The op with and without biases, sequence dim 0 and 1 (four calls of one case)."""
    check_op(rand, name, mode, impl)


# The in-turn schedule and the group of one change what runs inside the calls, not how they
# are traced: each in a shard_map over both axes, a partial-auto one and plain jit.
INNER_MODES = ["smap_vma", "partial_vma", "partial_novma", "jit_nomesh"]


@pytest.mark.parametrize("mode", INNER_MODES)
@pytest.mark.parametrize("name", list(OPS))
def test_op_gradients_on_a_group_of_one(rand, name, mode):
    """tp = 1 (dp = 2), impl="ub": the ops' own GEMMs with nothing to move; the backward's
    all_gather(x) is x itself, not a copy made in the call. (matmul_all_reduce runs XLA's
    dot on a group of one, its product typed as the sum's where shard_map checks types.)"""
    check_op(rand, name, mode, "ub", mesh=make_mesh((2, "dp"), (1, "tp")))


@pytest.mark.parametrize("mode", ["smap_novma", "partial_vma", "jit_nomesh"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_gradients_with_the_all_gather_in_turn(rand, name, mode):
    """tp = 4 (dp = 2), impl="ub", the all-gather forced in turn (Tuning.all_gather_in_turn,
    by default only for long GEMMs): the forward's and the backward's all-gathers push to one
    peer at a time and multiply the chunks as they land."""
    jax_ub.finalize()  # communicators take the setting when they are created
    use_tuning(all_gather_in_turn=True)
    try:
        check_op(rand, name, mode, "ub", mesh=make_mesh((2, "dp"), (4, "tp")))
    finally:
        jax_ub.finalize()


# Schedules a tuning choice forces where the defaults take them only for long GEMMs, each with
# the all-gather in turn: GEMMs taking turns on two lanes (Tuning.two_gemm_lanes: the forward's
# and the backward's all-gather GEMMs and reduce-scatter partials), the all-gather's flag GEMM
# (Tuning.all_gather_flag_gemm: every chunk in one GEMM that waits for each chunk itself), and
# the reduce-scatter's signal GEMM (Tuning.reduce_scatter_signal_gemm: every partial in one GEMM
# that raises each block's flag, the forward's and the backward's reduce-scatters).
FORCED_SCHEDULES = {
    "two_gemm_lanes": {"all_gather_in_turn": True, "two_gemm_lanes": True},
    "flag_gemm": {"all_gather_in_turn": True, "all_gather_flag_gemm": True},
    "signal_gemm": {"reduce_scatter_signal_gemm": True},
}


@pytest.mark.parametrize("schedule", list(FORCED_SCHEDULES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPS))
def test_op_gradients_with_forced_schedules(rand, name, mode, schedule):
    """tp = 4 (dp = 2), impl="ub", a schedule of FORCED_SCHEDULES forced on, in every way to
    call."""
    jax_ub.finalize()  # communicators take the setting when they are created
    use_tuning(**FORCED_SCHEDULES[schedule])
    try:
        check_op(rand, name, mode, "ub", mesh=make_mesh((2, "dp"), (4, "tp")))
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("mode", ["smap_vma", "partial_novma", "jit"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_gradients_with_the_early_sum(rand, name, mode):
    """tp = 4 (dp = 2), impl="ub", by default: the reduce-scatters (forward's or backward's)
    sum the partials landed before the last peer's beside their GEMMs
    (Tuning.reduce_scatter_early_sum, at these short k); with the in-turn test's three modes,
    every way to call."""
    check_op(rand, name, mode, "ub", mesh=make_mesh((2, "dp"), (4, "tp")))


@pytest.mark.parametrize("mode", MODES)
def test_xla_all_reduce_gradients_on_a_group_of_one(rand, mode):
    """tp = 1 (dp = 2), matmul_all_reduce with impl="xla": its all-reduce over the size-1
    axis is the value itself, typed as psum's result (XLA's SPMD partitioner rejects that
    all-reduce in some partly manual shard_maps: ``unfused.all_reduce``); its gradients
    through that typing in every way to call."""
    check_op(rand, "matmul_all_reduce", mode, "xla", mesh=make_mesh((2, "dp"), (1, "tp")))


def check_op(rand, name: str, mode: str, impl: str, mesh=None, tol: float = TOL) -> None:
    """The op with and without biases, sequence dim 0 and 1, against the reference."""
    op = OPS[name]
    for seq_axis in (0, 1):
        for bias in (False, True) if op.biases else (False,):
            operands, cot = make_operands(rand, op, seq_axis, bias)
            got = run(op, mode, impl, seq_axis, operands, cot, mesh)
            want = reference(op, operands, cot)
            check(got, want, f"{name} {mode} {impl} {seq_axis=} {bias=}", tol)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("impl", IMPLS)
def test_all_reduced_output_feeding_rank_varying_math(rand, impl, check_vma):
    """matmul_all_reduce's replicated output multiplied by a column shard on each rank
    (Megatron's row- then column-parallel layers without sequence parallelism): each
    rank's cotangent of the output differs, and the true one is their sum."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w1, w2, cot = rand(S, B, K), rand(K, N, scale=0.3), rand(N, F, scale=0.3), rand(S, B, F)

    def body(x, w1, w2):
        return jnp.tanh(jax_ub.matmul_all_reduce(x, w1, "tp", impl=impl)) @ w2

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(None, "dp", "tp"), P("tp", None), P(None, "tp")),
        out_specs=P(None, "dp", "tp"),
        check_vma=check_vma,
    )

    def loss(f, *args):
        return jnp.sum(jnp.sin(f(*args)) * cot)

    got = jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 2)))(x, w1, w2)
    with jax.default_matmul_precision("highest"):
        want = jax.grad(lambda *a: loss(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, *a), (0, 1, 2))(
            x, w1, w2
        )
    for name, g, g_ref in zip(("dx", "dw1", "dw2"), got, want):
        assert rel_err(g, g_ref) < TOL, name
