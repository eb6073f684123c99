"""The Flax layers on sequences tp does not divide (one token being decoded, a prompt of
any length): the activations replicated over tp, column-parallel a local GEMM,
row-parallel a GEMM and an all-reduce. CPU devices, (dp, tp) meshes, against dense math
from the same params and against the same block on a sequence tp divides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf

D, F, BATCH = 16, 32, 4
# Nonzero biases, so that a bias added twice (or not at all) on the replicated path shows.
BIAS = nnx.initializers.normal(0.5)


def mesh_dp_tp():
    return make_mesh((2, "dp"), (2, "tp"))


def batch_sharded(mesh, x, seq_axis=0):
    spec = P(None, "dp") if seq_axis == 0 else P("dp")
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("seq", [1, 5])
def test_column_then_row(rand, seq):
    mesh = mesh_dp_tp()
    x = rand(seq, BATCH, D)
    with jax.set_mesh(mesh):
        col = ubf.ColumnParallelLinear(D, F, impl="ub", bias_init=BIAS, rngs=nnx.Rngs(0))
        row = ubf.RowParallelLinear(F, D, impl="ub", bias_init=BIAS, rngs=nnx.Rngs(1))
        y = nnx.jit(lambda c, r, x: r(jnp.tanh(c(x))))(col, row, batch_sharded(mesh, x))
    h = np.tanh(np.asarray(x) @ col.kernel[...] + col.bias[...])
    assert rel_err(y, h @ row.kernel[...] + row.bias[...]) < 1e-5


@pytest.mark.parametrize("seq", [1, 3])
def test_mlp_forward_and_grads(rand, seq):
    mesh = mesh_dp_tp()
    x = batch_sharded(mesh, rand(seq, BATCH, D))
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelMLP(D, F, impl="ub", bias_init=BIAS, rngs=nnx.Rngs(0))
        loss = lambda m, x: jnp.sum(jnp.sin(m(x)))  # noqa: E731
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
        g_mlp, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mlp, x)
    p = {
        "w1": mlp.up_proj.kernel[...],
        "b1": mlp.up_proj.bias[...],
        "w2": mlp.down_proj.kernel[...],
        "b2": mlp.down_proj.bias[...],
    }

    def dense(p, x):
        return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    x_np = np.asarray(x)
    assert rel_err(y, dense(p, x_np)) < 1e-5
    want_p, want_x = jax.grad(lambda p, x: jnp.sum(jnp.sin(dense(p, x))), argnums=(0, 1))(p, x_np)
    assert rel_err(g_x, want_x) < 1e-5
    assert rel_err(g_mlp.up_proj.kernel[...], want_p["w1"]) < 1e-5
    assert rel_err(g_mlp.down_proj.kernel[...], want_p["w2"]) < 1e-5
    assert rel_err(g_mlp.up_proj.bias[...], want_p["b1"]) < 1e-5
    assert rel_err(g_mlp.down_proj.bias[...], want_p["b2"]) < 1e-5


def test_gated_mlp_one_token(rand):
    mesh = mesh_dp_tp()
    x = rand(BATCH, 1, D)  # batch-major, one token
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelGatedMLP(D, F, impl="ub", seq_axis=1, rngs=nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x))(mlp, batch_sharded(mesh, x, seq_axis=1))
    want = jax_ub.gated_mlp_reference(x, mlp.gate_up[...], mlp.down_proj[...])
    assert rel_err(y, want) < 1e-5


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_causal_attention_prefix_equals_full_sequence(rand, num_kv_heads):
    """Causal attention over the first 5 tokens (replicated) equals the first 5 outputs
    over 16 tokens (sequence-parallel): one block definition for both layouts."""
    mesh = mesh_dp_tp()
    x = rand(16, BATCH, D)
    with jax.set_mesh(mesh):
        attn = ubf.ParallelSelfAttention(
            D, 4, num_kv_heads=num_kv_heads, rope_theta=10000.0, impl="ub", rngs=nnx.Rngs(0)
        )
        call = nnx.jit(lambda a, x: a(x, is_causal=True))
        full = call(attn, batch_sharded(mesh, x))
        prefix = call(attn, batch_sharded(mesh, x[:5]))
    assert rel_err(prefix, full[:5]) < 1e-5


def test_fp8_replicated_close_to_high_precision(rand):
    mesh = mesh_dp_tp()
    x = batch_sharded(mesh, rand(3, BATCH, 32))
    with jax.set_mesh(mesh):
        ys = {
            fp8: nnx.jit(lambda m, x: m(x))(ubf.ParallelMLP(32, 64, fp8=fp8, rngs=nnx.Rngs(0)), x)
            for fp8 in (False, True)
        }
    assert 1e-4 < rel_err(ys[True], ys[False]) < 1e-1  # quantized, and close


def test_linen_mlp_one_token(rand):
    mesh = mesh_dp_tp()
    x = rand(1, BATCH, D)
    with jax.set_mesh(mesh):
        mlp = ubf.linen.ParallelMLP(F, impl="ub", bias_init=BIAS)
        variables = mlp.init(jax.random.key(0), x)
        y = jax.jit(mlp.apply)(variables, batch_sharded(mesh, x))
    p = nn.unbox(variables)["params"]
    up, down = p["up_proj"], p["down_proj"]
    want = jax.nn.gelu(np.asarray(x) @ up["kernel"] + up["bias"]) @ down["kernel"] + down["bias"]
    assert rel_err(y, want) < 1e-5


def test_attention_and_gated_mlp_without_a_mesh_equal_with_one(rand):
    """No mesh set, given or carried by the arrays: XLA's plain math (one warning), equal
    to the same blocks (same params) run over tp under jax.set_mesh and, with no mesh set,
    on arrays sharded over it (found there)."""
    mesh = mesh_dp_tp()
    x = rand(8, BATCH, D)
    attn = ubf.ParallelSelfAttention(D, 4, num_kv_heads=2, rope_theta=1e4, rngs=nnx.Rngs(0))
    mlp = ubf.ParallelGatedMLP(D, F, rngs=nnx.Rngs(1))
    step = nnx.jit(lambda a, m, x: m(a(x, is_causal=True)))
    with pytest.warns(UserWarning, match="not overlapped"):
        plain = step(attn, mlp, x)
    x = batch_sharded(mesh, x)
    assert rel_err(step(attn, mlp, x), plain) < 1e-5
    with jax.set_mesh(mesh):
        over_tp = step(attn, mlp, x)
    assert rel_err(plain, over_tp) < 1e-5
