"""Every Flax layer's output and gradients (params and input) against ``jax.grad`` of the
same math written in plain, unsharded JAX from the layer's params: NNX and linen;
``sequence_parallel`` True, False and unset; a sequence tp divides (8) and one it does
not (5, where unset means replicated activations); impl ``"ub"``, ``"xla"`` and
``"auto"``. Batch-major activations (``seq_axis=1``, as most Flax models) on a
(dp=2, tp=2) mesh of CPU devices under ``jax.set_mesh``, float32.

A layer whose replicated path lost a factor of tp in its gradients (the row-parallel
all-reduce inside the attention's unchecked shard_map) fails here. The ops' own matrix is
``test_grad_matrix.py``."""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf
from jax_ub._src.settings.warn_registry import clear_warnings

B, D, F, HEADS, KV_HEADS = 4, 32, 64, 16, 8  # kv heads split over tp = 2, 4 and 8
TOL = 2e-5
# (sequence_parallel, sequence length): a length tp does not divide is replicated, so
# sequence_parallel=True is not among its cases (a ValueError, tested elsewhere).
CASES = [(True, 8), (None, 8), (None, 5), (False, 8), (False, 5)]
IMPLS = ["ub", "xla", "auto"]


def _linear(p, x):
    return x @ p["kernel"] + p["bias"]


def _general_column(p, x):  # [b, t, D] -> [b, t, heads, F / heads]
    return jnp.einsum("btk,khd->bthd", x, p["kernel"]) + p["bias"]


def _general_row(p, x):  # [b, t, heads, F / heads] -> [b, t, D]
    return jnp.einsum("bthd,hde->bte", x, p["kernel"]) + p["bias"]


def _attention(p, x):
    """Causal grouped-query attention from the fused qkv columns (per key/value head: its
    queries, its key, its value), written out: no jax_ub code."""
    head_dim = D // HEADS
    q_per_kv = HEADS // KV_HEADS
    b, t, _ = x.shape
    qkv = _linear(p["qkv"], x).reshape(b, t, KV_HEADS, q_per_kv + 2, head_dim)
    q = qkv[..., :q_per_kv, :]  # [b, t, g, r, d]
    k, v = qkv[..., q_per_kv, :], qkv[..., q_per_kv + 1, :]  # [b, t, g, d]
    logits = jnp.einsum("btgrd,bsgd->bgrts", q, k) / jnp.sqrt(jnp.float32(head_dim))
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    out = jnp.einsum("bgrts,bsgd->btgrd", jax.nn.softmax(logits, axis=-1), v)
    return _linear(p["out"], out.reshape(b, t, D))


def _gated(p, x):
    gate_up = jnp.einsum("btk,kgf->btgf", x, p["gate_up"])
    return (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]) @ p["down_proj"]


# name -> (nnx constructor, linen constructor, call keywords, plain unsharded math).
LAYERS = {
    "column": (
        lambda **kw: ubf.ColumnParallelLinear(D, F, **kw),
        lambda **kw: ubf.linen.ColumnParallelLinear(F, **kw),
        {},
        _linear,
    ),
    "row": (
        lambda **kw: ubf.RowParallelLinear(D, F, **kw),
        lambda **kw: ubf.linen.RowParallelLinear(F, **kw),
        {},
        _linear,
    ),
    # DenseGeneral-shaped: [embed] -> [heads, head_dim] and back, heads split.
    "column_general": (
        lambda **kw: ubf.ColumnParallelLinear(D, (HEADS, F // HEADS), **kw),
        lambda **kw: ubf.linen.ColumnParallelLinear((HEADS, F // HEADS), **kw),
        {},
        _general_column,
    ),
    "row_general": (
        lambda **kw: ubf.RowParallelLinear((HEADS, F // HEADS), D, axis=(-2, -1), **kw),
        lambda **kw: ubf.linen.RowParallelLinear(D, axis=(-2, -1), **kw),
        {},
        _general_row,
    ),
    "mlp": (
        lambda **kw: ubf.ParallelMLP(D, F, **kw),
        lambda **kw: ubf.linen.ParallelMLP(F, **kw),
        {},
        lambda p, x: _linear(p["down_proj"], jax.nn.gelu(_linear(p["up_proj"], x))),
    ),
    "gated_mlp": (
        lambda **kw: ubf.ParallelGatedMLP(D, F, **kw),
        lambda **kw: ubf.linen.ParallelGatedMLP(F, **kw),
        {},
        _gated,
    ),
    "attention": (
        lambda **kw: ubf.ParallelSelfAttention(D, HEADS, num_kv_heads=KV_HEADS, **kw),
        lambda **kw: ubf.linen.ParallelSelfAttention(HEADS, num_kv_heads=KV_HEADS, **kw),
        {"is_causal": True},
        _attention,
    ),
}


# The layers' input and output features where they are not D.
IN = {"row_general": (HEADS, F // HEADS)}
OUT = {"column": (F,), "row": (F,), "column_general": (HEADS, F // HEADS)}


def _loss(y, cot):
    return jnp.sum(jnp.sin(y) * cot)


def run_nnx(name, settings, x, cot, build_mesh=None):
    """``(y, param grads as a dict, x grad, params as a dict)`` of the NNX layer; with
    ``build_mesh``, the layer is built (its params placed) under that mesh and run with no
    mesh set: the mesh is found in the arrays' shardings."""
    make, _, call_kw, _ = LAYERS[name]
    if build_mesh is None:
        model = make(rngs=nnx.Rngs(0), **settings)
    else:
        with jax.set_mesh(build_mesh):
            model = make(rngs=nnx.Rngs(0), **settings)

    def loss(m, x):
        y = m(x, **call_kw)
        return _loss(y, cot), y

    grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y), (g_model, g_x) = grad(model, x)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return y, nnx.to_pure_dict(g_model), g_x, params


def run_linen(name, settings, x, cot):
    _, make, call_kw, _ = LAYERS[name]
    layer = make(**settings)
    params = nn.unbox(layer.init(jax.random.key(0), x, **call_kw))["params"]

    def loss(params, x):
        y = layer.apply({"params": params}, x, **call_kw)
        return _loss(y, cot), y

    (_, y), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
    return y, g_params, g_x, params


def reference(name, params, x, cot):
    dense = LAYERS[name][3]

    def loss(params, x):
        y = dense(params, x)
        return _loss(y, cot), y

    with jax.default_matmul_precision("highest"):
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, *grads


# impl="auto" runs the host protocol on CPU devices, as "ub" does: its column with NNX only
# (test_layer_gradients_with_no_mesh_set takes it where no mesh is set).
FRAMEWORK_IMPLS = [(f, i) for f in ("nnx", "linen") for i in IMPLS if f == "nnx" or i != "auto"]


@pytest.mark.parametrize(
    "framework,impl", FRAMEWORK_IMPLS, ids=[f"{f}-{i}" for f, i in FRAMEWORK_IMPLS]
)
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_gradients(rand, name, framework, impl):
    """The layer in each (sequence_parallel, sequence length) case of ``CASES``."""
    check_layer(rand, name, framework, impl, make_mesh((2, "dp"), (2, "tp")))


def check_layer(
    rand, name: str, framework: str, impl: str, mesh, tol: float = TOL, mesh_set: bool = True
) -> None:
    """The layer on ``mesh`` (axes ``("dp", "tp")``) in each case of ``CASES``; NNX with
    ``mesh_set=False``: built under the mesh, run with none set."""
    run = run_nnx if framework == "nnx" else run_linen
    if not mesh_set:
        run = functools.partial(run_nnx, build_mesh=mesh)
    for sequence_parallel, seq in CASES:
        x = jax.device_put(rand(B, seq, *IN.get(name, (D,))), NamedSharding(mesh, P("dp")))
        cot = rand(B, seq, *OUT.get(name, (D,)))
        settings = dict(impl=impl, sequence_parallel=sequence_parallel, seq_axis=1)
        with jax.set_mesh(mesh) if mesh_set else contextlib.nullcontext():
            y, g_params, g_x, params = run(name, settings, x, cot)
        # Plain JAX on the whole arrays, fetched to the host (a rank of the N-ranks mode
        # holds only its shards of the layer's).
        whole = jax.tree.map(np.asarray, (params, x))
        y_ref, g_ref, g_x_ref = reference(name, *whole, cot)
        what = f"{name} {framework} {impl} {sequence_parallel=} {seq=}"
        errors = {"y": rel_err(y, y_ref), "dx": rel_err(g_x, g_x_ref)}
        flat, _ = jax.tree_util.tree_flatten_with_path(g_ref)
        got = dict(jax.tree_util.tree_flatten_with_path(g_params)[0])
        for path, g in flat:
            errors["d" + jax.tree_util.keystr(path)] = rel_err(got[path], g)
        bad = {k: f"{e:.2e}" for k, e in errors.items() if not e < tol}
        assert not bad, f"{what}: relative errors {bad}"


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_gradients_with_no_mesh_set(rand, name):
    """A training loop's jit on sharded params and inputs, no ``jax.set_mesh``: impl "auto"
    finds the mesh in the arrays' shardings and runs overlapped (not XLA's plain matmuls,
    which warn), with right gradients."""
    clear_warnings()  # the warning is once per process
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not overlapped")
        check_layer(rand, name, "nnx", "auto", make_mesh((2, "dp"), (2, "tp")), mesh_set=False)
