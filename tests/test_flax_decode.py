"""Decoding with a key/value cache (nnx ParallelSelfAttention's init_cache and decode=True)
on CPU devices, (dp, tp) meshes: a prompt then one token at a time equals causal attention
over the whole sequence; a small LM decodes greedily to the same tokens as recomputing the
sequence, and as the same model with impl="xla"; GQA with rotary embeddings; misuse named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf

D, HEADS, KV_HEADS, BATCH, MAX = 32, 4, 2, 4, 16


def attention(impl="ub", seq_axis=0):
    return ubf.ParallelSelfAttention(
        D,
        HEADS,
        num_kv_heads=KV_HEADS,
        rope_theta=1e4,
        impl=impl,
        seq_axis=seq_axis,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize("seq_axis", [0, 1])
def test_prompt_then_tokens_equal_full_causal_attention(rand, seq_axis):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = rand(10, BATCH, D)  # [seq, batch, d]
    if seq_axis == 1:
        x = jnp.swapaxes(x, 0, 1)
    take = lambda a, s: a[s] if seq_axis == 0 else a[:, s]  # noqa: E731
    with jax.set_mesh(mesh):
        attn = attention(seq_axis=seq_axis)
        full = attn(x, is_causal=True)
        attn.init_cache(BATCH, MAX)
        step = nnx.jit(lambda a, x: a(x, decode=True))
        pieces = [step(attn, take(x, slice(0, 6)))]  # the prompt, 6 tokens
        for i in range(6, 10):
            pieces.append(step(attn, take(x, slice(i, i + 1))))
    got = jnp.concatenate(pieces, axis=seq_axis)
    assert int(attn.cache_index[...]) == 10
    assert rel_err(got, full) < 1e-5


class TinyLM(nnx.Module):
    """Embedding, GQA self-attention, gated MLP, head. ``kv_heads`` (at least the mesh's tp,
    which splits them) of 8 features each, two query heads per kv head."""

    def __init__(self, vocab, impl, rngs, kv_heads=KV_HEADS):
        d = 16 * kv_heads  # 2 * kv_heads query heads of 8 features: D at 2 kv heads
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.attn = ubf.ParallelSelfAttention(
            d,
            2 * kv_heads,
            num_kv_heads=kv_heads,
            rope_theta=1e4,
            impl=impl,
            seq_axis=1,
            rngs=rngs,
        )
        self.mlp = ubf.ParallelGatedMLP(d, 8 * kv_heads, impl=impl, seq_axis=1, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, decode=False):
        x = self.embed(tokens)  # [batch, t, d]
        x = x + self.attn(x, is_causal=not decode, decode=decode)
        return self.head(x + self.mlp(x))


def greedy(model, prompt, steps, cached):
    """``prompt [batch, p]`` and its ``steps`` greedy next tokens: with the attention's
    cache (the prompt in one step, then a token a step), or recomputed."""
    if not cached:
        return np.asarray(recompute_greedy(model, prompt, steps))
    model.attn.init_cache(prompt.shape[0], MAX)
    step = nnx.jit(lambda m, t: m(t, decode=True))  # two programs: the prompt, one token
    logits, tokens = step(model, prompt), [prompt]
    for _ in range(steps):
        tokens.append(jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None])
        logits = step(model, tokens[-1])
    return np.asarray(jnp.concatenate(tokens, axis=1))


def recompute_greedy(model, prompt, steps):
    """``prompt [batch, p]`` and its ``steps`` greedy next tokens, the whole sequence
    through ``model(tokens)`` (causal) for each. One compiled program serves every step: it
    runs on a buffer of the final length, the tokens not yet chosen zero, which the logits
    at the positions before them do not see."""

    @nnx.jit
    def choose(m, tokens, t):
        logits = jnp.take(m(tokens), t - 1, axis=1)  # [batch, vocab] at position t - 1
        return tokens.at[:, t].set(jnp.argmax(logits, axis=-1).astype(tokens.dtype))

    p = prompt.shape[1]
    tokens = jnp.pad(prompt, ((0, 0), (0, steps)))
    for t in range(p, p + steps):
        tokens = choose(model, tokens, jnp.int32(t))
    return tokens


@pytest.mark.slow  # a whole model: the slow tier (conftest.py)
@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 8)])
def test_tiny_lm_greedy_decoding(rand, dp, tp):
    check_greedy_decoding(make_mesh((dp, "dp"), (tp, "tp")))


def check_greedy_decoding(mesh):
    """TinyLM's greedy tokens, cached and recomputed, ub and xla, are all the same; its kv
    heads split over the mesh's tp (one per rank above tp=2)."""
    kv_heads = max(KV_HEADS, mesh.shape["tp"])
    prompt = jax.random.randint(jax.random.key(3), (BATCH, 5), 0, 64)
    with jax.set_mesh(mesh):
        prompt = jax.device_put(prompt, NamedSharding(mesh, P("dp")))
        out = {
            (impl, cached): greedy(TinyLM(64, impl, nnx.Rngs(0), kv_heads), prompt, 6, cached)
            for impl in ("ub", "xla")
            for cached in (True, False)
        }
    reference = out["xla", False]
    assert reference.shape == (BATCH, 11)
    assert len(np.unique(reference[:, 5:])) > 1, reference  # not one token over and over
    for key, tokens in out.items():
        np.testing.assert_array_equal(tokens, reference, err_msg=str(key))


def test_misuse_is_named(rand):
    mesh = make_mesh((2, "tp"))
    with jax.set_mesh(mesh):
        attn = attention()
        with pytest.raises(ValueError, match="call init_cache first"):
            attn(rand(1, BATCH, D), decode=True)
        attn.init_cache(BATCH, 4)
        with pytest.raises(
            ValueError, match=r"takes \[t, batch, 32\].*got input shape \(1, 3, 32\)"
        ):
            attn(rand(1, 3, D), decode=True)
        with pytest.raises(
            ValueError, match="5 new tokens at position 0 overflow the cache of max_length 4"
        ):
            attn(rand(5, BATCH, D), decode=True)
        step = nnx.jit(lambda a, x: a(x, decode=True))
        step(attn, rand(3, BATCH, D))
        y = step(attn, rand(2, BATCH, D))  # positions 3, 4 of 4: under jit, NaN
    assert bool(jnp.all(jnp.isnan(y)))
