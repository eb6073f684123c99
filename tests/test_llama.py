"""The Llama-style model (jax_ub.models.llama) on CPU devices, dp=2 x tp=2: training with
jax_ub's ops follows XLA's collectives step for step (float32, scan over layers with each
remat policy), the model's sharding, and the FLOP count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub.models import llama

CFG = llama.PRESETS["tiny"]


def _losses(impl, remat, steps, tokens):
    model = llama.Llama(CFG, impl=impl, remat=remat, rngs=nnx.Rngs(0))
    optimizer = llama.make_optimizer(model, 3e-3)
    return np.array([float(llama.train_step(model, optimizer, tokens)) for _ in range(steps)])


@pytest.mark.parametrize("remat, steps", [("dots", 20), ("full", 3), ("none", 3)])
def test_training_matches_xla(remat, steps):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        ub, xla = (_losses(impl, remat, steps, tokens) for impl in ("ub", "xla"))
    assert np.all(np.isfinite(ub))
    assert ub[-1] < 0.7 * ub[0] if steps >= 10 else ub[-1] < ub[0], ub  # it learns
    np.testing.assert_allclose(ub, xla, rtol=1e-5)


def test_params_are_stacked_and_sharded():
    mesh = make_mesh((2, "dp"), (2, "tp"))
    with jax.set_mesh(mesh):
        model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
    gate_up = model.blocks.mlp.gate_up
    assert gate_up.shape == (CFG.layers, CFG.hidden, 2, CFG.ffn)
    assert gate_up[...].sharding.spec == P(None, None, None, "tp")
    assert model.blocks.attn.qkv.kernel[...].sharding.spec == P(None, None, "tp")


def test_flops_per_token_counts_the_matmuls():
    cfg = llama.PRESETS["llama3-8b"]
    # About 6 x 8.0e9 params (the embedding's lookup is no matmul, so 7.5e9 count) plus
    # attention: the usual ~4.9e10 per token at seq 8192 for Llama 3 8B.
    assert 4.5e10 < cfg.flops_per_token(8192) < 5.5e10


@pytest.mark.parametrize("fp8", ["current", "delayed"])
def test_fp8_training_matches_xla(fp8):
    """fp8 projections: jax_ub's fp8 ops and XLA's fp8 GEMMs of the same quantized
    operands follow each other; with delayed scaling every layer's amax histories fill
    step by step."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, CFG.vocab)
    losses, models = {}, {}
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        for impl in ("ub", "xla"):
            model = llama.Llama(CFG, impl=impl, fp8=fp8, rngs=nnx.Rngs(0))
            optimizer = llama.make_optimizer(model, 3e-3)
            losses[impl] = np.array(
                [float(llama.train_step(model, optimizer, tokens)) for _ in range(3)]
            )
            models[impl] = model
    assert np.all(np.isfinite(losses["ub"])) and losses["ub"][-1] < losses["ub"][0]
    np.testing.assert_allclose(losses["ub"], losses["xla"], rtol=1e-4)
    if fp8 == "delayed":
        history = models["ub"].blocks.attn.qkv.input_amax_history[...]  # [layers, length]
        assert history.shape[0] == CFG.layers
        assert np.all(history[:, :3] > 0) and np.all(history[:, 3:] == 0)


def test_bfloat16_params_keep_float32_moments():
    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        model = llama.Llama(CFG, impl="ub", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        optimizer = llama.make_optimizer(model, 3e-3)
        losses = [float(llama.train_step(model, optimizer, tokens)) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    moments = [m for m in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)) if m.ndim]
    assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}
    assert model.blocks.mlp.gate_up[...].dtype == jnp.bfloat16


def test_cudnn_core_runs_with_every_axis_manual(monkeypatch):
    """cuDNN attention (custom_partitioning) cannot run in a partly manual computation:
    the attention core runs in a shard_map over the remaining axes (here dp), the batch
    split over them. Forced on CPU (XLA's core under the cuDNN path): the losses are
    those of the plain path, and the module holds the nested manual computations."""
    from jax_ub.flax import _attention

    real = jax.nn.dot_product_attention

    def as_xla(q, k, v, mask=None, is_causal=False, implementation=None):
        return real(q, k, v, mask=mask, is_causal=is_causal, implementation="xla")

    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        plain = _losses("ub", "dots", 3, tokens)
        model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
        lowered = nnx.jit(llama.next_token_loss).lower(model, tokens).as_text()
        monkeypatch.setattr(_attention, "_attention_backend", lambda *a, **k: "cudnn")
        monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
        _attention.attention_call.cache_clear()
        nested = _losses("ub", "dots", 3, tokens)
        model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
        text = nnx.jit(llama.next_token_loss).lower(model, tokens).as_text()
    _attention.attention_call.cache_clear()
    np.testing.assert_allclose(nested, plain, rtol=1e-6)
    # One more manual computation per block: the core's, over dp, inside the layer's.
    count = "sdy.manual_computation"
    assert text.count(count) == lowered.count(count) + 1, (text.count(count), lowered.count(count))


def test_dots_policy_keeps_the_ops_results():
    """Under remat="dots" the backward reuses jax_ub's op results (named for
    jax_ub.dots_and_ops_saveable) as XLA's dots are reused: as many op calls as with no
    remat, fewer than with full remat (which recomputes the forward's ops)."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, CFG.vocab)
    calls = {}
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        for remat in ("none", "dots", "full"):
            model = llama.Llama(CFG, impl="ub", remat=remat, rngs=nnx.Rngs(0))
            grad = nnx.jit(lambda m, t: nnx.value_and_grad(llama.next_token_loss)(m, t))
            text = grad.lower(model, tokens).compile().as_text()
            calls[remat] = text.count('custom_call_target="jax_ub_')
    assert calls["dots"] == calls["none"] < calls["full"], calls
