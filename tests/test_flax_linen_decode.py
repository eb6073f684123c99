"""Decoding with a key/value cache in the linen ParallelSelfAttention (decode=True, flax's
"cache" collection) on CPU devices, (dp, tp) and tp meshes: the cache created by init or a
first apply with mutable=["cache"], boxed like the params; a prompt then one token at a
time equals causal attention over the whole sequence (GQA, rotary embeddings, seq- and
batch-major); a small linen LM decodes greedily to the same tokens as recomputing the
sequence, with impl="ub" and "xla"; misuse named."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax.linen as ubl

D, HEADS, KV_HEADS, BATCH, MAX = 32, 4, 2, 4, 16


def attention(impl="ub", seq_axis=0, **kw):
    return ubl.ParallelSelfAttention(
        HEADS, num_kv_heads=KV_HEADS, rope_theta=1e4, impl=impl, seq_axis=seq_axis, **kw
    )


def updated(variables, mutated):
    return {**variables, **mutated}


def test_cache_is_boxed_like_the_params():
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = jax.ShapeDtypeStruct((MAX, BATCH, D), jnp.float32)
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(
            lambda x: attention(dtype=jnp.bfloat16).init(jax.random.key(0), x, decode=True), x
        )
        rules = (("embed", None), ("heads", "tp"))
        logical = attention(kernel_axes=("embed", "heads"))
        with nn.logical_axis_rules(rules):
            abstract_logical = jax.eval_shape(
                lambda x: logical.init(jax.random.key(0), x, decode=True), x
            )
    cache = abstract["cache"]
    assert set(cache) == {"cached_key", "cached_value", "cache_index"}
    for name in ("cached_key", "cached_value"):
        assert isinstance(cache[name], nn.Partitioned)
        assert cache[name].value.shape == (BATCH, MAX, KV_HEADS, D // HEADS)
        assert cache[name].value.dtype == jnp.bfloat16  # the layer's dtype
    assert cache["cache_index"].shape == () and cache["cache_index"].dtype == jnp.int32
    spec = nn.get_partition_spec(abstract)["cache"]
    assert spec["cached_key"] == spec["cached_value"] == P(None, None, "tp", None)
    spec = nn.get_partition_spec(abstract_logical)["cache"]
    assert spec["cached_key"] == P(None, None, "heads", None)
    assert isinstance(abstract_logical["cache"]["cached_key"], nn.LogicallyPartitioned)


@pytest.mark.parametrize("seq_axis, create", [(0, "init"), (1, "apply")])
def test_prompt_then_tokens_equal_full_causal_attention(rand, seq_axis, create):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = rand(10, BATCH, D)  # [seq, batch, d]
    blank = rand(MAX, BATCH, D)  # sizes the cache: max_length MAX
    if seq_axis == 1:
        x, blank = jnp.swapaxes(x, 0, 1), jnp.swapaxes(blank, 0, 1)
    take = lambda a, s: a[s] if seq_axis == 0 else a[:, s]  # noqa: E731
    attn = attention(seq_axis=seq_axis)
    with jax.set_mesh(mesh):
        params = attn.init(jax.random.key(0), x)["params"]
        full = attn.apply({"params": params}, x, is_causal=True)
        if create == "init":  # flax's convention: the same params, and the cache
            variables = attn.init(jax.random.key(0), blank, decode=True)
            assert jax.tree.all(jax.tree.map(jnp.array_equal, variables["params"], params))
        else:
            y0, cache = attn.apply({"params": params}, blank, decode=True, mutable=["cache"])
            variables = updated({"params": params}, cache)
            # the creating call attends causally from position 0, and keeps the cache empty
            reference = attn.apply({"params": params}, blank, is_causal=True)
            assert rel_err(y0, reference) < 1e-5
        assert int(variables["cache"]["cache_index"]) == 0
        assert not jnp.any(variables["cache"]["cached_key"].value)
        step = jax.jit(lambda v, x: attn.apply(v, x, decode=True, mutable=["cache"]))
        y, cache = step(variables, take(x, slice(0, 6)))  # the prompt, 6 tokens
        pieces = [y]
        for i in range(6, 10):
            y, cache = step(updated(variables, cache), take(x, slice(i, i + 1)))
            pieces.append(y)
    got = jnp.concatenate(pieces, axis=seq_axis)
    assert int(cache["cache"]["cache_index"]) == 10
    key = cache["cache"]["cached_key"].value
    # heads split over tp; the batch whole or split over dp, as XLA propagates it
    assert any(
        key.sharding.is_equivalent_to(NamedSharding(mesh, P(b, None, "tp")), 4)
        for b in (None, "dp")
    ), key.sharding
    assert bool(jnp.any(key[:, 9])) and not jnp.any(key[:, 10:])  # written up to 10
    assert rel_err(got, full) < 1e-5


class TinyLM(nn.Module):
    vocab: int
    impl: str

    @nn.compact
    def __call__(self, tokens, decode=False):
        x = nn.Embed(self.vocab, D)(tokens)  # [batch, t, d]
        attn = attention(self.impl, seq_axis=1)
        x = x + attn(x, is_causal=not decode, decode=decode)
        x = x + ubl.ParallelGatedMLP(64, impl=self.impl, seq_axis=1)(x)
        return nn.Dense(self.vocab)(x)


def greedy(model, variables, prompt, steps, cached):
    """The prompt and ``steps`` greedy tokens, and the last step's logits: from the cache,
    or recomputed over the whole sequence (zero-padded to MAX: causal, so the padding
    changes nothing before it, and one compilation serves every length)."""
    step = jax.jit(lambda v, t: model.apply(v, t, decode=True, mutable=["cache"]))
    recompute = jax.jit(lambda v, t: model.apply({"params": v["params"]}, t))
    tokens = prompt
    if cached:
        logits, cache = step(variables, prompt)
    for _ in range(steps + 1):
        if not cached:
            padded = jnp.pad(tokens, ((0, 0), (0, MAX - tokens.shape[1])))
            logits = recompute(variables, padded)[:, : tokens.shape[1]]
        if tokens.shape[1] == prompt.shape[1] + steps:
            return np.asarray(tokens), logits[:, -1]
        nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None]
        tokens = jnp.concatenate([tokens, nxt], axis=1)
        if cached:
            logits, cache = step(updated(variables, cache), nxt)


@pytest.mark.slow  # a whole model: the slow tier (conftest.py)
def test_tiny_lm_greedy_decoding():
    mesh = make_mesh((2, "dp"), (2, "tp"))
    prompt = jax.random.randint(jax.random.key(3), (BATCH, 5), 0, 64)
    blank = jnp.zeros((BATCH, MAX), jnp.int32)  # sizes the cache: max_length MAX
    out = {}
    with jax.set_mesh(mesh):
        prompt = jax.device_put(prompt, NamedSharding(mesh, P("dp")))
        # The params and the empty cache, for both impls (they differ in the ops only).
        init = jax.jit(functools.partial(TinyLM(64, "ub").init, decode=True))
        variables = init(jax.random.key(0), blank)
        for impl in ("ub", "xla"):
            for cached in (True, False):
                out[impl, cached] = greedy(TinyLM(64, impl), variables, prompt, 6, cached)
    reference, logits = out["xla", False]
    assert reference.shape == (BATCH, 11)
    assert len(np.unique(reference[:, 5:])) > 1  # the model does not repeat one token
    for key, (tokens, last) in out.items():
        np.testing.assert_array_equal(tokens, reference, err_msg=str(key))
        assert rel_err(last, logits) < 1e-5, key


def test_misuse_is_named(rand):
    mesh = make_mesh((2, "tp"))
    attn = attention()
    with jax.set_mesh(mesh):
        variables = attn.init(jax.random.key(0), rand(4, BATCH, D), decode=True)
        params = {"params": variables["params"]}
        with pytest.raises(ValueError, match=r"needs the cache: create it with model.init"):
            attn.apply(params, rand(1, BATCH, D), decode=True)
        with pytest.raises(ValueError, match=r"call apply with mutable=\['cache'\]"):
            attn.apply(variables, rand(1, BATCH, D), decode=True)
        apply = lambda v, x, **kw: attn.apply(v, x, decode=True, mutable=["cache"], **kw)  # noqa: E731
        with pytest.raises(
            ValueError, match=r"with the cache's batch 4; got input shape \(1, 3, 32\)"
        ):
            apply(variables, rand(1, 3, D))
        with pytest.raises(ValueError, match="attends causally over the cache; pass no mask"):
            apply(variables, rand(1, BATCH, D), mask=jnp.ones((1, 1), bool))
        with pytest.raises(
            ValueError, match="5 new tokens at position 0 overflow the cache of max_length 4"
        ):
            apply(variables, rand(5, BATCH, D))
        cache = {"cache": variables["cache"] | {"cache_index": jnp.array(3, jnp.int32)}}
        y, _ = jax.jit(apply)(updated(variables, cache), rand(2, BATCH, D))  # positions 3, 4 of 4
    assert bool(jnp.all(jnp.isnan(y)))
