"""bfloat16 training and decoding on CPU devices, where XLA's CPU compiler aborts the
process on a 16-bit all-reduce in a partly manual shard_map
(``jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS``): the plain-JAX reproducer, which tells when
the workaround can go, and every Flax layer trained in bfloat16 on the paths that meet
it (activations replicated over tp, whose cotangent JAX all-reduces)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import in_own_process, make_mesh, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_grad_matrix_flax import IN, LAYERS, OUT, B, D, reference, run_linen, run_nnx

import jax_ub
from jax_ub._src import jax_compat

# A bfloat16 input replicated over the manual axis of a partly manual shard_map: its
# cotangent is psum-ed over that axis in bfloat16. No jax_ub involved.
_REPRODUCER = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    f = jax.shard_map(lambda x, b: x + b, mesh=mesh, in_specs=(P("tp"), P()),
                      out_specs=P("tp"), axis_names={"tp"})
    loss = lambda x, b: jnp.sum(f(x, b).astype(jnp.float32))
    x, b = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((8,), jnp.bfloat16)
    print(jax.jit(jax.grad(loss, argnums=1))(x, b))
    """
)


def test_plain_jax_reproducer_still_aborts():
    """Fails once a JAX release compiles the reproducer: then drop the workaround
    (``jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS`` and what reads it)."""
    run = subprocess.run(
        [sys.executable, "-c", _REPRODUCER], capture_output=True, text=True, timeout=120
    )
    if run.returncode == 0:
        pytest.fail(
            f"JAX {jax.__version__} no longer aborts on a bfloat16 all-reduce in a partly "
            "manual shard_map on CPU: remove jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS's "
            f"workaround where this JAX is the oldest supported; output: {run.stdout[-300:]}"
        )
    assert jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS
    assert "Invalid binary instruction opcode copy" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_trains_in_bfloat16(rand, name, framework):
    """Forward and gradients of the layer with ``dtype=bfloat16`` (params float32), on a
    sequence tp does not divide (replicated activations) and one sequence-parallel, near
    the float32 math; impl "ub" (the host protocol), batch-major, (dp=2, tp=2)."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    run = run_nnx if framework == "nnx" else run_linen
    for seq in (5, 8):
        x = rand(B, seq, *IN.get(name, (D,)), dtype=jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("dp")))
        cot = rand(B, seq, *OUT.get(name, (D,)))
        settings = dict(impl="ub", seq_axis=1, dtype=jnp.bfloat16)
        with jax.set_mesh(mesh):
            y, g_params, g_x, params = run(name, settings, x, cot)
        assert y.dtype == g_x.dtype == jnp.bfloat16
        y_ref, g_ref, g_x_ref = reference(name, params, x.astype(jnp.float32), cot)
        assert rel_err(y, y_ref) < 3e-2, (name, seq)
        assert rel_err(g_x, g_x_ref) < 5e-2, (name, seq)
        for got, want in zip(jax.tree.leaves(g_params), jax.tree.leaves(g_ref)):
            assert rel_err(got, want) < 5e-2, (name, seq)


@pytest.mark.slow  # a whole model: the slow tier (conftest.py)
def test_bfloat16_llama_decodes_on_cpu(request):
    """The Llama-style model (its vocabulary-parallel embedding all-reduces when decoding)
    in bfloat16 on (dp=2, tp=2): a few training steps, then greedy decoding with the cache,
    jax_ub's tokens equal to XLA's collectives' (same params). It aborted the process, so
    it runs in a process of its own."""
    if not in_own_process(request):
        return
    from flax import nnx

    from jax_ub.models import llama

    cfg, batch = llama.PRESETS["tiny"], 4
    mesh = make_mesh((2, "dp"), (2, "tp"))
    period = jax.random.randint(jax.random.key(5), (batch, 8), 0, cfg.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(jnp.tile(period, (1, 4)), NamedSharding(mesh, P("dp", None)))
        ub = llama.Llama(cfg, impl="ub", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        optimizer = llama.make_optimizer(ub, 1e-2)
        losses = [float(llama.train_step(ub, optimizer, tokens)) for _ in range(4)]
        xla = llama.Llama(cfg, impl="xla", dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
        nnx.update(xla, nnx.state(ub, nnx.Param))
        out = {
            m: llama.greedy_generate(model, tokens[:, :5], 6)
            for m, model in (("ub", ub), ("xla", xla))
        }
    assert all(jnp.isfinite(jnp.asarray(losses))) and losses[-1] < losses[0], losses
    np.testing.assert_array_equal(np.asarray(out["ub"]), np.asarray(out["xla"]))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_eager_bfloat16_call_beside_dp(rand, axis_type):
    """An op called eagerly (no jit) on bfloat16 global arrays, a dp axis beside tp: the
    widened call is a partly manual, unchecked shard_map, which JAX runs only traced (eagerly
    it refused out_specs over dp); the call jits it."""
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(kind, kind), devices=jax.devices()[:4])
    x, w = rand(8, 2, 16, dtype=jnp.bfloat16), rand(16, 12, dtype=jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("tp", "dp")))  # [seq, batch, features]
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    with jax.set_mesh(mesh):
        y = jax_ub.all_gather_matmul(x, w, "tp", impl="ub")
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert rel_err(y, want) < 1e-2
