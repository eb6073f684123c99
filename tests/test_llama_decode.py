"""Decoding with the Llama-style model (jax_ub.models.llama) on CPU devices, (dp, tp)
meshes: the stacked blocks' key/value caches, a prefilled prompt then one token at a time
give the full-sequence forward's logits; greedy decoding with jax_ub's ops gives XLA's
tokens (same params), and those of recomputing the whole sequence per token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_flax_decode import recompute_greedy

from jax_ub.models import llama

CFG = llama.PRESETS["tiny"]
BATCH = 4
MESHES = {"dp1xtp2": ((1, "dp"), (2, "tp")), "dp2xtp2": ((2, "dp"), (2, "tp"))}


def config(tp: int) -> llama.LlamaConfig:
    """The tiny preset, its 2 kv heads split over tp <= 2; for larger tp, tp kv heads of 8
    features and an MLP as wide (each rank's fp8 GEMMs keep k >= 16)."""
    if tp <= CFG.kv_heads:
        return CFG
    return dataclasses.replace(CFG, heads=2 * tp, kv_heads=tp, hidden=16 * tp, ffn=32 * tp)


def _trained(impl, mesh, steps=8, cfg=CFG):
    """A model trained a few steps on a repeating sequence, so its predictions are peaked
    rather than the near-ties of a fresh init (an argmax over near-ties would turn on
    rounding)."""
    model = llama.Llama(cfg, impl=impl, rngs=nnx.Rngs(0))
    period = jax.random.randint(jax.random.key(5), (BATCH, 8), 0, cfg.vocab)
    tokens = jax.device_put(jnp.tile(period, (1, 4)), NamedSharding(mesh, P("dp", None)))
    optimizer = llama.make_optimizer(model, 1e-2)
    for _ in range(steps):
        llama.train_step(model, optimizer, tokens)
    return model


@pytest.mark.parametrize("mesh_shape", MESHES.values(), ids=MESHES.keys())
def test_decode_logits_equal_full_forward(mesh_shape, impl="ub"):
    """With jax_ub's ops; impl="xla" decodes as XLA does (test_greedy_generate_ub_equals_xla)."""
    mesh = make_mesh(*mesh_shape)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 12), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        model = _trained(impl, mesh, steps=2)
        full = nnx.jit(lambda m, t: m(t))(model, tokens)
        model.init_cache(BATCH, 16)
        cache = model.blocks.attn.cached_key
        assert cache.shape == (CFG.layers, BATCH, 16, CFG.kv_heads, CFG.hidden // CFG.heads)
        dp = "dp" if mesh.shape["dp"] > 1 else None  # JAX leaves a size-1 axis out
        assert cache[...].sharding.spec == P(None, dp, None, "tp")  # the batch as the tokens
        step = nnx.jit(lambda m, t: m.decode(t))
        pieces = [step(model, tokens[:, :7])]  # the prompt, 7 tokens (not a multiple of tp)
        pieces += [step(model, tokens[:, i : i + 1]) for i in range(7, 12)]
    assert [p.shape for p in pieces] == [(BATCH, 7, CFG.vocab)] + [(BATCH, 1, CFG.vocab)] * 5
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.cache_index[...]), [12] * CFG.layers)
    got = jnp.concatenate(pieces, axis=1)
    assert rel_err(got, full) < 1e-5, rel_err(got, full)


@pytest.mark.parametrize(
    "mesh_shape",
    [MESHES["dp2xtp2"], ((1, "dp"), (8, "tp")), ((2, "dp"), (1, "tp"))],
    # tp=1: the vocab sum over a group of one (dp1xtp2's cache: the logits test above)
    ids=["dp2xtp2", "dp1xtp8", "dp2xtp1"],
)
def test_greedy_generate_ub_equals_xla(mesh_shape):
    check_greedy_generate(make_mesh(*mesh_shape))


def check_greedy_generate(mesh):
    """Greedy tokens with the cache, ub and xla (the same params), and recomputing the whole
    sequence per token, are all the same; the kv heads split over the mesh's tp."""
    cfg = config(mesh.shape["tp"])
    prompt = jax.random.randint(jax.random.key(3), (BATCH, 5), 0, cfg.vocab)
    with jax.set_mesh(mesh):
        prompt = jax.device_put(prompt, NamedSharding(mesh, P("dp", None)))
        ub = _trained("ub", mesh, cfg=cfg)
        xla = llama.Llama(cfg, impl="xla", rngs=nnx.Rngs(1))
        nnx.update(xla, nnx.state(ub, nnx.Param))  # the same params
        out = {name: llama.greedy_generate(m, prompt, 9) for name, m in (("ub", ub), ("xla", xla))}
        # Without the cache: the whole sequence through the forward for each token.
        recomputed = recompute_greedy(xla, prompt, 9)
    assert out["ub"].shape == (BATCH, 14)
    assert len(np.unique(np.asarray(out["ub"][:, 5:]))) > 1  # not one token over and over
    np.testing.assert_array_equal(np.asarray(out["ub"][:, :5]), np.asarray(prompt))
    np.testing.assert_array_equal(np.asarray(out["ub"]), np.asarray(out["xla"]))
    np.testing.assert_array_equal(np.asarray(out["ub"]), np.asarray(recomputed))


def test_training_after_decoding_is_unchanged():
    """The cache rides along in the scan of a training step untouched: the loss of a model
    that has decoded is that of one that has not."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 16), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        losses = []
        for generate in (False, True):
            model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
            if generate:
                llama.greedy_generate(model, tokens[:, :4], 3)
            optimizer = llama.make_optimizer(model, 3e-3)
            losses.append([float(llama.train_step(model, optimizer, tokens)) for _ in range(2)])
    assert np.isfinite(losses).all(), losses
    np.testing.assert_array_equal(losses[0], losses[1])


def test_what_the_model_cannot_hold_is_named():
    """A cache too short for greedy_generate's steps (the jitted decode would give NaN
    logits, argmax 0), a batch the cache cannot split over dp, a vocabulary tp does not
    divide, and a sequence with no next token raise naming the sizes."""
    mesh = make_mesh(*MESHES["dp2xtp2"])
    with jax.set_mesh(mesh):
        model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
        prompt = jnp.zeros((BATCH, 4), jnp.int32) + 3
        with pytest.raises(ValueError, match=r"max_length \(6\) must hold .* 4 \+ 6 = 10"):
            llama.greedy_generate(model, prompt, 6, max_length=6)
        with pytest.raises(ValueError, match=r"batch \(3\) must be a multiple of the mesh's dp"):
            model.init_cache(3, 8)
        with pytest.raises(ValueError, match=r"tp \(2\) must divide .* vocab=255"):
            llama.Llama(dataclasses.replace(CFG, vocab=255), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"at least 2 tokens"):
            llama.next_token_loss(model, prompt[:, :1])


def test_eager_calls_equal_jitted_ones():
    """The model outside jit (its embedding's partly manual shard_map is jitted inside):
    the forward's logits, and a prefill then a token of decoding, as the jitted ones."""
    mesh = make_mesh(*MESHES["dp2xtp2"])
    tokens = jax.random.randint(jax.random.key(2), (BATCH, 8), 0, CFG.vocab)
    with jax.set_mesh(mesh):
        model = llama.Llama(CFG, impl="ub", rngs=nnx.Rngs(0))
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp", None)))
        full = nnx.jit(lambda m, t: m(t))(model, tokens)
        assert rel_err(model(tokens), full) < 1e-5
        model.init_cache(BATCH, 8)
        model.decode(tokens[:, :7])
        assert rel_err(model.decode(tokens[:, 7:]), full[:, 7:]) < 1e-4
