"""The epilogues (CPU devices, the host protocol emulating cuBLASLt's): all_gather_matmul's bias
and GELU, in the custom call, forward and gradients against a float32 numpy reference and
against impl="xla"; matmul_reduce_scatter's bias, added once after the reduction; fp8 with an
epilogue; batch dims, partial-auto meshes, global arrays; the HLO; bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import op_operands
from conftest import make_mesh, rel_err, smap, to_f32, tol
from jax.sharding import PartitionSpec as P

import jax_ub

EPILOGUES = [(True, None), (False, "gelu"), (True, "gelu")]  # (bias, activation)


def gelu_np(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))


def ag_epilogue_fn(mesh, impl="ub", activation=None, nbatch=0, **kw):
    """jit(shard_map(all_gather_matmul(x, w, bias=b))): x row-, w and b column-sharded."""
    rest = (None,) * nbatch
    return smap(
        lambda x, w, b: jax_ub.all_gather_matmul(
            x, w, "tp", bias=b, activation=activation, impl=impl, **kw
        ),
        mesh,
        (P("tp", *rest), P(None, "tp"), P("tp")),
        P(None, *rest, "tp"),
    )


def rs_bias_fn(mesh, impl="ub"):
    """jit(shard_map(matmul_reduce_scatter(x, w, bias=b))): b replicated."""
    return smap(
        lambda x, w, b: jax_ub.matmul_reduce_scatter(x, w, "tp", bias=b, impl=impl),
        mesh,
        (P(None, "tp"), P("tp", None), P()),
        P("tp", None),
    )


def ag_reference(x, w, b, activation):
    y = to_f32(x) @ to_f32(w) + (0 if b is None else to_f32(b))
    return gelu_np(y) if activation == "gelu" else y


def loss(f):
    """A scalar of f's output whose gradient is not uniform (so dgelu and dbias are tested)."""
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)) * 1.5)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("with_bias,activation", EPILOGUES)
def test_all_gather_matmul_epilogue_forward(mesh1d, rand, tp, with_bias, activation):
    x, w = op_operands(rand, "ag", tp, 8, 32, 16)
    b = rand(w.shape[1]) if with_bias else jnp.zeros((w.shape[1],), jnp.float32)
    y = ag_epilogue_fn(mesh1d(tp), activation=activation)(x, w, b)
    assert rel_err(y, ag_reference(x, w, b, activation)) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_bias,activation", EPILOGUES)
def test_all_gather_matmul_epilogue_grads(mesh1d, rand, dtype, with_bias, activation):
    """dx (through the overlapped RS), dw and dbias through GELU's backward, against XLA."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=dtype, scale=0.5)
    b = rand(w.shape[1], dtype=dtype)
    if not with_bias:
        b = b * 0  # still an operand: its gradient is that of a zero bias
    ub = jax.grad(loss(ag_epilogue_fn(mesh, "ub", activation)), argnums=(0, 1, 2))(x, w, b)
    ref = jax.grad(loss(ag_epilogue_fn(mesh, "xla", activation)), argnums=(0, 1, 2))(x, w, b)
    for name, got, want in zip(("dx", "dw", "dbias"), ub, ref):
        assert got.dtype == want.dtype, name
        assert rel_err(got, want) < tol(dtype), name


def test_no_bias_gelu_grads(mesh1d, rand):
    """GELU alone (no bias operand at all): the custom VJP's bias slot stays empty."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 32, 16)

    def fn(impl):
        return smap(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", activation="gelu", impl=impl),
            mesh,
            (P("tp"), P(None, "tp")),
            P(None, "tp"),
        )

    ub = jax.grad(loss(fn("ub")), argnums=(0, 1))(x, w)
    ref = jax.grad(loss(fn("xla")), argnums=(0, 1))(x, w)
    assert rel_err(fn("ub")(x, w), ag_reference(x, w, None, "gelu")) < 1e-5
    for got, want in zip(ub, ref):
        assert rel_err(got, want) < 1e-5


def test_epilogue_with_batch_dims_and_gathered(mesh1d, rand):
    """x [rows, batch, k]; return_gathered also hands back the gathered x, whose cotangent
    joins dx."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 4, 16, 8, batch=(3,))
    b = rand(w.shape[1])

    def fn(impl):
        def body(x, w, b):
            y, g = jax_ub.all_gather_matmul(
                x, w, "tp", bias=b, activation="gelu", impl=impl, return_gathered=True
            )
            return y, g

        return smap(body, mesh, (P("tp"), P(None, "tp"), P("tp")), (P(None, None, "tp"), P("tp")))

    y, g = fn("ub")(x, w, b)
    assert rel_err(y, ag_reference(x, w, b, "gelu")) < 1e-5
    assert rel_err(g, np.concatenate([x, x])) == 0.0  # each rank's copy, stacked

    def scalar(impl):
        return lambda x, w, b: sum(
            jnp.sum(jnp.cos(o) * (i + 1)) for i, o in enumerate(fn(impl)(x, w, b))
        )

    ub = jax.grad(scalar("ub"), argnums=(0, 1, 2))(x, w, b)
    ref = jax.grad(scalar("xla"), argnums=(0, 1, 2))(x, w, b)
    for got, want in zip(ub, ref):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_matmul_reduce_scatter_bias(mesh1d, rand, tp):
    """The bias is added once, after the reduction; its gradient sums over every rank's rows."""
    mesh = mesh1d(tp)
    x, w = op_operands(rand, "rs", tp, 4, 8, 16)
    b = rand(w.shape[1])
    y = rs_bias_fn(mesh)(x, w, b)
    assert rel_err(y, to_f32(x) @ to_f32(w) + to_f32(b)) < 1e-5
    ub = jax.grad(loss(rs_bias_fn(mesh, "ub")), argnums=(0, 1, 2))(x, w, b)
    ref = jax.grad(loss(rs_bias_fn(mesh, "xla")), argnums=(0, 1, 2))(x, w, b)
    for got, want in zip(ub, ref):
        assert rel_err(got, want) < 1e-5


def test_fp8_with_bias_and_gelu(mesh1d, rand):
    """fp8 operands, the epilogue on the dequantized product: ub against xla's same math."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=jnp.bfloat16)
    b = rand(w.shape[1], dtype=jnp.bfloat16)

    def fn(impl):
        return ag_epilogue_fn(mesh, impl, "gelu", fp8=jax_ub.Fp8Scales())

    y_ub, y_xla = fn("ub")(x, w, b), fn("xla")(x, w, b)
    assert rel_err(y_ub, y_xla) < 1e-2
    # fp8 keeps the epilogue close to the bf16 one (quantization error only).
    assert rel_err(y_ub, ag_reference(x, w, b, "gelu")) < 0.1
    ub = jax.grad(loss(fn("ub")), argnums=(0, 1, 2))(x, w, b)
    ref = jax.grad(loss(fn("xla")), argnums=(0, 1, 2))(x, w, b)
    # The epilogue rounds once in float32 (ub) or after each bf16 step (xla); GELU's
    # gradient then goes through e5m2 (2 mantissa bits), which turns those last-bit
    # differences into a few elements a quantization step apart.
    for name, got, want in zip(("dx", "dw", "dbias"), ub, ref):
        assert rel_err(got, want) < 5e-2, name


def test_epilogue_on_partial_auto_mesh(rand):
    """(dp, tp) mesh, shard_map manual over tp only: the batch stays sharded over dp and the
    bias travels replicated over it into the nested call."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w = op_operands(rand, "ag", 2, 4, 16, 8, batch=(2,))
    b = rand(w.shape[1])
    f = jax.jit(
        jax.shard_map(
            lambda x, w, b: jax_ub.all_gather_matmul(x, w, "tp", bias=b, activation="gelu"),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp"), P("tp")),
            out_specs=P(None, None, "tp"),
            axis_names={"tp"},
        )
    )
    x_dp = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp", "dp")))
    assert "jax_ub_all_gather_matmul" in f.lower(x_dp, w, b).as_text()
    assert rel_err(f(x_dp, w, b), ag_reference(x, w, b, "gelu")) < 1e-5


def test_epilogue_on_global_arrays(mesh1d, rand):
    """Plain jit under jax.set_mesh: the bias follows w's columns (AG) or is replicated (RS)."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 16, 8)
    b = rand(w.shape[1])
    with jax.set_mesh(mesh):
        ag = jax.jit(functools.partial(jax_ub.all_gather_matmul, axis_name="tp", activation="gelu"))
        y = ag(x, w, bias=b)
        assert rel_err(y, ag_reference(x, w, b, "gelu")) < 1e-5
        xr, wr = op_operands(rand, "rs", 2, 4, 8, 16)
        br = rand(wr.shape[1])
        yr = jax.jit(lambda x, w, b: jax_ub.matmul_reduce_scatter(x, w, "tp", bias=b))(xr, wr, br)
    assert rel_err(yr, to_f32(xr) @ to_f32(wr) + to_f32(br)) < 1e-5


def test_epilogue_runs_in_the_custom_call(mesh1d, rand):
    """No GELU or bias add is left in the forward's HLO (they run in the GEMMs); the custom
    call is told gelu and gets the bias. impl="xla" computes GELU in XLA (tanh)."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 16, 8)
    b = rand(w.shape[1])
    text = ag_epilogue_fn(mesh, "ub", "gelu").lower(x, w, b).as_text()
    call = [ln for ln in text.splitlines() if "jax_ub_all_gather_matmul" in ln]
    assert call and "gelu = true" in call[0]
    assert "tanh" not in text and "stablehlo.add" not in text
    assert "tanh" in ag_epilogue_fn(mesh, "xla", "gelu").lower(x, w, b).as_text()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(activation="relu"), r"activation must be one of \(None, 'gelu'\).*'relu'"),
        (dict(bias=np.ones((7,), np.float32)), r"bias must be \[n\] = \[16\].*\(7,\)"),
        (dict(bias=np.ones((16, 1), np.float32)), r"bias must be \[n\].*\(16, 1\)"),
        (dict(bias=np.ones((16,), np.int32)), "bias must be floating point"),
    ],
)
def test_bad_epilogue_arguments(mesh1d, rand, kwargs, match):
    x, w = rand(8, 32), rand(32, 16)
    for op in (jax_ub.all_gather_matmul, jax_ub.matmul_reduce_scatter):
        if op is jax_ub.matmul_reduce_scatter and "activation" in kwargs:
            continue  # the reduce-scatter takes no activation
        with pytest.raises(ValueError, match=match):
            smap(lambda x, w, op=op: op(x, w, "tp", **kwargs), mesh1d(2), (P(), P()), P())(x, w)
