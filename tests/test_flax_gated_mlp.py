"""ParallelGatedMLP (nnx and linen) on CPU devices: forward and gradients against the
unsharded math from the same params, on (dp, tp) meshes from plain jit, batch-major, the
params' sharding and checkpoint layout, fp8 (current scaling; delayed:
test_flax_gated_fp8_delayed.py), bad settings."""

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

SEQ, BATCH, D, F = 16, 4, 16, 32


def _x(rand, mesh, seq_axis=0):
    x = rand(SEQ, BATCH, D)
    spec = P("tp", "dp")
    if seq_axis == 1:
        x, spec = jnp.swapaxes(x, 0, 1), P("dp", "tp")
    return jax.device_put(x, NamedSharding(mesh, spec))


def _reference(x, gate_up, down, activation="silu", seq_axis=0):
    x = jnp.moveaxis(jnp.asarray(x, jnp.float32), seq_axis, 0)
    y = jax_ub.gated_mlp_reference(x, gate_up, down, activation=activation)
    return jnp.moveaxis(y, 0, seq_axis)


@pytest.mark.parametrize("seq_axis", [0, 1])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_nnx_forward_and_grads(rand, activation, seq_axis):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = _x(rand, mesh, seq_axis)
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelGatedMLP(
            D, F, activation=activation, impl="ub", seq_axis=seq_axis, rngs=nnx.Rngs(0)
        )
        assert nnx.get_partition_spec(nnx.state(mlp))["gate_up"].get_value() == P(None, None, "tp")
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
        loss = lambda m, x: jnp.sum(jnp.sin(m(x)))  # noqa: E731
        g_mlp, g_x = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(mlp, x)
    params = (np.asarray(mlp.gate_up[...]), np.asarray(mlp.down_proj[...]))
    assert rel_err(y, _reference(x, *params, activation, seq_axis)) < 1e-5

    def ref_loss(x, gate_up, down):
        return jnp.sum(jnp.sin(_reference(x, gate_up, down, activation, seq_axis)))

    want = jax.grad(ref_loss, argnums=(0, 1, 2))(np.asarray(x), *params)
    assert rel_err(g_x, want[0]) < 1e-5
    assert rel_err(g_mlp.gate_up[...], want[1]) < 1e-5
    assert rel_err(g_mlp.down_proj[...], want[2]) < 1e-5


def test_linen_matches_nnx_params_and_math(rand):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = _x(rand, mesh)
    with jax.set_mesh(mesh):
        mlp = ubf.linen.ParallelGatedMLP(F, impl="ub")
        variables = mlp.init(jax.random.key(0), x)
        specs = nn.get_partition_spec(variables)["params"]
        assert specs["gate_up"] == P(None, None, "tp") and specs["down_proj"] == P("tp", None)
        y = jax.jit(mlp.apply)(variables, x)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(mlp.apply(v, x)))))(variables)
    params = nn.unbox(variables)["params"]
    assert params["gate_up"].shape == (D, 2, F) and params["down_proj"].shape == (F, D)
    assert rel_err(y, _reference(x, params["gate_up"], params["down_proj"])) < 1e-5

    def ref_loss(p):
        return jnp.sum(jnp.sin(_reference(np.asarray(x), p["gate_up"], p["down_proj"])))

    want = jax.grad(ref_loss)(jax.tree.map(np.asarray, params))
    got = nn.unbox(grads)["params"]
    for name in ("gate_up", "down_proj"):
        assert rel_err(got[name], want[name]) < 1e-5, name


def test_checkpoint_of_separate_kernels_loads(rand):
    """An unsharded model's gate_proj, up_proj and down_proj, stacked as the docstring
    says, give that model's output."""
    mesh = make_mesh((4, "tp"))
    gate, up, down = rand(D, F, scale=0.3), rand(D, F, scale=0.3), rand(F, D, scale=0.3)
    x = rand(SEQ, BATCH, D)
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelGatedMLP(D, F, impl="ub", rngs=nnx.Rngs(0))
        mlp.gate_up[...] = jnp.stack([gate, up], axis=1)
        mlp.down_proj[...] = down
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
    want = (jax.nn.silu(np.asarray(x) @ gate) * (np.asarray(x) @ up)) @ down
    assert rel_err(y, want) < 1e-5


def test_fp8_current_scaling_matches_xla(rand):
    mesh = make_mesh((2, "tp"))
    x = rand(32, 2, 32)
    with jax.set_mesh(mesh):
        ys = {
            impl: nnx.jit(lambda m, x: m(x))(
                ubf.ParallelGatedMLP(32, 64, impl=impl, fp8=True, rngs=nnx.Rngs(0)), x
            )
            for impl in ("ub", "xla")
        }
    assert rel_err(ys["ub"], ys["xla"]) < 1e-2


def test_bad_settings_are_named():
    mesh = make_mesh((4, "tp"))
    with pytest.raises(ValueError, match="hidden_features=6 must be a positive multiple"):
        ubf.ParallelGatedMLP(D, 6, mesh=mesh, rngs=nnx.Rngs(0))
    bad_length = dict(fp8="delayed", amax_history_length=0)
    with pytest.raises(ValueError, match="ParallelGatedMLP: amax_history_length .* got 0"):
        ubf.ParallelGatedMLP(D, F, mesh=mesh, rngs=nnx.Rngs(0), **bad_length)
    with pytest.raises(ValueError, match="ParallelGatedMLP: fp8 must be False, True .* 'delayd'"):
        ubf.linen.ParallelGatedMLP(F, mesh=mesh, fp8="delayd").init(
            jax.random.key(0), jnp.ones((SEQ, BATCH, D))
        )
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelGatedMLP(D, F, activation="relu", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="activation must be one of"):
            mlp(jnp.ones((SEQ, BATCH, D)))
