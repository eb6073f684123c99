"""Acceptance test: a small decoder-only LM written as public Flax linen examples (lm1b,
wmt) write one, with jax_ub's ParallelSelfAttention and ParallelMLP as its blocks.

Params are named with logical axes and placed by the user's ``nn.logical_axis_rules`` on a
("data", "model") mesh (no axis named "tp"); ``impl``, the mesh and the batch-major layout
are set once for the whole model with ``jax_ub.flax.defaults``; no ``jax.set_mesh``. It
trains with optax AdamW in a jitted step with in/out shardings (dropout on), then decodes
greedily with the key/value cache (dropout off). impl="ub" and impl="xla" agree on losses,
gradients and tokens; the cache agrees with recomputing the prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import rel_err
from flax import linen as nn
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import keystr

import jax_ub.flax as ubf

VOCAB, D, HEADS, FFN, LAYERS, SEQ, BATCH, MAX = 64, 32, 4, 64, 2, 16, 4, 16
PROMPT, STEPS, RATE = 4, 20, 0.1
RULES = (
    ("batch", "data"),
    ("length", None),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
)
logical = nn.with_logical_partitioning


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic, decode):
        norm = dict(scale_init=logical(nn.initializers.ones, ("embed",)))
        h = nn.RMSNorm(**norm)(x)
        h = ubf.linen.ParallelSelfAttention(
            HEADS, rope_theta=1e4, kernel_axes=("embed", "heads"), dropout_rate=RATE
        )(h, is_causal=not decode, decode=decode, deterministic=deterministic)
        x = x + h
        h = ubf.linen.ParallelMLP(FFN, kernel_axes=("embed", "mlp"), dropout_rate=RATE)(
            nn.RMSNorm(**norm)(x), deterministic=deterministic
        )
        return x + h


class DecoderLM(nn.Module):
    """Token ids ``[batch, length]`` -> logits ``[batch, length, vocab]``."""

    @nn.compact
    def __call__(self, tokens, train=False, decode=False):
        init = nn.initializers.normal(1.0)
        x = nn.Embed(VOCAB, D, embedding_init=logical(init, ("vocab", "embed")))(tokens)
        x = nn.Dropout(RATE)(x, deterministic=not train)
        for i in range(LAYERS):
            x = DecoderBlock(name=f"block_{i}")(x, not train, decode)
        x = nn.RMSNorm(scale_init=logical(nn.initializers.ones, ("embed",)))(x)
        kernel = logical(nn.initializers.lecun_normal(), ("embed", "vocab"))
        bias = logical(nn.initializers.zeros_init(), ("vocab",))
        return nn.Dense(VOCAB, kernel_init=kernel, bias_init=bias, name="lm_head")(x)


def make_mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def settings(mesh, impl):
    """Everything a user sets once for the model: rules, and jax_ub's model defaults."""
    rules = nn.logical_axis_rules(RULES)
    return rules, ubf.defaults(impl=impl, mesh=mesh, seq_axis=1)


def make_batches():
    """Arithmetic sequences mod VOCAB (learnable): [STEPS, BATCH, SEQ + 1]."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, (STEPS, BATCH, 1))
    stride = rng.integers(1, 4, (STEPS, BATCH, 1))
    return ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def train(mesh, impl, batches):
    """lm1b's recipe: abstract init -> logical specs -> mesh shardings -> jitted init and
    step. Returns the final state, its shardings, the losses, step 0's grads and the
    step's StableHLO."""
    model = DecoderLM()
    tx = optax.adamw(1e-2, weight_decay=0.01)
    rules, defaults = settings(mesh, impl)
    with rules, defaults:

        def init_state(key):
            variables = model.init(key, jnp.ones((BATCH, SEQ), jnp.int32))
            return train_state.TrainState.create(
                apply_fn=model.apply, params=variables["params"], tx=tx
            )

        abstract = jax.eval_shape(init_state, jax.random.key(0))
        state_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        state = jax.jit(init_state, out_shardings=state_sharding)(jax.random.key(0))
        data = nn.logical_to_mesh_sharding(P("batch", "length"), mesh, RULES)
        replicated = NamedSharding(mesh, P())

        def train_step(state, batch, key):
            def loss_fn(params):
                logits = state.apply_fn(
                    {"params": params}, batch[:, :-1], train=True, rngs={"dropout": key}
                )
                labels = batch[:, 1:]
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss, grads

        step = jax.jit(
            train_step,
            in_shardings=(state_sharding, data, replicated),
            out_shardings=(state_sharding, replicated, state_sharding.params),
            donate_argnums=0,
        )
        batches = jax.device_put(batches, NamedSharding(mesh, P(None, "data")))
        keys = jax.random.split(jax.random.key(1), STEPS)
        hlo = step.lower(state, batches[0], keys[0]).as_text()
        losses, first_grads = [], None
        for i in range(STEPS):
            state, loss, grads = step(state, batches[i], keys[i])
            losses.append(float(loss))
            first_grads = grads if first_grads is None else first_grads
    return dict(
        state=state, shardings=state_sharding, losses=np.array(losses), grads=first_grads, hlo=hlo
    )


def greedy(mesh, impl, params, prompt, cached):
    """The prompt and MAX - PROMPT greedy tokens: with the cache (prompt prefilled at
    once, then one token per step) or recomputing the whole prefix each step (zero-padded
    to MAX: causal, so the padding changes nothing before it; one program for every step),
    and the logits that chose the last token."""
    model = DecoderLM()
    rules, defaults = settings(mesh, impl)
    with rules, defaults:
        if cached:
            blank = jnp.ones((BATCH, MAX), jnp.int32)
            abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), blank, decode=True))
            spec = nn.get_partition_spec(abstract)["cache"]
            cache_sharding = nn.logical_to_mesh_sharding(spec, mesh, RULES)
            init_cache = lambda: model.init(jax.random.key(0), blank, decode=True)["cache"]  # noqa: E731
            cache = jax.jit(init_cache, out_shardings=cache_sharding)()

            @jax.jit
            def step(params, cache, tokens):
                logits, mutated = model.apply(
                    {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
                )
                return logits[:, -1], mutated["cache"]

            logits, cache = step(params, cache, prompt)
            out, steps = [prompt], MAX - prompt.shape[1]
            for i in range(steps):
                out.append(jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])
                if i + 1 < steps:  # the logits after the last token choose nothing
                    logits, cache = step(params, cache, out[-1])
            return np.asarray(jnp.concatenate(out, axis=1)), np.asarray(logits)

        @jax.jit  # one program for every step: t is traced
        def choose(params, tokens, t):
            logits = jnp.take(model.apply({"params": params}, tokens), t - 1, axis=1)
            return tokens.at[:, t].set(jnp.argmax(logits, axis=-1).astype(jnp.int32)), logits

        tokens = jnp.pad(prompt, ((0, 0), (0, MAX - prompt.shape[1])))
        for t in range(prompt.shape[1], MAX):
            tokens, logits = choose(params, tokens, jnp.int32(t))
    return np.asarray(tokens), np.asarray(logits)


def test_public_style_lm_trains_and_decodes_alike_with_ub_and_xla():
    mesh = make_mesh()
    batches = make_batches()
    run = {impl: train(mesh, impl, batches) for impl in ("ub", "xla")}

    # The ub step runs jax_ub's overlapped ops; the xla one does not.
    assert "jax_ub_all_gather_matmul" in run["ub"]["hlo"]
    assert "jax_ub_all_gather_matmul" not in run["xla"]["hlo"]

    # (1) Same init, same rngs and dropout masks: the same losses; and the model learns.
    losses = {impl: r["losses"] for impl, r in run.items()}
    np.testing.assert_allclose(losses["ub"], losses["xla"], rtol=1e-5)
    assert losses["ub"][-5:].mean() < 0.7 * losses["ub"][:5].mean(), losses["ub"]

    # (4) Gradients at step 0 agree leaf by leaf.
    g_ub, g_xla = (nn.unbox(run[impl]["grads"]) for impl in ("ub", "xla"))
    paths = jax.tree_util.tree_flatten_with_path(g_ub)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(g_xla)):
        assert rel_err(a, b) < 1e-5, keystr(path)

    # (2) Every param is logically named (a raw array would be silently replicated) and
    # placed as the rules say: split exactly where a rule maps one of its names to an axis.
    state, shardings = run["ub"]["state"], run["ub"]["shardings"]
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731
    boxes = jax.tree_util.tree_flatten_with_path(state.params, is_leaf=is_box)[0]
    unnamed = [keystr(k) for k, b in boxes if not isinstance(b, nn.LogicallyPartitioned)]
    assert not unnamed, unnamed
    want = jax.tree.leaves(shardings.params, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, box), sharding in zip(boxes, want, strict=True):
        leaf = box.value
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), keystr(path)
        split = any(dict(RULES)[name] for name in box.names if name is not None)
        assert split == (not leaf.sharding.is_fully_replicated), keystr(path)
    p = nn.unbox(state.params)
    block = p["block_0"]
    expect = {
        "mlp up": (block["ParallelMLP_0"]["up_proj"]["kernel"], P(None, "model")),
        "mlp down": (block["ParallelMLP_0"]["down_proj"]["kernel"], P("model", None)),
        "qkv": (block["ParallelSelfAttention_0"]["qkv"]["kernel"], P(None, "model")),
        "qkv bias": (block["ParallelSelfAttention_0"]["qkv"]["bias"], P("model")),
        "attn out": (block["ParallelSelfAttention_0"]["out"]["kernel"], P("model", None)),
        "embed": (p["Embed_0"]["embedding"], P("model", None)),
        "lm_head": (p["lm_head"]["kernel"], P(None, "model")),
    }
    for name, (leaf, spec) in expect.items():
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), name
        dim = spec.index("model")
        assert leaf.addressable_shards[0].data.shape[dim] * 2 == leaf.shape[dim], name

    # (3) Greedy decoding after training: the same tokens with ub and xla, and with the
    # cache as recomputing the prefix; the cached steps' logits agree too.
    prompt = jax.device_put(batches[-1][:, :PROMPT], NamedSharding(mesh, P("data")))
    params = nn.unbox(state.params)
    out = {(i, c): greedy(mesh, i, params, prompt, c) for i in ("ub", "xla") for c in (1, 0)}
    tokens, logits = out["xla", 0]
    assert tokens.shape == (BATCH, MAX) and len(np.unique(tokens[:, PROMPT:])) > 1
    for key, (t, lg) in out.items():
        np.testing.assert_array_equal(t, tokens, err_msg=str(key))
        assert rel_err(lg, logits) < 1e-5, key
