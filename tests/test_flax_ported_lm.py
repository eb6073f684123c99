"""Acceptance test: porting a public-style Flax linen LM to jax_ub.

The reference is a decoder-only LM written as flax's lm1b example writes one: batch-first
``[batch, length]`` tokens, ``nn.Embed`` plus fixed sinusoidal position embeddings (with
lm1b's decode-time ``cache_index``), blocks of LayerNorm -> ``nn.MultiHeadDotProductAttention``
(causal mask; ``decode=True`` with its own cache) -> dropout -> residual -> LayerNorm -> an
MLP of two ``nn.Dense`` with gelu and dropout -> dropout -> residual, params named with
logical axes (``nn.with_logical_partitioning``) and placed by lm1b-like
``nn.logical_axis_rules`` on a ("data", "tensor") mesh. The PORTED model is the same code
with only the attention and the MLP swapped for ``jax_ub.flax.linen.ParallelSelfAttention``
and ``ParallelMLP`` (``seq_axis=1``, ``impl="ub"``, ``kernel_axes`` whose split dim the
rules map to "tensor"); its params are the reference's, converted with
``jax_ub.flax.checkpoints``. The models run in jitted steps with in/out shardings from the
rules under ``jax.set_mesh(mesh)`` (no ``jax_ub.flax.defaults``).

Checked, f32: loss and gradients equal (dropout off) at lengths tp divides and does not;
five SGD steps give the same loss curve (dropout off) and run with dropout on; greedy
decoding with each model's own cache gives the same tokens; bf16 computation gives the same
logits within bf16 tolerance and trains; the ported step holds jax_ub's custom calls.

The models are in ``_ported_lm_model.py``. The helpers take a :class:`Setup` (mesh,
tolerances, matmul precision) so that ``test_gpu_ported_lm.py`` runs the same checks on
GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ported_lm_model import (
    BATCH,
    HEADS,
    LAYERS,
    LR,
    NEW_TOKENS,
    PROMPT,
    RULES,
    STEPS,
    VOCAB,
    Config,
    DecoderLM,
)
from conftest import cpu_devices, rel_err
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import keystr

from jax_ub.flax import checkpoints as ck

CUSTOM_CALL = re.compile(r"custom_call @(jax_ub_\w+)")
COMPILED_CALL = re.compile(r'custom_call_target="(jax_ub_\w+)"')


# --- setup, params and steps -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and how tightly the checks run."""

    mesh: Mesh
    tol: float = 1e-5  # f32 relative error
    bf16_tol: float = 2e-2
    precision: str | None = None  # jax.default_matmul_precision
    # False: lm1b's loop as it is, no jax.set_mesh; the layers find the mesh in the params'
    # and batches' shardings.
    set_mesh: bool = True

    @contextlib.contextmanager
    def context(self):
        with contextlib.ExitStack() as stack:
            if self.set_mesh:
                stack.enter_context(jax.set_mesh(self.mesh))
            stack.enter_context(nn.logical_axis_rules(RULES))
            if self.precision is not None:
                stack.enter_context(jax.default_matmul_precision(self.precision))
            yield

    def sharding(self, *logical_names):
        return nn.logical_to_mesh_sharding(P(*logical_names), self.mesh, RULES)


def cpu_setup() -> Setup:
    devices = np.array(cpu_devices()[:4]).reshape(2, 2)
    return Setup(Mesh(devices, ("data", "tensor")))


def param_shardings(setup, cfg):
    """The rules' shardings of ``DecoderLM(cfg)``'s params (from an abstract init)."""
    model = DecoderLM(cfg)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((BATCH, 8), jnp.int32))
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract["params"]), setup.mesh, RULES)


def to_ported(params):
    """The reference's params -> the ported model's, through jax_ub.flax.checkpoints."""
    params = dict(params)
    for i in range(LAYERS):
        block = dict(params[f"block_{i}"])
        block["attn"] = ck.from_flax_attention(block["attn"])
        block["mlp"] = ck.from_flax_mlp(block["mlp"])
        params[f"block_{i}"] = block
    return params


def to_reference(params):
    """Inverse of :func:`to_ported` (for gradients)."""
    params = dict(params)
    for i in range(LAYERS):
        block = dict(params[f"block_{i}"])
        block["attn"] = ck.to_flax_attention(block["attn"], num_heads=HEADS)
        block["mlp"] = ck.to_flax_mlp(block["mlp"])
        params[f"block_{i}"] = block
    return params


def initial_params(setup):
    """``{False: reference params, True: ported params}``, unboxed, placed by the rules;
    every leaf perturbed (biases and LayerNorms start as zeros and ones)."""
    model = DecoderLM(Config())
    shardings = param_shardings(setup, Config())

    def init(key):
        k1, k2 = jax.random.split(key)
        params = nn.unbox(model.init(k1, jnp.ones((BATCH, 8), jnp.int32))["params"])
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(k2, len(leaves))
        noise = [0.1 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
        return jax.tree.unflatten(tree, [a + n for a, n in zip(leaves, noise)])

    reference = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    ported = to_ported(reference)
    ported_shardings = param_shardings(setup, Config(ported=True))
    shapes = lambda t: jax.tree.map(jnp.shape, t)  # noqa: E731
    assert jax.tree.structure(ported) == jax.tree.structure(ported_shardings)
    ported = jax.device_put(ported, ported_shardings)
    assert shapes(to_reference(ported)) == shapes(reference)
    # The rules split the heads and the MLP's hidden dim over "tensor" in both layouts.
    split = {
        (False, "attn", "query", "kernel"): P(None, "tensor"),  # [embed, heads, kv]
        (False, "attn", "out", "kernel"): P("tensor"),  # [heads, kv, embed]
        (False, "mlp", "Dense_0", "kernel"): P(None, "tensor"),
        (False, "mlp", "Dense_1", "kernel"): P("tensor"),
        (True, "attn", "qkv", "kernel"): P(None, "tensor"),  # [embed, heads * 3 * kv]
        (True, "attn", "qkv", "bias"): P("tensor"),
        (True, "attn", "out", "kernel"): P("tensor"),  # [heads * kv, embed]
        (True, "mlp", "up_proj", "kernel"): P(None, "tensor"),
        (True, "mlp", "down_proj", "kernel"): P("tensor"),
    }
    params = {False: reference, True: ported}
    for (which, block, layer, name), spec in split.items():
        leaf = params[which]["block_0"][block][layer][name]
        want = NamedSharding(setup.mesh, spec)
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (which, layer, leaf.sharding)
    return params


def make_batches(length, steps=STEPS):
    """Arithmetic sequences mod VOCAB (learnable): ``[steps, BATCH, length + 1]``."""
    rng = np.random.default_rng(length)
    start = rng.integers(0, VOCAB, (steps, BATCH, 1))
    stride = rng.integers(1, 4, (steps, BATCH, 1))
    return ((start + stride * np.arange(length + 1)) % VOCAB).astype(np.int32)


def make_step(setup, cfg, train):
    """lm1b's jitted train step (optax SGD), in/out shardings from the rules:
    ``(params, opt_state, batch, key) -> (params, opt_state, loss, grads)``."""
    model, tx = DecoderLM(cfg), optax.sgd(LR)
    ps = param_shardings(setup, cfg)
    opt = jax.tree.map(lambda _: setup.sharding(), tx.init(ps))  # SGD: no leaves
    replicated, data = setup.sharding(), setup.sharding("batch", "length")

    def step(params, opt_state, batch, key):
        def loss_fn(params):
            logits = model.apply(
                {"params": params}, batch[:, :-1], train=train, rngs={"dropout": key}
            )
            labels = batch[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), labels
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return jax.jit(
        step,
        in_shardings=(ps, opt, data, replicated),
        out_shardings=(ps, opt, replicated, ps),
    ), tx


def train(setup, params, cfg, batches, train_mode):
    """One step per batch from ``params``: (losses, step 0's grads, final params, the
    lowered step)."""
    step, tx = make_step(setup, cfg, train_mode)
    opt_state = tx.init(params)
    batches = jax.device_put(batches, setup.sharding(None, "batch", "length"))
    keys = jax.random.split(jax.random.key(1), len(batches))
    lowered = step.lower(params, opt_state, batches[0], keys[0])
    losses, first_grads = [], None
    # By index: a batch sharded over processes (the N-ranks mode's dp) cannot be iterated.
    for i, key in enumerate(keys):
        params, opt_state, loss, grads = step(params, opt_state, batches[i], key)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return np.array(losses), first_grads, params, lowered


def custom_calls(text) -> dict:
    """``{jax_ub custom call target: count}`` in StableHLO (``lowered.as_text()``) or in
    compiled HLO (``lowered.compile().as_text()``)."""
    counts: dict = {}
    for name in CUSTOM_CALL.findall(text) + COMPILED_CALL.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return counts


def assert_grads_close(ported, reference, tol):
    """Ported grads, converted back to the reference's layout, leaf by leaf."""
    ported = to_reference(ported)
    assert jax.tree.structure(ported) == jax.tree.structure(reference)
    paths = jax.tree_util.tree_flatten_with_path(reference)[0]
    errs = {}
    for (path, b), a in zip(paths, jax.tree.leaves(ported)):
        if keystr(path).endswith("['key']['bias']"):
            # Softmax ignores what is added to every key alike: zero up to rounding.
            scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(reference))
            assert max(np.abs(np.asarray(x)).max() for x in (a, b)) < tol * scale
            continue
        errs[keystr(path)] = rel_err(a, b)
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, (worst, errs[worst])
    return errs[worst]


def greedy(setup, params, cfg, prompt):
    """``prompt`` and ``NEW_TOKENS`` greedy tokens, decoded one token at a time with the
    model's own cache (flax's attention takes one token per decode call): the tokens and
    the logits of every step."""
    model = DecoderLM(dataclasses.replace(cfg, decode=True, dropout_rate=0.0))
    blank = jnp.ones((BATCH, PROMPT + NEW_TOKENS), jnp.int32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), blank)
    cache_sharding = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(abstract["cache"]), setup.mesh, RULES
    )
    cache = jax.jit(
        lambda: nn.unbox(model.init(jax.random.key(0), blank)["cache"]),
        out_shardings=cache_sharding,
    )()

    @jax.jit
    def step(params, cache, token):
        logits, mutated = model.apply({"params": params, "cache": cache}, token, mutable=["cache"])
        return logits[:, -1], mutated["cache"]

    tokens, all_logits = prompt, []
    for i in range(PROMPT - 1):  # prefill, token by token
        _, cache = step(params, cache, prompt[:, i : i + 1])
    token = prompt[:, -1:]
    for _ in range(NEW_TOKENS):
        logits, cache = step(params, cache, token)
        all_logits.append(logits)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        tokens = jnp.concatenate([tokens, token], axis=1)
    return np.asarray(tokens), np.stack([np.asarray(lg) for lg in all_logits])


# --- the checks (shared with the GPU variant) ----------------------------------------------


def check_loss_and_grads(setup, params, length):
    """(1) Dropout off: the same loss and gradients at ``length``."""
    batches = make_batches(length, steps=1)
    out = {}
    with setup.context():
        for ported in (False, True):
            out[ported] = train(setup, params[ported], Config(ported=ported), batches, False)
    loss_err = abs(out[True][0][0] - out[False][0][0]) / abs(out[False][0][0])
    assert loss_err < setup.tol, (out[True][0], out[False][0])
    grad_err = assert_grads_close(out[True][1], out[False][1], setup.tol)
    return dict(loss=out[False][0][0], loss_err=loss_err, grad_err=grad_err, lowered=out[True][3])


def check_training(setup, params, length=16):
    """(2) ``STEPS`` SGD steps: dropout off, the same loss curve; dropout on, both run and
    the ported loss decreases. Returns the losses, the dropout-off final reference params
    and both dropout-off steps, lowered."""
    batches = make_batches(length)
    batches = np.broadcast_to(batches[:1], batches.shape)  # one batch, fitted
    with setup.context():
        off = {p: train(setup, params[p], Config(ported=p), batches, False) for p in (False, True)}
        on = {p: train(setup, params[p], Config(ported=p), batches, True) for p in (False, True)}
    curve_err = float(np.max(np.abs(off[True][0] - off[False][0]) / off[False][0]))
    assert curve_err < setup.tol, (off[True][0], off[False][0])
    assert np.all(np.diff(off[True][0]) < 0), off[True][0]
    for p in (False, True):
        assert np.all(np.isfinite(on[p][0])), (p, on[p][0])
    assert on[True][0][-1] < on[True][0][0], on[True][0]
    return dict(
        off=off[True][0],
        ref_off=off[False][0],
        on=on[True][0],
        ref_on=on[False][0],
        curve_err=curve_err,
        trained=off[False][2],
        lowered=off[True][3],
        ref_lowered=off[False][3],
    )


def check_decode(setup, reference_params):
    """(3) Greedy decoding from the same (converted) params: the same tokens."""
    params = {False: reference_params, True: None}
    prompt = make_batches(PROMPT - 1, steps=1)[0]
    with setup.context():
        params[True] = jax.device_put(
            to_ported(reference_params), param_shardings(setup, Config(ported=True))
        )
        prompt = jax.device_put(prompt, setup.sharding("batch", "length"))
        out = {p: greedy(setup, params[p], Config(ported=p), prompt) for p in (False, True)}
    tokens, logits = out[False]
    assert tokens.shape == (BATCH, PROMPT + NEW_TOKENS)
    np.testing.assert_array_equal(out[True][0], tokens)
    logit_err = rel_err(out[True][1], logits)
    assert logit_err < setup.tol, logit_err
    return dict(tokens=tokens, logit_err=logit_err)


def check_bf16(setup, params, length=16):
    """(4) bf16 computation, f32 params: the same logits within bf16 tolerance, and a bf16
    training step (dropout on) of each model runs, finite."""
    batches = make_batches(length, steps=1)
    logits = {}
    with setup.context():
        for ported in (False, True):
            cfg = Config(ported=ported, dtype=jnp.bfloat16)
            model = DecoderLM(cfg)
            tokens = jax.device_put(batches[0, :, :-1], setup.sharding("batch", "length"))
            forward = jax.jit(
                lambda p, t, model=model: model.apply({"params": p}, t),
                in_shardings=(param_shardings(setup, cfg), setup.sharding("batch", "length")),
            )
            logits[ported] = forward(params[ported], tokens)
            assert logits[ported].dtype == jnp.bfloat16
        err = rel_err(logits[True], logits[False])
        assert err < setup.bf16_tol, err
        losses = {}
        for ported in (False, True):
            cfg = Config(ported=ported, dtype=jnp.bfloat16)
            losses[ported], grads, _, _ = train(setup, params[ported], cfg, batches, True)
            assert np.all(np.isfinite(losses[ported])), losses[ported]
            assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    return dict(logit_err=err, losses=losses)


def check_custom_calls(lowered, reference_lowered=None):
    """(5) jax_ub's overlapped GEMMs are in the ported step (tp dividing the sequence).
    The StableHLO holds at least the forward ones of each layer, all-gather matmuls (qkv,
    up) and matmul reduce-scatters (out, down) (it emits identical bodies once, so the
    backward's may share them); the compiled step runs forward and backward ones, 4 of
    each per layer (backward: the data gradients of out, down and of qkv, up)."""
    counts = custom_calls(lowered.as_text())
    assert counts.get("jax_ub_all_gather_matmul", 0) >= 2 * LAYERS, counts
    assert counts.get("jax_ub_matmul_reduce_scatter", 0) >= 2 * LAYERS, counts
    compiled = custom_calls(lowered.compile().as_text())
    want = {"jax_ub_all_gather_matmul": 4 * LAYERS, "jax_ub_matmul_reduce_scatter": 4 * LAYERS}
    assert compiled == want, compiled
    if reference_lowered is not None:
        assert not custom_calls(reference_lowered.as_text()), "the reference runs no jax_ub op"
    return counts, compiled


# --- CPU tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    return cpu_setup()


@pytest.fixture(scope="module")
def params(setup):
    with setup.context():
        return initial_params(setup)


@pytest.fixture(scope="module")
def trained(setup, params):
    return check_training(setup, params)


@pytest.mark.parametrize("length", [16, 15])
def test_loss_and_grads_equal(setup, params, length):
    r = check_loss_and_grads(setup, params, length)
    errs = f"rel err {r['loss_err']:.1e}, grads (worst leaf) {r['grad_err']:.1e}"
    print(f"length {length}: loss {r['loss']:.6f}, {errs}")


# Its init runs before the params exist, with no mesh: the one no-mesh warning says so.
@pytest.mark.filterwarnings("ignore:jax_ub.flax. a layer was traced with no mesh set")
@pytest.mark.parametrize("length", [16, 15])
def test_unchanged_loop_without_set_mesh(setup, params, length):
    """lm1b's own jit with in/out shardings and no jax.set_mesh: the same loss and
    gradients, and jax_ub's calls in the ported step where tp divides the sequence."""
    loop = dataclasses.replace(setup, set_mesh=False)
    r = check_loss_and_grads(loop, params, length)
    if length == 16:
        with setup.context():
            check_custom_calls(r["lowered"])


def test_training_curves(trained):
    print("dropout off, ported / reference:", trained["off"], trained["ref_off"])
    print("dropout on, ported / reference:", trained["on"], trained["ref_on"])


def test_custom_calls_in_ported_step(setup, trained):
    with setup.context():
        counts, compiled = check_custom_calls(trained["lowered"], trained["ref_lowered"])
    print("jax_ub custom calls, StableHLO:", counts, "compiled:", compiled)


def test_greedy_decode_token_equal(setup, trained):
    r = check_decode(setup, trained["trained"])
    print("tokens:", r["tokens"].tolist(), f"logits rel err {r['logit_err']:.1e}")


def test_bf16(setup, params):
    r = check_bf16(setup, params)
    print(f"bf16 logits rel err {r['logit_err']:.1e}, step losses {r['losses']}")
