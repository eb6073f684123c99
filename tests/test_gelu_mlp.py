"""gelu_mlp on CPU devices (the host protocol emulating cuBLASLt's epilogues): forward and
gradients against impl="xla" and a numpy reference, GELU's backward in the dgrad GEMM's
epilogue (the HLO), partial-auto meshes, the unfused paths, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err, smap, to_f32, tol
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.settings import options


def gelu_np(v):
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v**3)))


def operands(rand, tp, m=4, k=16, f=8, n=12, batch=(), dtype=jnp.float32):
    """x [tp*m, *batch, k], w_up [k, tp*f], b_up [tp*f], w_down [tp*f, n], b_down [n]."""
    return (
        rand(tp * m, *batch, k, dtype=dtype),
        rand(k, tp * f, dtype=dtype, scale=0.5),
        rand(tp * f, dtype=dtype),
        rand(tp * f, n, dtype=dtype, scale=0.5),
        rand(n, dtype=dtype),
    )


def mlp_fn(mesh, impl="ub", nbatch=0):
    rest = (None,) * nbatch

    def body(x, w1, b1, w2, b2):
        return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2, impl=impl)

    specs = (P("tp", *rest), P(None, "tp"), P("tp"), P("tp", None), P())
    return smap(body, mesh, specs, P("tp", *rest))


def reference(x, w1, b1, w2, b2):
    x, w1, b1, w2, b2 = (to_f32(a) for a in (x, w1, b1, w2, b2))
    return gelu_np(x @ w1 + b1) @ w2 + b2


def loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))


GRAD_NAMES = ("dx", "dw_up", "db_up", "dw_down", "db_down")


def assert_grads_match_xla(mesh, args, tol=1e-5):
    """gelu_mlp's five gradients through jax_ub against impl="xla"'s, none NaN."""
    got = jax.grad(loss(mlp_fn(mesh)), argnums=range(5))(*args)
    want = jax.grad(loss(mlp_fn(mesh, "xla")), argnums=range(5))(*args)
    for name, g, r in zip(GRAD_NAMES, got, want):
        assert rel_err(g, r) < tol, name  # rel_err fails on NaN


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gelu_mlp_forward_and_grads(mesh1d, rand, tp):
    mesh = mesh1d(tp)
    args = operands(rand, tp)
    assert rel_err(mlp_fn(mesh)(*args), reference(*args)) < 1e-5
    assert_grads_match_xla(mesh, args)


def test_gelu_mlp_bf16_with_batch_dims(mesh1d, rand):
    mesh = mesh1d(2)
    args = operands(rand, 2, batch=(3,), dtype=jnp.bfloat16)
    f = mlp_fn(mesh, nbatch=1)
    assert rel_err(f(*args), reference(*args)) < tol(jnp.bfloat16)
    got = jax.grad(loss(f), argnums=range(5))(*args)
    # Against float32 math on the same bf16 values, next to XLA's bf16 path: the epilogues
    # round once where XLA's path rounds after every step, so the two bf16 results differ
    # by more than either's own error.
    xla = mlp_fn(mesh, "xla", nbatch=1)
    bf16 = jax.grad(loss(xla), argnums=range(5))(*args)
    want = jax.grad(loss(xla), argnums=range(5))(*(a.astype(jnp.float32) for a in args))
    for g, b, r in zip(got, bf16, want):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g, r) < max(tol(jnp.bfloat16), 1.25 * rel_err(b, r))


def test_gelu_backward_runs_in_the_dgrad_epilogue(mesh1d, rand):
    """The whole fwd+bwd has no tanh in XLA: GELU and its gradient run in the custom calls,
    one of which is told dgelu."""
    mesh = mesh1d(2)
    args = operands(rand, 2)
    text = jax.jit(jax.grad(loss(mlp_fn(mesh)), argnums=range(5))).lower(*args).as_text()
    calls = [ln for ln in text.splitlines() if "jax_ub_all_gather_matmul" in ln]
    assert sum("dgelu = true" in ln for ln in calls) == 1, calls
    assert "tanh" not in text
    plain = jax.jit(jax.grad(loss(mlp_fn(mesh, "xla")), argnums=range(5))).lower(*args)
    assert "tanh" in plain.as_text()


@pytest.mark.parametrize(
    "tuning", [dict(dgelu_epilogue=False), dict(transpose_w_in_place=False)], ids=str
)
def test_backward_tuning_choices_keep_the_gradients(mesh1d, rand, tuning):
    """The benchmarks' other backward forms (GELU's gradient in XLA; the weights'
    transposes materialised by XLA) give the same gradients, and the HLO shows the form."""
    mesh = mesh1d(2)
    args = operands(rand, 2)
    want = jax.grad(loss(mlp_fn(mesh, "xla")), argnums=range(5))(*args)
    with options.experimental_tuning(**tuning):
        grad = jax.jit(jax.grad(loss(mlp_fn(mesh)), argnums=range(5)))
        text = grad.lower(*args).as_text()
        got = grad(*args)
    for name, g, r in zip(GRAD_NAMES, got, want):
        assert rel_err(g, r) < 1e-5, name
    calls = [ln for ln in text.splitlines() if "jax_ub_" in ln and "custom_call" in ln]
    if "dgelu_epilogue" in tuning:
        assert not any("dgelu = true" in ln for ln in calls) and "tanh" in text, calls
    else:  # every backward call reads its weight as stored: [k, n], not transposed
        assert not any("transpose_w = true" in ln for ln in calls), calls
        assert "stablehlo.transpose" in text


def test_gelu_mlp_without_biases_on_a_partial_auto_mesh(rand):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w1, _, w2, _ = operands(rand, 2, batch=(2,))
    f = jax.jit(
        jax.shard_map(
            lambda x, w1, w2: jax_ub.gelu_mlp(x, w1, w2, "tp"),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
            out_specs=P("tp"),
            axis_names={"tp"},
        )
    )
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp", "dp")))
    zero = np.zeros
    want = reference(x, w1, zero(w1.shape[1]), w2, zero(w2.shape[1]))
    assert rel_err(f(x, w1, w2), want) < 1e-5
    got = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(x, w1, w2)
    assert all(np.all(np.isfinite(to_f32(g))) for g in got)


def test_gelu_mlp_on_global_arrays(mesh1d, rand):
    """Outside shard_map (global arrays under set_mesh): the unsharded block's numbers."""
    mesh = mesh1d(2)
    args = operands(rand, 2)
    with jax.set_mesh(mesh):

        def f(x, w1, b1, w2, b2):
            return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2)

        assert rel_err(jax.jit(f)(*args), reference(*args)) < 1e-5


def test_bad_down_projection(mesh1d, rand):
    x, w1, _, _, _ = operands(rand, 1)
    w2 = rand(w1.shape[1] + 1, 4)
    with pytest.raises(ValueError, match=r"w_down must be \[f, n\] with f = w_up.shape\[1\] = 8"):
        smap(lambda x, a, b: jax_ub.gelu_mlp(x, a, b, "tp"), mesh1d(1), (P(), P(), P()), P())(
            x, w1, w2
        )
