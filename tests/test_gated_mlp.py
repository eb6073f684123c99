"""gated_mlp (SwiGLU / GeGLU) on CPU devices: forward and gradients against the unsharded
math in float32, inside shard_map and on global arrays over (dp, tp) meshes, batch-major,
fp8 against impl="xla", the HLO (x gathered once, no other collective), bad inputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err, smap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(")


def operands(rand, tp, m=4, k=16, f=8, n=12, batch=(2,)):
    """x [tp*m, *batch, k], w_gate_up [k, 2, tp*f], w_down [tp*f, n]."""
    return (
        rand(tp * m, *batch, k),
        rand(k, 2, tp * f, scale=0.4),
        rand(tp * f, n, scale=0.4),
    )


def local_fn(mesh, impl="ub", activation="silu", **kw):
    def body(x, wgu, wd):
        return jax_ub.gated_mlp(x, wgu, wd, "tp", activation=activation, impl=impl, **kw)

    return smap(body, mesh, (P("tp"), P(None, None, "tp"), P("tp", None)), P("tp"))


def loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))


def check_grads(f, args, activation="silu", tol=1e-5):
    ref = lambda *a: jax_ub.gated_mlp_reference(*a, activation=activation)  # noqa: E731
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float32) for a in args))
    for name, g, r in zip(("dx", "dw_gate_up", "dw_down"), got, want):
        assert rel_err(g, r) < tol, name


# The oracle's activations written out in NumPy: silu, and GELU's tanh form (jax.nn.gelu's
# default), so that the reference cannot share a wrong activation with the op.
NUMPY_ACTIVATIONS = {
    "silu": lambda v: v / (1.0 + np.exp(-v)),
    "gelu": lambda v: 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3))),
}


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_reference_is_the_gated_math_in_numpy(rand, activation):
    """gated_mlp_reference, the oracle of this module's tests, against the same math in
    float64 NumPy: (act(x @ w_gate) * (x @ w_up)) @ w_down."""
    x, wgu, wd = (np.asarray(a, np.float64) for a in operands(rand, 2))
    act = NUMPY_ACTIVATIONS[activation]
    want = (act(x @ wgu[:, 0]) * (x @ wgu[:, 1])) @ wd
    got = jax_ub.gated_mlp_reference(
        *(jnp.asarray(a, jnp.float32) for a in (x, wgu, wd)), activation=activation
    )
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_forward_and_grads_in_shard_map(mesh1d, rand, tp, activation):
    mesh = mesh1d(tp)
    args = operands(rand, tp)
    f = local_fn(mesh, activation=activation)
    want = jax_ub.gated_mlp_reference(*args, activation=activation)
    assert rel_err(f(*args), want) < 1e-5
    check_grads(f, args, activation)


def test_callable_activation_and_xla_impl(mesh1d, rand):
    mesh = mesh1d(2)
    args = operands(rand, 2)
    act = lambda v: jnp.tanh(v) * 2.0  # noqa: E731
    ub, xla = local_fn(mesh, activation=act), local_fn(mesh, "xla", activation=act)
    assert rel_err(ub(*args), xla(*args)) < 1e-5
    assert rel_err(ub(*args), jax_ub.gated_mlp_reference(*args, activation=act)) < 1e-5


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (2, 1)], ids=["dp2_tp2", "dp1_tp4", "dp2_tp1"])
def test_global_arrays_on_dp_tp_mesh(rand, shape):
    """Plain jit under set_mesh: x [seq, batch, k] split (tp, dp), the kernels as the
    docstring says; no collective in the forward but jax_ub's."""
    dp, tp = shape
    mesh = make_mesh((dp, "dp"), (tp, "tp"))
    x, wgu, wd = operands(rand, tp, batch=(2 * dp,))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(x, P("tp", "dp")), put(wgu, P(None, None, "tp")), put(wd, P("tp", None)))
    f = lambda *a: jax_ub.gated_mlp(*a, "tp", impl="ub")  # noqa: E731
    with jax.set_mesh(mesh):
        y = jax.jit(f)(*args)
        hlo = jax.jit(f).lower(*args).compile().as_text()
        check_grads(f, args)
    assert rel_err(y, jax_ub.gated_mlp_reference(x, wgu, wd)) < 1e-5
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo
    assert hlo.count('custom_call_target="jax_ub_all_gather_matmul"') == 1  # x gathered once
    assert not COLLECTIVE.findall(hlo), COLLECTIVE.findall(hlo)


def test_batch_major(mesh1d, rand):
    mesh = mesh1d(2)
    x, wgu, wd = operands(rand, 2, batch=(3,))
    xb = jnp.swapaxes(x, 0, 1)  # [batch, seq, k]

    def body(x, wgu, wd):
        return jax_ub.gated_mlp(x, wgu, wd, "tp", impl="ub", seq_axis=1)

    f = smap(body, mesh, (P(None, "tp"), P(None, None, "tp"), P("tp", None)), P(None, "tp"))
    want = jnp.swapaxes(jax_ub.gated_mlp_reference(x, wgu, wd), 0, 1)
    assert rel_err(f(xb, wgu, wd), want) < 1e-5
    check_grads(f, (xb, wgu, wd))


def test_fp8_matches_xla_impl(mesh1d, rand):
    """fp8 (current scaling): the same quantized math as impl="xla", near float32."""
    mesh = mesh1d(2)
    x, wgu, wd = operands(rand, 2, m=16, k=32, f=16, n=32)
    scales = (jax_ub.Fp8Scales(), jax_ub.Fp8Scales())
    ub = local_fn(mesh, fp8=scales)(x, wgu, wd)
    xla = local_fn(mesh, "xla", fp8=scales)(x, wgu, wd)
    assert rel_err(ub, xla) < 1e-5  # the same quantized operands, float32 sums
    assert rel_err(ub, jax_ub.gated_mlp_reference(x, wgu, wd)) < 1e-1  # e4m3's rounding
    g_ub, g_xla = (
        jax.grad(loss(local_fn(mesh, impl, fp8=scales)), argnums=(0, 1, 2))(x, wgu, wd)
        for impl in ("ub", "xla")
    )
    for g, r in zip(g_ub, g_xla):
        assert rel_err(g, r) < 1e-5


def test_checkpoint_mapping(mesh1d, rand):
    """Separate gate and up kernels stacked as the docstring says give the unsharded MLP."""
    mesh = mesh1d(4)
    x = rand(16, 2, 16)
    gate, up, down = rand(16, 32, scale=0.4), rand(16, 32, scale=0.4), rand(32, 16, scale=0.4)
    y = local_fn(mesh)(x, jnp.stack([gate, up], axis=1), down)
    want = (jax.nn.silu(np.asarray(x) @ gate) * (np.asarray(x) @ up)) @ down
    assert rel_err(y, want) < 1e-5


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((8, 2, 16), (16, 32), (16, 12)), "w_gate_up must be \\[k, 2, f\\]"),
        (((8, 2, 16), (16, 3, 8), (8, 12)), "w_gate_up must be \\[k, 2, f\\]"),
        (((8, 2, 16), (15, 2, 8), (8, 12)), "k = x.shape\\[-1\\] = 16"),
        (((8, 2, 16), (16, 2, 8), (9, 12)), "w_down must be \\[f, n\\] with f = .* = 8"),
    ],
)
def test_bad_shapes_are_named(shapes, message):
    args = [jnp.ones(s) for s in shapes]
    with pytest.raises(ValueError, match=message):
        jax_ub.gated_mlp(*args, "tp")


def test_bad_activation_and_fp8(rand):
    x, wgu, wd = jnp.ones((8, 16)), jnp.ones((16, 2, 8)), jnp.ones((8, 4))
    with pytest.raises(ValueError, match="activation must be one of .*'relu'"):
        jax_ub.gated_mlp(x, wgu, wd, "tp", activation="relu")
    with pytest.raises(TypeError, match="fp8 must be a pair"):
        jax_ub.gated_mlp(x, wgu, wd, "tp", fp8=jax_ub.Fp8Scales())


def test_global_rows_not_divisible(rand):
    mesh = make_mesh((4, "tp"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="rows of x"):
        jax_ub.gated_mlp(jnp.ones((6, 16)), jnp.ones((16, 2, 8)), jnp.ones((8, 4)), "tp")
