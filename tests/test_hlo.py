"""impl="ub" programs contain the userbuffer custom calls and no XLA collectives.

Both the lowered StableHLO and the compiled (SPMD-partitioned, optimized) HLO are checked:
the first shows what jax_ub emits, the second that XLA added no collective of its own.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from _programs import assert_each_call_compiled_once, llama_step_texts
from conftest import smap
from jax.sharding import PartitionSpec as P

import jax_ub

AG_TARGET = "jax_ub_all_gather_matmul"
RS_TARGET = "jax_ub_matmul_reduce_scatter"

# Collective ops by their StableHLO and HLO spellings. The custom call targets contain
# "all_gather" / "reduce_scatter" too, hence matching the op syntax rather than the words.
_COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "collective_permute",
    "all_to_all",
    "collective_broadcast",
)
_STABLEHLO_COLLECTIVE = re.compile(r"\b(?:stablehlo|mhlo)\.(" + "|".join(_COLLECTIVES) + r")\b")
_HLO_COLLECTIVE = re.compile(
    r"\b(" + "|".join(c.replace("_", "-") for c in _COLLECTIVES) + r")(?:-start|-done)?\("
)


def _custom_call_targets(text: str) -> list[str]:
    """Targets of every custom call, in StableHLO (`@name`) or HLO (`custom_call_target=`)."""
    return re.findall(r"custom_call @(\w+)", text) + re.findall(r'custom_call_target="(\w+)"', text)


def _texts(f, *args):
    lowered = f.lower(*args)
    return {"lowered": lowered.as_text(), "compiled": lowered.compile().as_text()}


def _collectives(kind: str, text: str) -> list[str]:
    pattern = _STABLEHLO_COLLECTIVE if kind == "lowered" else _HLO_COLLECTIVE
    return sorted(set(pattern.findall(text)))


def _ag(mesh, impl, **kw):
    return smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl, **kw),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=(P(None, "tp"), P("tp")) if kw.get("return_gathered") else P(None, "tp"),
    )


def _rs(mesh, impl):
    return smap(
        lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", impl=impl),
        mesh,
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=P("tp"),
    )


def _local_grad(op, impl):
    """d/d(x, w) of a per-rank loss, all inside shard_map: no collective beyond the op's."""

    def body(x, w):
        def loss(x, w):
            return jnp.sum(jnp.sin(op(x, w, "tp", impl=impl)))

        return jax.grad(loss, argnums=(0, 1))(x, w)

    return body


@pytest.fixture
def operands(rand):
    # 4 ranks; shapes valid for both ops' layouts below.
    return rand(4 * 8, 16), rand(16, 4 * 8)


@pytest.mark.parametrize("kind", ["lowered", "compiled"])
@pytest.mark.parametrize("return_gathered", [False, True])
def test_all_gather_matmul_ub_has_no_collectives(mesh1d, operands, kind, return_gathered):
    text = _texts(_ag(mesh1d(4), "ub", return_gathered=return_gathered), *operands)[kind]
    assert _custom_call_targets(text).count(AG_TARGET) == 1, text
    assert _collectives(kind, text) == [], text


@pytest.mark.parametrize("kind", ["lowered", "compiled"])
def test_matmul_reduce_scatter_ub_has_no_collectives(mesh1d, rand, kind):
    x, w = rand(4 * 8, 4 * 8), rand(4 * 8, 16)
    text = _texts(_rs(mesh1d(4), "ub"), x, w)[kind]
    assert _custom_call_targets(text).count(RS_TARGET) == 1, text
    assert _collectives(kind, text) == [], text


@pytest.mark.parametrize("kind", ["lowered", "compiled"])
def test_all_gather_matmul_grad_has_only_custom_calls(mesh1d, operands, kind):
    """Forward: AG+GEMM (keeping the gathered x); backward: dx by the GEMM+RS custom call."""
    f = smap(
        _local_grad(jax_ub.all_gather_matmul, "ub"),
        mesh1d(4),
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=(P("tp"), P(None, "tp")),
    )
    text = _texts(f, *operands)[kind]
    targets = _custom_call_targets(text)
    assert targets.count(AG_TARGET) == 1, text
    assert targets.count(RS_TARGET) == 1, text
    assert _collectives(kind, text) == [], text


@pytest.mark.parametrize("kind", ["lowered", "compiled"])
def test_matmul_reduce_scatter_grad_has_only_custom_calls(mesh1d, rand, kind):
    """Forward: GEMM+RS; backward: dy gathered once by the AG+GEMM custom call."""
    x, w = rand(4 * 8, 4 * 8), rand(4 * 8, 16)
    f = smap(
        _local_grad(jax_ub.matmul_reduce_scatter, "ub"),
        mesh1d(4),
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=(P(None, "tp"), P("tp")),
    )
    text = _texts(f, x, w)[kind]
    targets = _custom_call_targets(text)
    assert targets.count(RS_TARGET) == 1, text
    assert targets.count(AG_TARGET) == 1, text
    assert _collectives(kind, text) == [], text


def test_custom_calls_carry_the_communicator_id(mesh1d, operands):
    text = _ag(mesh1d(4), "ub").lower(*operands).as_text()
    (comm,) = [c for c in jax_ub.live_communicators() if c.group_size == 4]
    assert re.search(rf"comm_id = {comm.id} : i64", text), text


def test_unscaled_calls_take_their_scales_from_a_constant(mesh1d, operands, rand):
    """A call not in fp8 reads its scales operand from a constant buffer: no instruction
    (on GPUs a kernel launched before every call) computes it."""
    rs_operands = (rand(4 * 8, 4 * 8), rand(4 * 8, 16))
    for f, args in ((_ag(mesh1d(4), "ub"), operands), (_rs(mesh1d(4), "ub"), rs_operands)):
        text = _texts(f, *args)["compiled"]
        calls = [ln for ln in text.splitlines() if "custom_call_target=" in ln]
        assert calls, text
        for call in calls:
            scales = re.search(r"custom-call\(%[\w.]+, %[\w.]+, %([\w.]+)", call).group(1)
            (definition,) = [ln for ln in text.splitlines() if f"%{scales} = " in ln]
            assert "f32[8]{0} constant({1, 0, 0, 0, 1, 0, 0, 0})" in definition, definition


@pytest.mark.parametrize("kind", ["lowered", "compiled"])
def test_xla_impl_uses_collectives(mesh1d, operands, rand, kind):
    """Sanity check of the matchers: the reference path does show its collectives."""
    ag = _texts(_ag(mesh1d(4), "xla"), *operands)[kind]
    assert _collectives(kind, ag) == ["all_gather" if kind == "lowered" else "all-gather"]
    assert AG_TARGET not in _custom_call_targets(ag)
    rs = _texts(_rs(mesh1d(4), "xla"), rand(4 * 8, 4 * 8), rand(4 * 8, 16))[kind]
    assert _collectives(kind, rs) == ["reduce_scatter" if kind == "lowered" else "reduce-scatter"]
    assert RS_TARGET not in _custom_call_targets(rs)


def test_xla_impl_grad_uses_collectives(mesh1d, operands):
    f = smap(
        _local_grad(jax_ub.all_gather_matmul, "xla"),
        mesh1d(4),
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=(P("tp"), P(None, "tp")),
    )
    text = _texts(f, *operands)["compiled"]
    assert _collectives("compiled", text) == ["all-gather", "reduce-scatter"]


def _custom_call_weights(text: str) -> dict[str, str]:
    """Compiled HLO: the second operand (the weight) of each jax_ub custom call, by target."""
    calls = re.findall(r"custom-call\(([^)]*)\), custom_call_target=\"(jax_ub_\w+)\"", text)
    return {target: operands.split(",")[1].strip() for operands, target in calls}


@pytest.mark.parametrize(
    "op, in_specs",
    [
        (jax_ub.all_gather_matmul, (P("tp"), P(None, "tp"))),
        (jax_ub.matmul_reduce_scatter, (P(None, "tp"), P("tp"))),
    ],
)
def test_backward_reads_the_weight_in_place(mesh1d, rand, op, in_specs):
    """The backward op multiplies by w.T without a transposed copy: both custom calls take
    the weight parameter itself, and the compiled program has no transpose."""
    f = smap(_local_grad(op, "ub"), mesh1d(4), in_specs=in_specs, out_specs=in_specs)
    text = _texts(f, rand(4 * 8, 4 * 8), rand(4 * 8, 4 * 8))["compiled"]
    weights = _custom_call_weights(text)
    assert set(weights) == {AG_TARGET, RS_TARGET}, text
    assert weights[AG_TARGET] == weights[RS_TARGET], weights
    assert not re.search(r"\btranspose\(%", text), text  # an op, not op_name metadata


@pytest.mark.parametrize("scan_unroll", [True, 1])
def test_custom_calls_take_their_operands_through_a_barrier(mesh2d, scan_unroll):
    """A Llama whose blocks are scanned (unrolled, or a loop) over stacked params: every
    jax_ub custom call takes its operands through an optimization barrier and gives its
    results to one, which keeps XLA's GPU dynamic-slice fusion from repeating the call
    (test_gpu_models.py counts the calls that the GPU compiler keeps; on CPU the unrolled
    step has each call once too)."""
    lowered, compiled = llama_step_texts(mesh2d(2, 2), scan_unroll=scan_unroll)
    if scan_unroll is True:
        assert_each_call_compiled_once(compiled, layers=2)
    calls = re.findall(r"custom_call @jax_ub_\w+\(([^)]*)\)", lowered)
    barriers = re.findall(r"(%[\w#:]+) = stablehlo\.optimization_barrier", lowered)
    produced = {b.split(":")[0] for b in barriers}
    # x reaches the call flattened to 2-D: a reshape of the barrier's result
    reshaped = re.findall(r"(%\w+) = stablehlo\.reshape (%\w+)#", lowered)
    produced |= {r for r, src in reshaped if src in produced}
    assert calls
    for operands in calls:
        for operand in re.findall(r"%[\w]+", operands):
            assert operand in produced, (operand, operands)
    # Each call's results go to a barrier, all of them, on the next line.
    lines = lowered.splitlines()
    for i, line in enumerate(lines):
        call = re.search(r"(%\w+)(?::(\d+))? = stablehlo\.custom_call @jax_ub_", line)
        if call:
            n = int(call[2] or 1)
            results = ", ".join(f"{call[1]}#{k}" for k in range(n)) if n > 1 else call[1]
            assert f"stablehlo.optimization_barrier {results} :" in lines[i + 1], line


def _weight_grad_barriers(text: str) -> list[list[str]]:
    """The types of each optimization barrier in lowered StableHLO that takes a
    dot_general's result (an op's weight gradient; fp8's scaled and cast after it) with
    another value (its dx)."""
    defined = {
        name: (op, first)
        for name, op, first in re.findall(r"(%\w+)(?::\d+)? = stablehlo\.(\w+) (%\w+)?", text)
    }

    def origin(name):
        while defined.get(name, ("", ""))[0] in ("convert", "multiply", "reshape"):
            name = defined[name][1]
        return defined.get(name, ("", ""))[0]

    out = []
    for operands, types in re.findall(r"= stablehlo\.optimization_barrier ([^:]*) : (.*)", text):
        names = [o.strip().split("#")[0] for o in operands.split(",")]
        if len(names) == 2 and "dot_general" in map(origin, names):
            out.append(
                [
                    t.removesuffix("xf32").removesuffix("xbf16")
                    for t in re.findall(r"tensor<([^>]*)>", types)
                ]
            )
    return out


OPS = {"fp8_ag": "all_gather_matmul", "fp8_rs": "matmul_reduce_scatter"}


@pytest.mark.parametrize("op", ["ag", "rs", "gelu_mlp", "fp8_ag", "fp8_rs"])
def test_weight_grads_are_tied_to_their_layers_dx(mesh1d, rand, op):
    """Each op's backward ties its weight gradient's product to its dx, so that XLA cannot
    move the product to the optimizer at the step's end and keep the gathered operands it
    reads alive until then (ops/weight_grad.py::weight_grad_with)."""
    mesh = mesh1d(4)
    if op == "gelu_mlp":
        x, w_up, w_down = rand(4 * 8, 16), rand(16, 4 * 8), rand(4 * 8, 16)

        def loss(x, w_up, w_down):
            y = jax_ub.gelu_mlp(x, w_up, w_down, "tp", impl="ub")
            return jnp.sum(jnp.sin(y))

        body = jax.grad(loss, argnums=(0, 1, 2))
        specs = (P("tp"), P(None, "tp"), P("tp", None))
        f, args = smap(body, mesh, specs, specs), (x, w_up, w_down)
        # the down projection's dw [8, 16] with dp [32, 8]; the up projection's [16, 8] with dx
        want = [["32x8", "8x16"], ["8x16", "16x8"]]
    elif op.startswith("fp8"):
        # bf16 operands quantized in the op (current scaling); k and n multiples of 16
        fp8 = functools.partial(getattr(jax_ub, OPS[op]), fp8=jax_ub.Fp8Scales())
        shapes, specs = {
            "fp8_ag": (((64, 32), (32, 64)), (P("tp"), P(None, "tp"))),
            "fp8_rs": (((64, 64), (64, 32)), (P(None, "tp"), P("tp"))),
        }[op]
        f = smap(_local_grad(fp8, "ub"), mesh, in_specs=specs, out_specs=specs)
        args = tuple(rand(*shape, dtype=jnp.bfloat16) for shape in shapes)
        want = {"fp8_ag": [["16x32", "32x16"]], "fp8_rs": [["64x16", "16x32"]]}[op]
    elif op == "ag":
        f = smap(
            _local_grad(jax_ub.all_gather_matmul, "ub"),
            mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=(P("tp"), P(None, "tp")),
        )
        args, want = (rand(4 * 8, 16), rand(16, 4 * 8)), [["8x16", "16x8"]]
    else:
        f = smap(
            _local_grad(jax_ub.matmul_reduce_scatter, "ub"),
            mesh,
            in_specs=(P(None, "tp"), P("tp")),
            out_specs=(P(None, "tp"), P("tp")),
        )
        args, want = (rand(4 * 8, 4 * 8), rand(4 * 8, 16)), [["32x8", "8x16"]]
    got = _weight_grad_barriers(f.lower(*args).as_text())
    assert got == want, got


@pytest.mark.parametrize("op", [jax_ub.all_gather_matmul, jax_ub.matmul_reduce_scatter])
def test_a_group_of_one_copies_nothing_to_gather(mesh1d, rand, op):
    """On a group of one, all_gather(x) is x: neither op's backward asks its custom call for
    a gathered copy (a pass over x or dy per call), nor does return_gathered; the gradients
    are still plain JAX's."""
    x, w = rand(16, 8), rand(8, 12)
    f = smap(_local_grad(op, "ub"), mesh1d(1), (P(), P()), (P(), P()))
    text = _texts(f, x, w)["compiled"]
    results = re.findall(r"= \(([^)]*)\) custom-call\(", text)
    assert len(results) == 2, text  # the forward's call, the backward's dx call
    for result in results:
        extra = result.split(", ")[1:]  # after the product: gathered copies, GELU's input
        assert all(re.match(r"\w+\[0,", t) for t in extra), result

    def plain_loss(x, w):
        return jnp.sum(jnp.sin(x @ w))

    want = jax.grad(plain_loss, argnums=(0, 1))(x, w)
    for g, r in zip(f(x, w), want, strict=True):
        assert jnp.allclose(g, r, rtol=1e-5, atol=1e-5), float(jnp.max(jnp.abs(g - r)))

    ag = _ag(mesh1d(1), "ub", return_gathered=True)
    y, gathered = ag(x, w)
    assert (gathered == x).all()
    (result,) = re.findall(r"= \(([^)]*)\) custom-call\(", _texts(ag, x, w)["compiled"])
    assert re.match(r"\w+\[0,", result.split(", ")[1]), result
