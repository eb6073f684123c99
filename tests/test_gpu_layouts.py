"""GPU tier of the model layouts: every way of calling the ops on every (dp, tp) mesh.

Meshes (1, n) and (n, 1) over this process's n GPUs (n <= 2; one GPU: (1, 1), a group of
one, which still runs the CUDA custom calls); in the N-ranks mode (``pytest --ranks N``, N
processes on one GPU) n = N, and (2, N/2) too for N >= 4. Each case runs in its own process
(``conftest.in_own_process``), so that a crash in one cannot hide the others. Cases: both
ops in a partial-auto shard_map, in a shard_map with every axis manual, from plain jit on
global arrays under ``jax.set_mesh``, on batch-major activations, with the epilogue and
``return_gathered``, in fp8, as Flax nnx and linen layers; forward and gradients against
``precision="highest"`` float32 math.

Regression: XLA's GPU compiler (jaxlib 0.11.2) replaces empty arrays with constants before
Shardy partitions the module; an empty operand passed into a nested shard_map then leaves
an unused input on the manual computation, and Shardy's canonicalizer segfaults on it. The
ops pass empty operands (no bias, no GELU input) and return empty results (no gathered x),
and their lowering nests a shard_map over the mesh's automatic axes, so the (2, 1) mesh hit
it. The minimal program, on 2 GPUs, before the lowering kept empty arrays out of the nested
shard_map::

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("dp", "tp"))
    f = jax.shard_map(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
                      mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                      out_specs=P(None, None, "tp"), axis_names={"tp"})
    jax.jit(f)(x, w)  # x [512, 4, 256] P("tp", "dp"), w [256, 512] P(None, "tp")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RANKS, gpu_mesh, gpu_rel_err, in_own_process, need_gpus
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf

pytestmark = pytest.mark.gpu

GPUS = need_gpus(1)

N = RANKS or min(len(GPUS), 2)
LAYOUTS = sorted({(1, N), (N, 1)} | ({(2, N // 2)} if N >= 4 else set()))
SEQ, BATCH, D, H = 512, 8, 256, 512
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
OPS_IN_HLO = ("jax_ub_all_gather_matmul", "jax_ub_matmul_reduce_scatter")


def _mesh(dp: int, tp: int) -> Mesh:
    return gpu_mesh(GPUS, (dp, tp), ("dp", "tp"))


def _operands(mesh, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (SEQ, BATCH, D), jnp.float32)
    w1 = jax.random.normal(k[1], (D, H), jnp.float32) * D**-0.5
    w2 = jax.random.normal(k[2], (H, D), jnp.float32) * H**-0.5
    put = lambda a, s: jax.device_put(a.astype(dtype), NamedSharding(mesh, s))  # noqa: E731
    return put(x, P("tp", "dp")), put(w1, P(None, "tp")), put(w2, P("tp", None))


CPU = jax.local_devices(backend="cpu")[0]


def _f32(a):
    """A float32 copy on the CPU, where the references run (no GPU compile or autotuning
    for them, and CPU float32 dots are exact float32)."""
    return jax.device_put(np.asarray(jnp.asarray(a, jnp.float32)), CPU)


def _mlp_reference(x, w1, w2, act=jnp.tanh):
    return jnp.matmul(act(jnp.matmul(x, w1, precision="highest")), w2, precision="highest")


def _check_against_reference(f, args, reference, tol, mesh=None):
    """f's output and gradients (of sum(f^2)) against `reference` on float32 copies."""
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    ref_loss = lambda *a: jnp.sum(reference(*a) ** 2)  # noqa: E731
    argnums = tuple(range(len(args)))
    ref_args = [_f32(a) for a in args]
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
        y = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
        hlo = jax.jit(f).lower(*args).compile().as_text()
    with jax.default_device(CPU):
        y_ref = reference(*ref_args)
        grads_ref = jax.grad(ref_loss, argnums=argnums)(*ref_args)
    assert gpu_rel_err(y, y_ref) < tol
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        assert gpu_rel_err(g, r) < 2 * tol, f"gradient of argument {i}"
    return hlo


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mlp(impl="ub", **ag_kw):
    def f(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl=impl, **ag_kw))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl=impl, **ag_kw)

    return f


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_auto_shard_map(request, layout):
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    f = jax.shard_map(
        _mlp(),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
        out_specs=P("tp"),
        axis_names={"tp"},
    )
    for dtype in TOL:
        hlo = _check_against_reference(f, _operands(mesh, dtype), _mlp_reference, TOL[dtype])
        assert all(op in hlo for op in OPS_IN_HLO)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_axis_manual(request, layout):
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    f = jax.shard_map(
        _mlp(),
        mesh=mesh,
        in_specs=(P("tp", "dp"), P(None, "tp"), P("tp", None)),
        out_specs=P("tp", "dp"),
    )
    hlo = _check_against_reference(f, _operands(mesh, jnp.bfloat16), _mlp_reference, 2e-2)
    assert all(op in hlo for op in OPS_IN_HLO)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_jit_under_set_mesh(request, layout):
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    for dtype in TOL:
        args = _operands(mesh, dtype)
        hlo = _check_against_reference(_mlp(), args, _mlp_reference, TOL[dtype], mesh)
        assert all(op in hlo for op in OPS_IN_HLO)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_major_plain_jit(request, layout):
    """Batch-major activations ``[batch, seq, d]`` (``seq_axis=1``): batch over dp,
    sequence over tp."""
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    for dtype in TOL:
        x, w1, w2 = _operands(mesh, dtype)
        x = jax.device_put(jnp.swapaxes(x, 0, 1), NamedSharding(mesh, P("dp", "tp")))
        f = _mlp(seq_axis=1)
        hlo = _check_against_reference(f, (x, w1, w2), _mlp_reference, TOL[dtype], mesh)
        assert all(op in hlo for op in OPS_IN_HLO)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_epilogue_and_gathered_partial_auto(request, layout):
    """Bias and GELU in the epilogue, and ``return_gathered``: the op's other operands and
    results (none of them empty now) through the nested shard_map."""
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    x, w1, w2 = _operands(mesh, jnp.float32)
    b = jax.device_put(
        jax.random.normal(jax.random.key(3), (H,), jnp.float32), NamedSharding(mesh, P("tp"))
    )

    def body(x, w1, w2, b):
        h, gathered = jax_ub.all_gather_matmul(
            x, w1, "tp", bias=b, activation="gelu", impl="ub", return_gathered=True
        )
        y = jax_ub.matmul_reduce_scatter(h, w2, "tp", impl="ub")
        # gathered is all_gather(x): scattered back and summed, it is tp * x.
        x_again = jax.lax.psum_scatter(gathered, "tp", scatter_dimension=0, tiled=True)
        return y + 0.5 * x_again / mesh.shape["tp"]

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp", None), P("tp")),
        out_specs=P("tp"),
        axis_names={"tp"},
    )

    def reference(x, w1, w2, b):
        h = jax.nn.gelu(jnp.matmul(x, w1, precision="highest") + b)
        return jnp.matmul(h, w2, precision="highest") + 0.5 * x

    _check_against_reference(f, (x, w1, w2, b), reference, 1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_plain_jit(request, layout):
    """fp8 (current scaling) on global arrays: its residuals and scales through the
    layouts, against impl="xla"'s same quantized math."""
    if not in_own_process(request):
        return
    if min(tuple(map(int, d.compute_capability.split("."))) for d in GPUS) < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9")
    mesh = _mesh(*layout)
    x, w1, w2 = _operands(mesh, jnp.bfloat16)

    def mlp(impl):
        def f(x, w1, w2):
            kw = dict(impl=impl, fp8=jax_ub.Fp8Scales())
            h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", **kw))
            return jax_ub.matmul_reduce_scatter(h, w2, "tp", **kw)

        return f

    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        outs = {
            impl: jax.jit(jax.value_and_grad(loss(mlp(impl)), argnums=(0, 1, 2)))(x, w1, w2)
            for impl in ("ub", "xla")
        }
    (l_ub, g_ub), (l_xla, g_xla) = outs["ub"], outs["xla"]
    assert gpu_rel_err(l_ub, l_xla) < 2e-2
    # The gradients pass through e5m2 (2 mantissa bits): two implementations that round
    # a few elements differently differ by several percent.
    for g, r in zip(g_ub, g_xla):
        assert gpu_rel_err(g, r) < 1e-1
    # And near the unquantized float32 math.
    with jax.default_device(CPU):
        l_ref = jnp.sum(_mlp_reference(*map(_f32, (x, w1, w2))) ** 2)
    assert gpu_rel_err(l_ub, l_ref) < 1e-1


# Float32: with bfloat16 activations, XLA's CPU compiler (jaxlib 0.10.2) aborts on the
# Flax MLP's parameter gradients under impl="xla" too ("Invalid binary instruction opcode
# copy"), which would keep the CPU check of this file from running.
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flax_nnx_mlp_matches_xla(request, layout):
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    x = _operands(mesh, jnp.float32)[0]
    with jax.set_mesh(mesh):
        models = {
            impl: ubf.ParallelMLP(D, H, impl=impl, rngs=nnx.Rngs(0)) for impl in ("ub", "xla")
        }

        def loss_and_grad(m, x):
            return nnx.value_and_grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(m)

        ys = {impl: nnx.jit(lambda m, x: m(x))(m, x) for impl, m in models.items()}
        grads = {impl: nnx.jit(loss_and_grad)(m, x) for impl, m in models.items()}
    if layout[0] > 1:  # the batch stays split over dp
        assert ys["ub"].sharding.spec[1] == "dp", ys["ub"].sharding
    assert gpu_rel_err(ys["ub"], ys["xla"]) < 5e-3  # XLA's float32 dots may run in TF32
    g_ub, g_xla = (jax.tree.leaves(nnx.to_pure_dict(grads[i][1])) for i in ("ub", "xla"))
    for g, r in zip(g_ub, g_xla):
        assert gpu_rel_err(g, r) < 5e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flax_linen_mlp_matches_xla(request, layout):
    if not in_own_process(request):
        return
    mesh = _mesh(*layout)
    x = _operands(mesh, jnp.float32)[0]
    with jax.set_mesh(mesh):
        mlps = {impl: ubf.linen.ParallelMLP(H, impl=impl) for impl in ("ub", "xla")}
        variables = mlps["xla"].init(jax.random.key(0), x)

        def loss(v, m):
            return jnp.sum(m.apply(v, x).astype(jnp.float32) ** 2)

        out = {
            impl: jax.jit(jax.value_and_grad(loss), static_argnums=1)(variables, m)
            for impl, m in mlps.items()
        }
    assert gpu_rel_err(out["ub"][0], out["xla"][0]) < 5e-3
    grads = [jax.tree.leaves(nn.unbox(out[impl][1])) for impl in ("ub", "xla")]
    for g, r in zip(*grads):
        assert gpu_rel_err(g, r) < 5e-3


def test_group_of_one_under_auto_is_a_plain_matmul(request):
    """tp=1 inside a larger mesh under impl="auto": XLA's dot, no custom call and no
    communicator; the result is impl="xla"'s, and impl="ub"'s up to TF32 (XLA's default
    float32 dot on GPUs)."""
    if not in_own_process(request):
        return
    if N < 2:
        pytest.skip("needs 2 GPUs for a (2, 1) mesh")
    jax_ub.finalize()
    mesh = _mesh(N, 1)
    args = _operands(mesh, jnp.float32)
    with jax.set_mesh(mesh):
        hlo = jax.jit(_mlp("auto")).lower(*args).compile().as_text()
        y_auto = jax.jit(_mlp("auto"))(*args)
        assert not jax_ub.live_communicators()
        y_xla = jax.jit(_mlp("xla"))(*args)
        y_ub = jax.jit(_mlp("ub"))(*args)
    assert not any(op in hlo for op in OPS_IN_HLO)
    assert gpu_rel_err(y_auto, y_xla) < 1e-6
    assert gpu_rel_err(y_auto, y_ub) < 3e-3
