"""GPU tier of jax_ub.flax: the fused cuDNN attention core against XLA's, on GPUs.

Skipped without at least 2 GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import RANKS, gpu_mesh, gpu_rel_err, need_gpus
from flax import nnx

import jax_ub.flax as ubf

pytestmark = pytest.mark.gpu

GPUS = need_gpus(2)

SEQ, BATCH, D, HEADS = 512, 2, 512, 8  # head_dim 64


def _loss_and_grads(model, x, ct):
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def run(params, x):
        def f(params, x):
            return nnx.merge(graphdef, params)(x, is_causal=True)

        y, vjp = jax.vjp(f, params, x)
        g_params, g_x = vjp(ct)
        return y, nnx.to_pure_dict(g_params), g_x

    return run(params, x), run.lower(params, x).compile().as_text()


@pytest.mark.parametrize("impl", ["ub", "xla"])
def test_cudnn_attention_matches_xla_attention(impl):
    """The default core on GPUs (cuDNN flash attention) equals XLA's, forward and grads."""
    mesh = gpu_mesh(GPUS, (RANKS or min(4, len(GPUS)),), ("tp",))
    kw = dict(mesh=mesh, impl=impl, dtype=jnp.bfloat16)
    fused = ubf.ParallelSelfAttention(D, HEADS, rngs=nnx.Rngs(0), **kw)
    plain = ubf.ParallelSelfAttention(
        D, HEADS, attention_implementation="xla", rngs=nnx.Rngs(0), **kw
    )
    k1, k2 = jax.random.split(jax.random.key(7))
    x = jax.random.normal(k1, (SEQ, BATCH, D), jnp.float32)
    ct = jax.random.normal(k2, (SEQ, BATCH, D), jnp.float32).astype(jnp.bfloat16)

    (y, g, gx), hlo_fused = _loss_and_grads(fused, x, ct)
    (y_ref, g_ref, gx_ref), _ = _loss_and_grads(plain, x, ct)
    assert "cudnn" in hlo_fused.lower()  # the fused kernel runs (XLA may fuse its own too)
    assert gpu_rel_err(y, y_ref) < 2e-2
    assert gpu_rel_err(gx, gx_ref) < 3e-2
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(g), jax.tree_util.tree_leaves_with_path(g_ref)
    ):
        assert gpu_rel_err(a, b) < 3e-2, path
