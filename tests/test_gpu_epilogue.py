"""GPU tier of the epilogues: all_gather_matmul's bias and GELU in cuBLASLt's epilogues (GELU's
input kept through GELU_AUX for the backward) over a group of this process's GPUs (at most
2; one GPU: a group of one; ``pytest --ranks N``: the N ranks), forward against a float32
reference and gradients against impl="xla" at full precision; bf16, f32 and fp8. Groups of
2 processes sharing one GPU: test_gpu_multiprocess.py::test_protocol_on_one_shared_gpu (its
"epilogue" cases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RANKS, gpu_mesh, gpu_rel_err, need_gpus
from jax.sharding import PartitionSpec as P

import jax_ub

pytestmark = pytest.mark.gpu

GPUS = need_gpus(1)

N = RANKS or min(len(GPUS), 2)  # the group: in the N-ranks mode every rank
M, K, NC = 512, 256, 384  # per-rank rows, contraction, columns
EPILOGUES = [(True, None), (False, "gelu"), (True, "gelu")]  # (bias, activation)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


def _operands(dtype, seed=0, m=M, k=K, nc=NC):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (N * m, k), jnp.float32)
    w = jax.random.normal(keys[1], (k, N * nc), jnp.float32) / np.sqrt(k)
    b = jax.random.normal(keys[2], (N * nc,), jnp.float32)
    return [a.astype(dtype) for a in (x, w, b)]


def _fn(impl, with_bias, activation, fp8=None):
    mesh = gpu_mesh(GPUS, (N,), ("tp",))

    def body(x, w, b):
        return jax_ub.all_gather_matmul(
            x, w, "tp", bias=b if with_bias else None, activation=activation, impl=impl, fp8=fp8
        )

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P(None, "tp")
        )
    )


def _reference(x, w, b, with_bias, activation):
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    if with_bias:
        y = y + b.astype(jnp.float32)
    return jax.nn.gelu(y, approximate=True) if activation == "gelu" else y


def _loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("with_bias,activation", EPILOGUES)
@pytest.mark.parametrize("m,k,nc", [(M, K, NC), (3, 6, 5), (129, 64, 12)], ids=str)
def test_epilogue_forward_and_grads(dtype, with_bias, activation, m, k, nc):
    """Also at odd sizes: 5 or 12 local columns (rows of 10 or 24 bytes in bf16; GELU's
    kept input with such a leading dimension), 3 or 129 rows a rank."""
    x, w, b = _operands(dtype, m=m, k=k, nc=nc)
    ub = _fn("ub", with_bias, activation)
    y = ub(x, w, b)
    assert y.dtype == dtype
    assert gpu_rel_err(y, _reference(x, w, b, with_bias, activation)) < TOL[dtype]
    # XLA's f32 dots (the reference's, and the weight gradient's in both) default to TF32.
    with jax.default_matmul_precision("highest"):
        want = jax.grad(_loss(_fn("xla", with_bias, activation)), argnums=(0, 1, 2))(x, w, b)
        got = jax.grad(_loss(ub), argnums=(0, 1, 2))(x, w, b)
    names = ("dx", "dw", "dbias") if with_bias else ("dx", "dw")
    for name, g, r in zip(names, got, want):
        assert gpu_rel_err(g, r) < 2 * TOL[dtype], name


def test_epilogue_is_deterministic():
    """Once the GEMM kernel trials end, repeated calls give the same bits."""
    x, w, b = _operands(jnp.bfloat16, seed=3)
    f = _fn("ub", True, "gelu")
    for _ in range(20):  # past the trials (a shape's first 15 calls)
        f(x, w, b).block_until_ready()
    first = np.asarray(f(x, w, b).astype(jnp.float32))
    for _ in range(3):
        assert np.array_equal(np.asarray(f(x, w, b).astype(jnp.float32)), first)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_epilogue(out_dtype):
    """fp8 operands with bias and GELU (in cuBLASLt's fp8 epilogue for bf16 outputs, in XLA
    for float32 ones), against impl="xla"'s same quantized math, forward and gradients."""
    if min(tuple(map(int, d.compute_capability.split("."))) for d in GPUS) < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9")
    x, w, b = _operands(out_dtype, seed=5)
    scales = jax_ub.Fp8Scales()
    ub, xla = (_fn(impl, True, "gelu", fp8=scales) for impl in ("ub", "xla"))
    y = ub(x, w, b)
    assert y.dtype == out_dtype
    with jax.default_matmul_precision("highest"):
        y_xla = xla(x, w, b)
        want = jax.grad(_loss(xla), argnums=(0, 1, 2))(x, w, b)
        got = jax.grad(_loss(ub), argnums=(0, 1, 2))(x, w, b)
    assert gpu_rel_err(y, y_xla) < 1e-2
    for name, g, r in zip(("dx", "dw", "dbias"), got, want):
        assert gpu_rel_err(g, r) < 5e-2, name  # through e5m2: see test_epilogue.py's fp8 test


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,nc", [(M, K, NC), (3, 6, 5)], ids=str)
def test_gelu_mlp_dgelu_epilogue(dtype, m, k, nc):
    """gelu_mlp's backward runs GELU's gradient in cuBLASLt's DGELU epilogue: forward and
    every gradient against the two ops through XLA at full precision; also with odd sizes
    (5 hidden columns a rank, 6 model columns, 3 rows a rank)."""
    mesh = gpu_mesh(GPUS, (N,), ("tp",))
    keys = jax.random.split(jax.random.key(7), 5)
    shapes = ((N * m, k), (k, N * nc), (N * nc,), (N * nc, k), (k,))
    scale = (1.0, 1 / np.sqrt(k), 1.0, 1 / np.sqrt(N * nc), 1.0)
    args = [
        (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        for k, shape, s in zip(keys, shapes, scale)
    ]

    def fn(impl):
        def body(x, w1, b1, w2, b2):
            return jax_ub.gelu_mlp(x, w1, w2, "tp", up_bias=b1, down_bias=b2, impl=impl)

        specs = (P("tp"), P(None, "tp"), P("tp"), P("tp", None), P())
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp")))

    wide = [a.astype(jnp.float32) for a in args]
    with jax.default_matmul_precision("highest"):
        want_y = fn("xla")(*wide)
        want = jax.grad(_loss(fn("xla")), argnums=range(5))(*wide)
        got = jax.grad(_loss(fn("ub")), argnums=range(5))(*args)
    assert gpu_rel_err(fn("ub")(*args), want_y) < TOL[dtype]
    for name, g, r in zip(("dx", "dw_up", "db_up", "dw_down", "db_down"), got, want):
        assert gpu_rel_err(g, r) < 2 * TOL[dtype], name
