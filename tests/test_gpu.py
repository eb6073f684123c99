"""GPU tier: jax_ub on CUDA GPUs against the XLA reference, at tp 2 and every GPU of the
process, or at tp=N in the N-ranks mode (``pytest --ranks N``: N processes on one GPU).

Skipped without at least 2 GPUs. Shapes are global; per GPU the row shard is M / tp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RANKS, gpu_mesh, gpu_rel_err, group_sizes, need_gpus, use_tuning
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.lowering.primitives import bind_matmul_reduce_scatter

pytestmark = pytest.mark.gpu

GPUS = need_gpus(2)

TPS = group_sizes(GPUS)
# (dp, tp) meshes of every GPU with dp >= 2 and tp >= 2
DP_TP = sorted({(len(GPUS) // t, t) for t in (2, len(GPUS) // 2) if t >= 2 and len(GPUS) // t >= 2})
CPU = jax.local_devices(backend="cpu")[0]


def _mesh(tp: int, dp: int = 1) -> Mesh:
    return gpu_mesh(GPUS, (dp, tp), ("dp", "tp"))


def _data(key, shapes, dtype):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _ag(mesh, impl):
    return jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )


def _rs(mesh, impl):
    return jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", impl=impl),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )


def _rs_gathering(mesh, tp):
    """matmul_reduce_scatter(h, v) that all-gathers g beside it: (out, each rank's gathered g)."""

    def body(h, v, g):
        out, gathered = bind_matmul_reduce_scatter(h, v, "tp", tp, gather=g)
        return out, gathered[None]

    specs = (P(None, "tp"), P("tp", None), P("tp", None))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"), P("tp"))))


def _assert_copies_exact(gathered, g, call):
    """Every rank's gathered copy equals g bit for bit."""
    want = np.asarray(g).view(np.uint16 if g.dtype == jnp.bfloat16 else np.uint32)
    for copy in np.asarray(gathered):
        assert (copy.view(want.dtype) == want).all(), call


SHAPES = [  # (M, K, N) global
    (1024, 1024, 1024),
    (256, 512, 768),
    (16384, 8192, 28672),
    (3 * 256, 640, 3 * 128),
]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_forward_matches_xla(tp, shape, dtype):
    M, K, N = shape
    if dtype == jnp.float32 and M * K > 1024 * 1024 * 16:
        pytest.skip("large f32 case adds little over bf16")
    mesh = _mesh(tp)
    x, w = _data(jax.random.key(M + tp), [(M, K), (K, N)], dtype)
    h, v = _data(jax.random.key(K + tp), [(M, N), (N, K)], dtype)
    # XLA's f32 dot defaults to TF32 on GPU; jax_ub's f32 is true f32 unless allow_tf32.
    with jax.default_matmul_precision("highest"):
        ag_ref, rs_ref = _ag(mesh, "xla")(x, w), _rs(mesh, "xla")(h, v)
    assert gpu_rel_err(_ag(mesh, "ub")(x, w), ag_ref) < TOL[dtype]
    assert gpu_rel_err(_rs(mesh, "ub")(h, v), rs_ref) < TOL[dtype]


@pytest.mark.parametrize("keep_gathered", [True, False])
@pytest.mark.parametrize("tp", TPS)
def test_grads_match_xla(tp, keep_gathered):
    """Through both ops; with keep_gathered off, x's gathered again inside the backward's
    reduce-scatter for the weight gradient."""
    jax_ub.configure(keep_gathered=keep_gathered)  # conftest's _restore_config undoes it
    mesh = _mesh(tp)
    x, w1, w2 = _data(jax.random.key(7), [(512, 256), (256, 384), (384, 256)], jnp.float32)
    # Weights scaled by 1/sqrt(fan-in) keep y = O(1), so sin(y) is well conditioned in bf16.
    w1, w2 = (w1 / 16).astype(jnp.bfloat16), (w2 / np.sqrt(384)).astype(jnp.bfloat16)
    x = x.astype(jnp.bfloat16)

    def loss(impl):
        def body(x, w1, w2):
            h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
            y = jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", impl=impl)
            return lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), "tp")

        f = jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P()
        )
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    for g_ub, g_ref in zip(loss("ub")(x, w1, w2), loss("xla")(x, w1, w2)):
        assert gpu_rel_err(g_ub, g_ref) < 3e-2


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_matmul_all_reduce_values_and_grads(tp, rows):
    """GEMM + all-reduce (activations replicated over tp): decode's one row padded to tp,
    an odd count, a prefill; against XLA's dot + psum, values and gradients."""
    mesh = _mesh(tp)
    x, w = _data(jax.random.key(rows), [(rows, 2, 1024), (1024, 768)], jnp.float32)
    x, w = x.astype(jnp.bfloat16), (w / 32).astype(jnp.bfloat16)

    def f(impl):
        g = jax.shard_map(
            lambda x, w: jax_ub.matmul_all_reduce(x, w, "tp", impl=impl),
            mesh=mesh,
            in_specs=(P(None, None, "tp"), P("tp", None)),
            out_specs=P(),
        )
        return jax.jit(g)

    assert gpu_rel_err(f("ub")(x, w), f("xla")(x, w)) < 1e-2

    def grads(impl):
        loss = lambda x, w: jnp.sum(jnp.sin(f(impl)(x, w).astype(jnp.float32)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    for g_ub, g_ref in zip(grads("ub"), grads("xla")):
        assert gpu_rel_err(g_ub, g_ref) < 2e-2


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_float32_grads_follow_allow_tf32(allow_tf32):
    """Float32: every GEMM of the forward and the gradients (the weight gradients are XLA's
    dot) at full float32 precision unless allow_tf32, against precision="highest" math."""
    jax_ub.configure(allow_tf32=allow_tf32)
    mesh = _mesh(TPS[-1])
    x, w1, w2 = _data(jax.random.key(8), [(528, 512), (512, 768), (768, 512)], jnp.float32)
    w1, w2 = w1 / np.sqrt(512), w2 / np.sqrt(768)

    def mlp(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl="ub"))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl="ub")

    def reference(x, w1, w2):
        h = jnp.tanh(jnp.matmul(x, w1, precision="highest"))
        return jnp.matmul(h, w2, precision="highest")

    f = jax.shard_map(
        mlp, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P("tp")
    )
    loss = lambda g: lambda *a: jnp.sum(jnp.sin(g(*a)))  # noqa: E731
    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w1, w2)
    with jax.default_device(CPU):
        cpu = [np.asarray(a) for a in (x, w1, w2)]
        grads_ref = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(*cpu)
    errors = [gpu_rel_err(g, r) for g, r in zip(grads, grads_ref)]
    if allow_tf32:
        assert all(e < 5e-3 for e in errors), errors  # TF32: ~1e-4..1e-3
    else:
        assert all(e < 2e-5 for e in errors), errors


@pytest.mark.parametrize("order", ["row", "auto"])
def test_each_gemm_order_matches_xla(order):
    """The tests above run the default description ("column"). Forcing "row", and "auto"
    (which may pick either per shape), checks the others, forward (w as stored) and
    backward (w read transposed in place), at an odd shape and in f32 (true f32, no
    TF32)."""
    jax_ub.finalize()  # communicators take the GEMM settings when they are created
    use_tuning(gemm_order=order)
    try:
        mesh = _mesh(TPS[-1])
        for dtype in (jnp.bfloat16, jnp.float32):
            x, w = _data(jax.random.key(3), [(3 * 256, 640), (640, 3 * 128)], dtype)
            with jax.default_matmul_precision("highest"):
                ref = _ag(mesh, "xla")(x, w)
                ref_rs = _rs(mesh, "xla")(ref, w.T)
            assert gpu_rel_err(_ag(mesh, "ub")(x, w), ref) < TOL[dtype], (order, dtype)
            assert gpu_rel_err(_rs(mesh, "ub")(ref, w.T), ref_rs) < TOL[dtype], (order, dtype)

        def loss(impl):
            def body(x, w):
                y = jax_ub.all_gather_matmul(x, w, "tp", impl=impl)
                return lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), "tp")

            f = jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P()
            )
            return jax.jit(jax.grad(f, argnums=(0, 1)))

        x, w = _data(jax.random.key(5), [(3 * 256, 640), (640, 3 * 128)], jnp.float32)
        x, w = x.astype(jnp.bfloat16), (w / np.sqrt(640)).astype(jnp.bfloat16)
        for g_ub, g_ref in zip(loss("ub")(x, w), loss("xla")(x, w)):
            assert gpu_rel_err(g_ub, g_ref) < 3e-2, order
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("dp,tp", DP_TP or [pytest.param(1, 1, marks=pytest.mark.skip("4 GPUs"))])
def test_dp_by_tp_mesh(dp, tp):
    mesh = _mesh(tp, dp)
    x, w = _data(jax.random.key(3), [(512, 256), (256, 384)], jnp.bfloat16)

    def f(impl):
        return jax.jit(
            jax.shard_map(
                lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl),
                mesh=mesh,
                in_specs=(P(("dp", "tp"), None), P(None, "tp")),
                out_specs=P("dp", "tp"),
            )
        )

    assert gpu_rel_err(f("ub")(x, w), f("xla")(x, w)) < 2e-2


@pytest.mark.parametrize("tp", TPS)
def test_hundred_calls_with_changing_data(tp):
    """100 back-to-back calls in one compiled loop, new data each: catches stale flags."""
    mesh = _mesh(tp)
    x0, w, v = _data(jax.random.key(11), [(1024, 512), (512, 768), (768, 512)], jnp.float32)
    x0, w, v = (a.astype(jnp.bfloat16) for a in (x0, w / np.sqrt(512), v / np.sqrt(768)))

    def body(x, w, v):
        def step(i, carry):
            x, worst = carry
            xi = x + jnp.asarray(i, x.dtype) * 0.01
            a = jax_ub.all_gather_matmul(xi, w, "tp", impl="ub")
            b = jax_ub.all_gather_matmul(xi, w, "tp", impl="xla")
            ea = jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(
                b.astype(jnp.float32)
            )
            c = jax_ub.matmul_reduce_scatter(a, v, "tp", impl="ub")
            d = jax_ub.matmul_reduce_scatter(a, v, "tp", impl="xla")
            ec = jnp.linalg.norm((c - d).astype(jnp.float32)) / jnp.linalg.norm(
                d.astype(jnp.float32)
            )
            # New data every call (xi depends on i); nothing fed back, so values stay O(1).
            return x, jnp.maximum(worst, jnp.maximum(ea, ec))

        worst0 = jnp.zeros((), jnp.float32) * x[0, 0].astype(jnp.float32)  # varying over tp
        _, worst = lax.fori_loop(0, 100, step, (x, worst0))
        return lax.pmax(worst, "tp")

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P()
        )
    )
    worst = float(f(x0, w, v))
    assert np.isfinite(worst) and worst < 2e-2, worst


def test_hlo_has_only_custom_calls():
    mesh = _mesh(TPS[-1])
    x, w = _data(jax.random.key(5), [(512, 256), (256, 384)], jnp.bfloat16)
    hlo = _ag(mesh, "ub").lower(x, w).compile().as_text()
    assert "jax_ub_all_gather_matmul" in hlo
    for coll in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        assert coll not in hlo, coll


@pytest.mark.parametrize("tp", TPS)
def test_return_gathered(tp):
    mesh = _mesh(tp)
    x, w = _data(jax.random.key(13), [(1024, 512), (512, 256)], jnp.bfloat16)
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub", return_gathered=True),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=(P(None, "tp"), P()),
            check_vma=False,
        )
    )
    out, gathered = f(x, w)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(x))
    assert gpu_rel_err(out, _ag(mesh, "xla")(x, w)) < 2e-2


def test_host_times_count_each_call():
    """The benchmark's host-time counters: each GPU counts every call of both ops, with a
    positive host time, of which the wait for the process's other GPUs is a part."""
    from jax_ub.bench.timing import host_times

    mesh = _mesh(TPS[-1])
    x, w = _data(jax.random.key(11), [(256, 128), (128, 256)], jnp.bfloat16)
    ag, rs = _ag(mesh, "ub"), _rs(mesh, "ub")
    jax.block_until_ready((ag(x, w), rs(x @ w, w.T)))  # compile; communicators exist now
    before = host_times()
    for _ in range(5):
        out = (ag(x, w), rs(x @ w, w.T))
    jax.block_until_ready(out)
    after = host_times()
    ordinals = sorted(d.local_hardware_id for d in mesh.local_devices)
    for d in ordinals:
        calls, total_s, await_s = (a - b for a, b in zip(after[d], before.get(d, (0, 0.0, 0.0))))
        assert calls == 10, (d, calls)
        assert 0 < total_s < 10 and 0 <= await_s <= total_s, (d, total_s, await_s)


def test_group_gpus_agree_on_each_kernel():
    """Both GPUs of a group of two run group rank 0's kernel for each GEMM shape, tuned and
    then compared in the op's first calls: kernels chosen on each GPU alone differ by timing
    noise, and one GPU's slower kernel makes its peer wait at every flag. (Larger groups
    choose per GPU: their all-gathers' GEMM shapes differ by rank.)"""
    from jax_ub.bench.timing import kernel_choices

    tp = 2
    jax_ub.finalize()  # new communicators: their shapes are tuned and compared anew
    use_tuning(autotune_gemm=True, gemm_trials=3)
    mesh = _mesh(tp)
    x, w = _data(jax.random.key(12), [(2048, 1024), (1024, 1536)], jnp.bfloat16)
    ag, rs = _ag(mesh, "ub"), _rs(mesh, "ub")
    y = x @ w
    out = jax.block_until_ready((ag(x, w), rs(y, w.T)))
    early = kernel_choices()
    assert any(d for per_gpu in early.values() for *_, d in per_gpu), early  # trials are comparing
    for _ in range(40):  # past every shape's trial rounds
        out = (ag(x, w), rs(y, w.T))
    jax.block_until_ready(out)
    choices = kernel_choices()
    assert choices, "no GEMM plan was made"
    for shape, per_gpu in sorted(choices.items()):
        assert len(per_gpu) == len(mesh.local_devices), (shape, per_gpu)
        assert not any(deciding for *_, deciding in per_gpu), (shape, per_gpu)
        kernels = [(row, index) for _, row, index, _ in per_gpu]
        if RANKS:  # each rank sees its own GPU's choice: compare them across the ranks
            kernels = multihost_utils.process_allgather(np.array(kernels)).reshape(-1, 2)
            kernels = [tuple(k) for k in kernels]
        assert len(set(kernels)) == 1, (shape, kernels)
    assert gpu_rel_err(out[0], _ag(mesh, "xla")(x, w)) < 2e-2
    assert gpu_rel_err(out[1], _rs(mesh, "xla")(y, w.T)) < 2e-2
