"""gelu_mlp in fp8 on CPU devices (the host protocol emulating cuBLASLt's fp8 GEMMs and
epilogues): the block equals the two fp8 ops written one after the other, forward,
gradients and the amaxes of delayed scaling, with GELU's backward in the fp8 dgrad GEMM's
epilogue (the HLO); against a float32 reference from dequantized operands; bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P
from test_fp8 import E5M2, amax, deq
from test_gelu_mlp import gelu_np, operands

import jax_ub

SPECS = (P("tp"), P(None, "tp"), P("tp"), P("tp", None), P(), P(), P())


def delayed_scales(x, w1, w2, ct):
    """Given scales (as amax histories give them), none of them the tensor's own amax."""
    up = jax_ub.Fp8Scales(
        x=jnp.float32(1.1 * amax(x) / 448),
        w=jnp.float32(0.9 * amax(w1) / 448),
        grad=jnp.float32(2e-5),
    )
    down = jax_ub.Fp8Scales(
        x=jnp.float32(4.0 / 448),
        w=jnp.float32(1.2 * amax(w2) / 448),
        grad=jnp.float32(1.3 * amax(ct) / 57344),
    )
    return up, down


def fused(mesh, impl="ub"):
    def body(x, w1, b1, w2, b2, up, down):
        return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2, impl=impl, fp8=(up, down))

    return smap(body, mesh, SPECS, P("tp"))


def two_ops(mesh):
    def body(x, w1, b1, w2, b2, up, down):
        h = jax_ub.all_gather_matmul(x, w1, "tp", bias=b1, activation="gelu", impl="ub", fp8=up)
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", bias=b2, impl="ub", fp8=down)

    return smap(body, mesh, SPECS, P("tp"))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_gelu_mlp_is_the_two_fp8_ops(mesh1d, rand, tp, dtype, tol):
    """Forward bit for bit; gradients and amaxes alike (bf16: GELU's gradient is rounded
    once in the epilogue, after the two ops' dgrad output was rounded first)."""
    mesh = mesh1d(tp)
    x, w1, b1, w2, b2 = operands(rand, tp, k=32, f=16, n=16, dtype=dtype)
    ct = rand(x.shape[0], w2.shape[1], dtype=dtype)
    up, down = delayed_scales(x, w1, w2, ct)
    got, got_vjp = jax.vjp(fused(mesh), x, w1, b1, w2, b2, up, down)
    want, want_vjp = jax.vjp(two_ops(mesh), x, w1, b1, w2, b2, up, down)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    g, w = got_vjp(ct), want_vjp(ct)
    for name, a, b in zip(("dx", "dw_up", "db_up", "dw_down", "db_down"), g[:5], w[:5]):
        assert a.dtype == b.dtype and rel_err(a, b) < tol, name
    for a, b in zip(jax.tree.leaves(g[5:]), jax.tree.leaves(w[5:])):
        # The amaxes seen; in bf16 dp's differs by dp's rounding.
        np.testing.assert_allclose(float(a), float(b), rtol=max(tol, 1e-6))
    # And against float32 math on the dequantized operands and hidden activation.
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    h = gelu_np(deq(x, up.x) @ deq(w1, up.w) + f32(b1))
    ref = deq(h, down.x) @ deq(w2, down.w) + f32(b2)
    assert rel_err(got, ref) < max(tol, 1e-4)


def test_fp8_dgelu_runs_in_the_dgrad_epilogue(mesh1d, rand):
    """bf16 fwd+bwd: one fp8 all-gather custom call told dgelu, no GELU in XLA."""
    mesh = mesh1d(2)
    x, w1, b1, w2, b2 = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.bfloat16)
    up, down = jax_ub.Fp8Scales(), jax_ub.Fp8Scales()

    def loss(*a):
        return jnp.sum(jnp.sin(fused(mesh)(*a, up, down).astype(jnp.float32)))

    text = jax.jit(jax.grad(loss, argnums=range(5))).lower(x, w1, b1, w2, b2).as_text()
    calls = [ln for ln in text.splitlines() if "jax_ub_all_gather_matmul" in ln]
    assert sum("dgelu = true" in ln for ln in calls) == 1, calls
    assert all("f8E" in ln for ln in calls), calls
    assert "tanh" not in text


def test_fp8_gelu_mlp_with_current_scaling_matches_xla(mesh1d, rand):
    """Current scaling, impl="ub" against impl="xla" (the two ops on XLA's collectives):
    both quantize alike, so results and gradients differ by bf16 rounding, which e4m3 and
    e5m2 turn into a quantization step here and there."""
    mesh = mesh1d(2)
    args = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.bfloat16)
    ct = rand(args[0].shape[0], args[3].shape[1], dtype=jnp.bfloat16)
    scales = (jax_ub.Fp8Scales(), jax_ub.Fp8Scales())
    got, got_vjp = jax.vjp(lambda *a: fused(mesh)(*a, *scales), *args)
    want, want_vjp = jax.vjp(lambda *a: fused(mesh, "xla")(*a, *scales), *args)
    assert rel_err(got, want) < 5e-2
    for a, b in zip(got_vjp(ct), want_vjp(ct)):
        assert rel_err(a, b) < 5e-2


@pytest.mark.parametrize(
    "fp8,error,match",
    [
        (jax_ub.Fp8Scales(), TypeError, r"fp8 must be a pair \(up, down\) of jax_ub.Fp8Scales"),
        ((jax_ub.Fp8Scales(), 1.0), TypeError, "fp8 must be a jax_ub.Fp8Scales, got float"),
    ],
)
def test_bad_fp8_arguments(mesh1d, rand, fp8, error, match):
    x, w1, _, w2, _ = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.bfloat16)
    f = smap(
        lambda x, a, b: jax_ub.gelu_mlp(x, a, b, "tp", fp8=fp8),
        mesh1d(2),
        (P("tp"), P(None, "tp"), P("tp", None)),
        P("tp"),
    )
    with pytest.raises(error, match=match):
        f(x, w1, w2)


def test_grad_scale_amax_is_e5m2_ready(mesh1d, rand):
    """The down-projection's gradient scale from its amax quantizes dy without saturating."""
    x, w1, b1, w2, b2 = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.float32)
    ct = rand(x.shape[0], w2.shape[1])
    up, down = delayed_scales(x, w1, w2, ct)
    _, vjp = jax.vjp(fused(mesh1d(2)), x, w1, b1, w2, b2, up, down)
    seen_down = vjp(ct)[6]
    np.testing.assert_allclose(float(seen_down.grad), amax(ct), rtol=1e-6)
    assert np.all(np.isfinite(deq(ct, float(seen_down.grad) / 57344, E5M2)))


def test_fp8_gelu_mlp_on_global_arrays(mesh1d, rand):
    """Outside shard_map (global arrays under set_mesh): the fp8 block's numbers."""
    mesh = mesh1d(2)
    args = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.bfloat16)
    scales = (jax_ub.Fp8Scales(), jax_ub.Fp8Scales())
    with jax.set_mesh(mesh):

        def f(x, w1, b1, w2, b2):
            return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2, fp8=scales)

        y = jax.jit(f)(*args)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, fused(mesh, "xla")(*args, *scales)) < 5e-2


def test_quantized_weight_without_its_scale_is_named(mesh1d, rand):
    """An fp8 w_down whose scale is missing: the error names w_down and fp8[1]."""
    x, w1, _, w2, _ = operands(rand, 2, k=32, f=16, n=16, dtype=jnp.bfloat16)
    f = smap(
        lambda x, a, b: jax_ub.gelu_mlp(
            x, a, b, "tp", fp8=(jax_ub.Fp8Scales(), jax_ub.Fp8Scales())
        ),
        mesh1d(2),
        (P("tp"), P(None, "tp"), P("tp", None)),
        P("tp"),
    )
    with pytest.raises(ValueError, match=r"w_down is already fp8, so fp8\[1\].w must be its scale"):
        f(x, w1, w2.astype(jnp.float8_e4m3fn))
