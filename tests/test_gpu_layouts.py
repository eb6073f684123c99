"""GPU tier of the model layouts: partial-auto shard_map and plain jit on (dp, tp) meshes.

Meshes (1, n) and (n, 1) over this process's n GPUs (one GPU: a group of one, which still
runs the CUDA custom calls), both ops and their gradients, against the lax reference
computed at the highest precision. Runs with at least 1 GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpus
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf

pytestmark = pytest.mark.gpu

GPUS = gpus()
if not GPUS:
    pytest.skip("needs a GPU", allow_module_level=True)

N = len(GPUS) if len(GPUS) <= 2 else 2
LAYOUTS = sorted({(1, N), (N, 1)})
SEQ, BATCH, D, H = 512, 4, 256, 512
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def _mesh(dp: int, tp: int) -> Mesh:
    return Mesh(np.array(GPUS[: dp * tp]).reshape(dp, tp), ("dp", "tp"))


def _rel(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(v, jnp.float32)) for v in (a, b))
    assert np.isfinite(a).all(), "non-finite values in jax_ub output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _operands(mesh, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (SEQ, BATCH, D), jnp.float32)
    w1 = jax.random.normal(k[1], (D, H), jnp.float32) * D**-0.5
    w2 = jax.random.normal(k[2], (H, D), jnp.float32) * H**-0.5
    put = lambda a, s: jax.device_put(a.astype(dtype), NamedSharding(mesh, s))  # noqa: E731
    return put(x, P("tp", "dp")), put(w1, P(None, "tp")), put(w2, P("tp", None))


def _reference(x, w1, w2):
    f32 = [jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32))) for a in (x, w1, w2)]

    def f(x, w1, w2):
        h = jnp.tanh(jnp.matmul(x, w1, precision="highest"))
        return jnp.matmul(h, w2, precision="highest")

    y = f(*f32)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(*f32)
    return y, grads


def _body(impl):
    def f(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl=impl))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl=impl)

    return f


def _check(f, mesh, dtype):
    x, w1, w2 = _operands(mesh, dtype)
    y_ref, grads_ref = _reference(x, w1, w2)
    y = jax.jit(f)(x, w1, w2)
    grads = jax.jit(
        jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    )(x, w1, w2)
    tol = TOL[jnp.dtype(dtype).type]
    assert _rel(y, y_ref) < tol
    for g, r in zip(grads, grads_ref):
        assert _rel(g, r) < 2 * tol
    return jax.jit(f).lower(x, w1, w2).compile().as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_auto_shard_map(layout, dtype):
    mesh = _mesh(*layout)
    f = jax.shard_map(
        _body("ub"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
        out_specs=P("tp"),
        axis_names={"tp"},
    )
    hlo = _check(f, mesh, dtype)
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_jit_under_set_mesh(layout, dtype):
    mesh = _mesh(*layout)
    with jax.set_mesh(mesh):
        hlo = _check(_body("ub"), mesh, dtype)
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flax_mlp_from_jit_matches_xla(layout):
    mesh = _mesh(*layout)
    x = _operands(mesh, jnp.bfloat16)[0]
    with jax.set_mesh(mesh):
        models = {
            impl: ubf.ParallelMLP(D, H, impl=impl, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            for impl in ("ub", "xla")
        }
        ys = {impl: nnx.jit(lambda m, x: m(x))(m, x) for impl, m in models.items()}
    if layout[0] > 1:  # the batch stays split over dp
        assert ys["ub"].sharding.spec[1] == "dp", ys["ub"].sharding
    assert _rel(ys["ub"], ys["xla"]) < 2e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_major_plain_jit(layout, dtype):
    """Batch-major activations ``[batch, seq, d]`` (``seq_axis=1``): batch over dp,
    sequence over tp, forward and gradients against the reference."""
    mesh = _mesh(*layout)
    x, w1, w2 = _operands(mesh, dtype)
    x = jax.device_put(jnp.swapaxes(x, 0, 1), NamedSharding(mesh, P("dp", "tp")))

    def f(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl="ub", seq_axis=1))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl="ub", seq_axis=1)

    y_ref, grads_ref = _reference(x, w1, w2)
    with jax.set_mesh(mesh):
        y = jax.jit(f)(x, w1, w2)
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
        hlo = jax.jit(f).lower(x, w1, w2).compile().as_text()
    tol = TOL[jnp.dtype(dtype).type]
    assert y.shape == (BATCH, SEQ, D) and _rel(y, y_ref) < tol
    for g, r in zip(grads, grads_ref):
        assert _rel(g, r) < 2 * tol
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo
