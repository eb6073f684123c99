"""Grouped-query attention with rotary embeddings in ParallelSelfAttention (nnx, linen), on
CPU devices: against attention written out from the unsharded params (explicit softmax,
key/value heads repeated, rotary embeddings as complex rotations), forward and gradients;
the checkpoint mapping from separate q/k/v kernels; bad head counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx

import jax_ub.flax as ubf

SEQ, BATCH, D = 16, 2, 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
THETA = 10000.0


def rope_reference(x, theta):
    """x [seq, ..., head_dim]: pairs (x[i], x[i + d/2]) as complex numbers, rotated."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    freqs = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    angles = np.arange(x.shape[0])[:, None] * freqs[None, :]
    z = z * np.exp(1j * angles).reshape(x.shape[0], *([1] * (x.ndim - 2)), half)
    return np.concatenate([z.real, z.imag], axis=-1)


def split_qkv(kernel, bias, kv_heads=KV_HEADS):
    """The fused kernel [D, g * (r + 2) * hd] as separate q [D, H, hd], k, v [D, g, hd]."""
    g, r = kv_heads, HEADS // kv_heads
    w = kernel.reshape(D, g, r + 2, HEAD_DIM)
    b = bias.reshape(g, r + 2, HEAD_DIM)
    q = (w[:, :, :r].reshape(D, HEADS, HEAD_DIM), b[:, :r].reshape(HEADS, HEAD_DIM))
    return q, (w[:, :, r], b[:, r]), (w[:, :, r + 1], b[:, r + 1])


def attention_reference(x, q, k, v, out_kernel, out_bias, theta=THETA, causal=True):
    """x [seq, batch, D]; q, k, v: (kernel [D, heads, hd], bias [heads, hd])."""
    x = np.asarray(x, np.float64)
    proj = [np.einsum("sbd,dhe->sbhe", x, np.asarray(w, np.float64)) + b for w, b in (q, k, v)]
    qs, ks, vs = proj
    if theta is not None:
        qs, ks = rope_reference(qs, theta), rope_reference(ks, theta)
    ks, vs = (np.repeat(a, HEADS // a.shape[2], axis=2) for a in (ks, vs))  # head h -> h // r
    logits = np.einsum("sbhe,tbhe->bhst", qs, ks) / np.sqrt(HEAD_DIM)
    if causal:
        logits = np.where(np.tril(np.ones((SEQ, SEQ), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhst,tbhe->sbhe", p, vs).reshape(SEQ, BATCH, HEADS * HEAD_DIM)
    return o @ np.asarray(out_kernel, np.float64) + np.asarray(out_bias)


def nnx_block(mesh, **kw):
    return ubf.ParallelSelfAttention(
        D,
        HEADS,
        num_kv_heads=KV_HEADS,
        rope_theta=THETA,
        impl="ub",
        mesh=mesh,
        rngs=nnx.Rngs(0),
        **kw,
    )


def block_params(block):
    qkv = (np.asarray(block.qkv.kernel[...]), np.asarray(block.qkv.bias[...]))
    out = (np.asarray(block.out.kernel[...]), np.asarray(block.out.bias[...]))
    return qkv, out


@pytest.mark.parametrize("tp", [1, 2])
def test_nnx_forward_matches_reference(rand, tp):
    mesh = make_mesh((tp, "tp"))
    block = nnx_block(mesh)
    x = rand(SEQ, BATCH, D)
    y = nnx.jit(lambda m, x: m(x, is_causal=True))(block, x)
    (qkv_k, qkv_b), (out_k, out_b) = block_params(block)
    want = attention_reference(x, *split_qkv(qkv_k, qkv_b), out_k, out_b)
    assert rel_err(y, want) < 1e-5


def test_gradients_match_xla_impl(rand):
    """The same block with impl="xla" (lax collectives), whose forward the reference
    test pins down: every param's and the input's gradient."""
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    grads = {}
    for impl in ("ub", "xla"):
        block = nnx_block(mesh)
        block.qkv.impl = block.out.impl = impl

        def loss(m, x):
            return jnp.sum(jnp.sin(m(x, is_causal=True)))

        grads[impl] = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(block, x)
    leaves = [jax.tree.leaves(nnx.to_pure_dict(g[0])) + [g[1]] for g in grads.values()]
    for g, r in zip(*leaves):
        assert rel_err(g, r) < 1e-5


def test_checkpoint_of_separate_projections_loads(rand):
    """q_proj, k_proj, v_proj and o_proj of an unsharded model, mapped as the docstring
    says, give that model's attention."""
    mesh = make_mesh((2, "tp"))
    block = nnx_block(mesh, use_bias=False)
    q_proj = rand(D, HEADS * HEAD_DIM, scale=0.3)
    k_proj, v_proj = rand(D, KV_HEADS * HEAD_DIM, scale=0.3), rand(D, KV_HEADS * HEAD_DIM)
    o_proj = rand(HEADS * HEAD_DIM, D, scale=0.3)
    g, r = KV_HEADS, HEADS // KV_HEADS
    q = q_proj.reshape(D, g, r, HEAD_DIM)
    k, v = (p.reshape(D, g, 1, HEAD_DIM) for p in (k_proj, v_proj))
    block.qkv.kernel[...] = jnp.concatenate([q, k, v], axis=2).reshape(D, -1)
    block.out.kernel[...] = o_proj
    x = rand(SEQ, BATCH, D)
    y = nnx.jit(lambda m, x: m(x, is_causal=True))(block, x)
    zeros = lambda h: np.zeros((h, HEAD_DIM))  # noqa: E731
    want = attention_reference(
        x,
        (q_proj.reshape(D, HEADS, HEAD_DIM), zeros(HEADS)),
        (k_proj.reshape(D, KV_HEADS, HEAD_DIM), zeros(KV_HEADS)),
        (v_proj.reshape(D, KV_HEADS, HEAD_DIM), zeros(KV_HEADS)),
        o_proj,
        np.zeros(D),
    )
    assert rel_err(y, want) < 1e-5


def test_linen_matches_reference(rand):
    mesh = make_mesh((2, "tp"))
    block = ubf.linen.ParallelSelfAttention(
        num_heads=HEADS, num_kv_heads=KV_HEADS, rope_theta=THETA, impl="ub", mesh=mesh
    )
    x = rand(SEQ, BATCH, D)
    variables = block.init(jax.random.key(0), x, None, True)
    y = jax.jit(lambda v, x: block.apply(v, x, None, True))(variables, x)
    p = nn.unbox(variables)["params"]
    want = attention_reference(
        x, *split_qkv(p["qkv"]["kernel"], p["qkv"]["bias"]), p["out"]["kernel"], p["out"]["bias"]
    )
    assert rel_err(y, want) < 1e-5


def test_multi_head_layout_unchanged(rand):
    """num_kv_heads = num_heads (the default) keeps the (head, q/k/v, head_dim) layout: the
    block equals attention whose fused kernel is read that way."""
    mesh = make_mesh((2, "tp"))
    mha = ubf.ParallelSelfAttention(
        D,
        HEADS,
        rope_theta=THETA,
        mesh=mesh,
        bias_init=nnx.initializers.normal(0.5),
        rngs=nnx.Rngs(0),
    )
    assert mha.qkv.kernel.shape == (D, 3 * D)
    x = rand(SEQ, BATCH, D)
    qkv = split_qkv(mha.qkv.kernel[...], mha.qkv.bias[...], kv_heads=HEADS)
    want = attention_reference(x, *qkv, mha.out.kernel[...], mha.out.bias[...])
    assert rel_err(mha(x, is_causal=True), want) < 1e-5


def test_bad_head_counts_are_named():
    mesh = make_mesh((4, "tp"))
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        ubf.ParallelSelfAttention(D, 4, num_kv_heads=3, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_heads=2 must be a positive multiple .* \\(4\\)"):
        ubf.ParallelSelfAttention(D, 4, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="even head size"):
        ubf.ParallelSelfAttention(
            12, 4, rope_theta=THETA, mesh=make_mesh((2, "tp")), rngs=nnx.Rngs(0)
        )


def test_float_masks_as_flax_makes_them(rand):
    """nn.make_causal_mask's float 0/1 mask, a boolean mask and is_causal agree."""
    mesh = make_mesh((2, "tp"))
    block = nnx_block(mesh)
    x = rand(SEQ, BATCH, D)
    float_mask = nn.make_causal_mask(jnp.ones((BATCH, SEQ)))  # [batch, 1, seq, seq] float32
    assert float_mask.dtype == jnp.float32
    ys = [
        block(x, float_mask),
        block(x, float_mask.astype(bool)),
        block(x, is_causal=True),
    ]
    assert rel_err(ys[0], ys[2]) < 1e-6 and rel_err(ys[1], ys[2]) < 1e-6
    with pytest.raises(ValueError, match="mask of dtype complex64"):
        block(x, float_mask.astype(jnp.complex64))
