"""fp8 operands given already quantized (float8_e4m3fn with their scales, e.g. weights stored
in fp8): both ops use them as they are and give what quantizing in the call gives, with
the result in the other operand's dtype; gradients, and the inputs refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, op_call, op_operands, op_specs
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P
from test_fp8 import E4M3, E5M2, amax, deq, fp8_fn

import jax_ub
from jax_ub import fp8


def given_scales(x, w):
    """Scales as a history would give them (not the tensors' own), and the Fp8Scales."""
    sx, sw = np.float32(1.2 * amax(x) / 448), np.float32(1.1 * amax(w) / 448)
    return sx, sw, jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw))


@pytest.mark.parametrize(
    "quantized,dtype,out_dtype",
    [
        ("x", jnp.bfloat16, jnp.bfloat16),
        ("x", jnp.float32, jnp.float32),  # the result takes w's dtype
        ("w", jnp.bfloat16, jnp.bfloat16),
        ("both", jnp.float32, jnp.bfloat16),  # nothing in high precision: bfloat16
    ],
)
@pytest.mark.parametrize("impl", ["ub", "xla"])
@pytest.mark.parametrize("op", OPS)
def test_quantized_operands_are_used_as_given(mesh1d, rand, op, impl, quantized, dtype, out_dtype):
    tp = 2
    x, w = op_operands(rand, op, tp, 8, 32, 16, dtype=dtype)
    sx, sw, scales = given_scales(x, w)
    xq = fp8.quantize(x, sx) if quantized in ("x", "both") else x
    wq = fp8.quantize(w, sw) if quantized in ("w", "both") else w
    f = fp8_fn(op, mesh1d(tp), impl)
    out = f(xq, wq, scales)
    assert out.dtype == jnp.dtype(out_dtype) and out.shape == (x.shape[0], w.shape[1])
    assert rel_err(out, deq(x, sx) @ deq(w, sw)) < (1e-5 if out_dtype == jnp.float32 else 1e-2)
    # The same fp8 values as the op's own quantization with these scales: the same result
    # where the result's dtype is the same (else the partial sums round differently).
    in_call = f(x, w, scales)
    if in_call.dtype == out.dtype:
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(in_call, np.float32))
    else:
        assert rel_err(out, in_call) < 1e-2


@pytest.mark.parametrize("op", OPS)
def test_gradients_with_a_quantized_weight(mesh1d, rand, op):
    """A frozen fp8 weight (e.g. fine-tuning beside it): dx is exact fp8 math; the weight's
    own gradient comes back cast to fp8, its scale gets none, x's scale gets x's amax."""
    tp = 2
    x, w = op_operands(rand, op, tp, 8, 32, 16, dtype=jnp.bfloat16)
    ct = rand(x.shape[0], w.shape[1], dtype=jnp.bfloat16)
    sx, sw, _ = given_scales(x, w)
    sg = np.float32(amax(ct) / 50000)
    scales = jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw), grad=jnp.float32(sg))
    wq = fp8.quantize(w, sw)
    _, vjp = jax.vjp(fp8_fn(op, mesh1d(tp)), x, wq, scales)
    dx, dwq, dscales = vjp(ct)
    dct = deq(ct, sg, E5M2)
    assert dx.dtype == jnp.bfloat16 and dwq.dtype == jnp.dtype(E4M3)
    assert rel_err(dx, dct @ deq(w, sw).T) < 1e-2
    assert rel_err(dwq, deq(x, sx).T @ dct) < 0.1  # e4m3 keeps 3 mantissa bits
    np.testing.assert_allclose(float(dscales.x), amax(x), rtol=1e-6)
    assert float(dscales.w) == 0.0
    np.testing.assert_allclose(float(dscales.grad), amax(ct), rtol=1e-6)


@pytest.mark.parametrize(
    "which,scales,match",
    [
        ("x", None, r"x is already fp8: pass its scale as fp8=jax_ub.Fp8Scales\(x=.*x: \("),
        ("w", jax_ub.Fp8Scales(), r"w is already fp8, so fp8.w must be its scale.*w: \("),
        ("w5", jax_ub.Fp8Scales(w=jnp.float32(1)), "fp8 operands must be float8_e4m3fn"),
    ],
)
@pytest.mark.parametrize("op", OPS)
def test_bad_quantized_operands_are_refused(mesh1d, rand, op, which, scales, match):
    x, w = op_operands(rand, op, 2, 8, 32, 16, dtype=jnp.bfloat16)
    if which == "x":
        x = x.astype(E4M3)
    else:
        w = w.astype(E5M2 if which == "w5" else E4M3)
    kw = {} if scales is None else {"fp8": scales}
    in_specs, out_specs = op_specs(op)
    f = smap(lambda x, w: op_call(op)(x, w, "tp", **kw), mesh1d(2), in_specs, out_specs)
    with pytest.raises(ValueError, match=match):
        f(x, w)


def test_quantized_weight_on_global_arrays(mesh1d, rand):
    """Serving with an fp8 weight: plain jit under jax.set_mesh, bf16 activations."""
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=jnp.bfloat16)
    _, sw, _ = given_scales(x, w)
    wq = fp8.quantize(w, sw)
    with jax.set_mesh(mesh1d(2)):
        y = jax.jit(
            lambda x, wq: jax_ub.all_gather_matmul(
                x, wq, "tp", fp8=jax_ub.Fp8Scales(w=jnp.float32(sw))
            )
        )(x, wq)
    assert y.dtype == jnp.bfloat16 and y.sharding.spec == P(None, "tp")
    assert rel_err(y, np.asarray(x, np.float32) @ deq(w, sw)) < 3e-2


def _quantizations(hlo: str) -> list[str]:
    """The HLO's conversions into float8_e4m3fn: what :func:`fp8.quantize` traces."""
    return [ln for ln in hlo.splitlines() if "convert" in ln and "xf8E4M3FN>" in ln.split("->")[-1]]


@pytest.mark.parametrize("op", OPS)
def test_quantized_operands_reach_the_custom_call_as_they_are(mesh1d, rand, op):
    """No quantization is traced for operands given in fp8: the custom call takes them."""
    x, w = op_operands(rand, op, 2, 8, 32, 16, dtype=jnp.bfloat16)
    sx, sw, scales = given_scales(x, w)
    xq, wq = fp8.quantize(x, sx), fp8.quantize(w, sw)
    hlo = fp8_fn(op, mesh1d(2)).lower(xq, wq, scales).as_text()
    name = {"ag": "jax_ub_all_gather_matmul", "rs": "jax_ub_matmul_reduce_scatter"}[op]
    calls = [ln for ln in hlo.splitlines() if name in ln]
    assert calls and all("f8E4M3FN" in ln for ln in calls), calls
    assert not _quantizations(hlo)
    # From bf16 operands the same call quantizes both: the check above can fail.
    assert len(_quantizations(fp8_fn(op, mesh1d(2)).lower(x, w, scales).as_text())) == 2
