"""jax_ub.flax.checkpoints: params of flax's attention and Dense MLPs and of Llama-style
checkpoints (separate q/k/v/o, gate/up/down) converted to jax_ub's fused blocks and back.
Round trips are bitwise; the converted blocks (nnx and linen, over tp=2 CPU devices) give
the outputs of flax's own modules or of plain-JAX Llama attention and SwiGLU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx

import jax_ub.flax as ubf
from jax_ub.flax import checkpoints as ck

TP = 2
B, S, D, F = 2, 8, 16, 32
H, G, HD = 4, 2, 4  # heads, key/value heads (Llama), head size: H * HD == D
THETA = 10000.0
TOL = 1e-5


def assert_trees_equal(a, b):
    """Same structure and bitwise-equal leaves (unboxed)."""
    a, b = nn.unbox(a), nn.unbox(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def randomized(tree, rand):
    """``tree`` (a pure dict) with every leaf random: biases are zeros at init."""
    return jax.tree.map(lambda a: rand(*a.shape), tree)


def nnx_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def run_nnx(model, *args, **kw):
    with jax.set_mesh(make_mesh((TP, "tp"))):
        return nnx.jit(lambda m, *a: m(*a, **kw))(model, *args)


def run_linen(module, params, *args, **kw):
    with jax.set_mesh(make_mesh((TP, "tp"))):
        return jax.jit(lambda p, *a: module.apply({"params": p}, *a, **kw))(params, *args)


def causal_mask():
    return nn.make_causal_mask(jnp.ones((B, S)))  # [B, 1, S, S], float 0/1


# --- flax attention ------------------------------------------------------------------------


def test_nnx_multi_head_attention(rand):
    assert ubf.checkpoints is ck
    mesh = make_mesh((TP, "tp"))
    ref = nnx.MultiHeadAttention(H, D, decode=False, rngs=nnx.Rngs(0))
    nnx.update(ref, randomized(nnx_params(ref), rand))
    x, mask = rand(B, S, D), causal_mask()
    converted = ck.from_flax_attention(nnx.state(ref, nnx.Param))  # Variables as leaves
    assert_trees_equal(ck.to_flax_attention(converted, num_heads=H), nnx_params(ref))
    with jax.set_mesh(mesh):
        ub = ubf.ParallelSelfAttention(D, H, impl="ub", seq_axis=1, rngs=nnx.Rngs(1))
    back = ck.from_flax_attention(ck.to_flax_attention(nnx_params(ub), num_heads=H))
    assert_trees_equal(back, nnx_params(ub))
    # Loaded sharded, as the module's docstring shows.
    shardings = nnx.get_named_sharding(nnx.state(ub, nnx.Param), mesh)
    nnx.update(ub, jax.device_put(converted, nnx.to_pure_dict(shardings)))
    assert ub.qkv.kernel[...].sharding.spec == jax.P(None, "tp")
    assert rel_err(run_nnx(ub, x), ref(x)) < TOL
    assert rel_err(run_nnx(ub, x, mask), ref(x, mask=mask)) < TOL


def test_linen_multi_head_attention_without_biases(rand):
    x, mask = rand(B, S, D), causal_mask()
    ref = nn.MultiHeadDotProductAttention(num_heads=H, use_bias=False)
    params = ref.init(jax.random.key(0), x)["params"]
    ub = ubf.linen.ParallelSelfAttention(num_heads=H, use_bias=False, seq_axis=1, impl="ub")
    with jax.set_mesh(make_mesh((TP, "tp"))):
        ub_params = ub.init(jax.random.key(1), x)["params"]  # boxed: nn.Partitioned
    converted = ck.from_flax_attention(params)
    assert "bias" not in converted["qkv"] and "bias" not in converted["out"]
    assert_trees_equal(ck.to_flax_attention(converted, num_heads=H), params)
    assert_trees_equal(
        ck.from_flax_attention(ck.to_flax_attention(ub_params, num_heads=H)), ub_params
    )
    assert rel_err(run_linen(ub, converted, x), ref.apply({"params": params}, x)) < TOL
    want = ref.apply({"params": params}, x, mask=mask)
    assert rel_err(run_linen(ub, converted, x, is_causal=True), want) < TOL


# --- Dense MLPs -----------------------------------------------------------------------------


class DenseMLP(nn.Module):
    """Two auto-named Dense layers, as flax's lm1b MlpBlock."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(F)(x))  # Dense_0: linen numbers submodules as they are built
        return nn.Dense(x.shape[-1])(h)


def test_linen_dense_mlp(rand):
    x = rand(B, S, D)
    params = DenseMLP().init(jax.random.key(0), x)["params"]
    params = randomized(nn.unbox(params), rand)
    converted = ck.from_flax_mlp(params)
    assert_trees_equal(ck.to_flax_mlp(converted), params)
    ub = ubf.linen.ParallelMLP(F, activation=nn.relu, seq_axis=1, impl="ub")
    assert rel_err(run_linen(ub, converted, x), DenseMLP().apply({"params": params}, x)) < TOL


class Lm1bNnxMlp(nnx.Module):
    """lm1b_nnx's MlpBlock names, with gelu."""

    def __init__(self, rngs):
        self.linear1 = nnx.Linear(D, F, rngs=rngs)
        self.linear2 = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.gelu(self.linear1(x)))


def test_nnx_dense_mlp(rand):
    names = ("linear1", "linear2")
    ref = Lm1bNnxMlp(nnx.Rngs(0))
    nnx.update(ref, randomized(nnx_params(ref), rand))
    x = rand(S, B, D)  # jax_ub's default layout, [seq, batch, features]
    with jax.set_mesh(make_mesh((TP, "tp"))):
        ub = ubf.ParallelMLP(D, F, impl="ub", rngs=nnx.Rngs(1))
    assert_trees_equal(
        ck.from_flax_mlp(ck.to_flax_mlp(nnx_params(ub), names=names), names=names), nnx_params(ub)
    )
    converted = ck.from_flax_mlp(nnx_params(ref), names=names)
    assert_trees_equal(ck.to_flax_mlp(converted, names=names), nnx_params(ref))
    nnx.update(ub, converted)
    assert rel_err(run_nnx(ub, x), ref(x)) < TOL


# --- Llama-style checkpoints ----------------------------------------------------------------


def rope(x, theta=THETA):
    """Hugging Face's rotate_half rotary embeddings of ``x [B, S, heads, HD]``."""
    inv_freq = theta ** (-jnp.arange(0, HD, 2, dtype=jnp.float32) / HD)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq
    cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (jnp.cos, jnp.sin))
    rotated = jnp.concatenate([-x[..., HD // 2 :], x[..., : HD // 2]], -1)
    return x * cos + rotated * sin


def llama_attention(x, w):
    """Causal GQA self-attention of ``x [B, S, D]`` from kernels q [D, H*HD], k, v [D, G*HD],
    o [H*HD, D] (``x @ kernel``)."""
    q = rope((x @ w["q"]).reshape(B, S, H, HD))
    k = rope((x @ w["k"]).reshape(B, S, G, HD))
    v = (x @ w["v"]).reshape(B, S, G, HD)
    k, v = (jnp.repeat(a, H // G, axis=2) for a in (k, v))
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(HD)
    logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -jnp.inf)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, -1), v)
    return out.reshape(B, S, H * HD) @ w["o"]


def swiglu(x, w):
    return (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def llama_weights(rand):
    shapes = dict(q=(D, H * HD), k=(D, G * HD), v=(D, G * HD), o=(H * HD, D))
    shapes |= dict(gate=(D, F), up=(D, F), down=(F, D))
    return {n: rand(*s, scale=0.3) for n, s in shapes.items()}


ATTN = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")


def checkpoint(w, form):
    """The weights ``w`` as a checkpoint of ``form``, and the converters' keywords for it."""
    attn = {f"{n}_proj": w[n] for n in ATTN}
    mlp = {f"{n}_proj": w[n] for n in MLP}
    if form == "flax":  # {"q_proj": {"kernel": [in, out]}}
        wrap = lambda t: {n: {"kernel": a} for n, a in t.items()}  # noqa: E731
        return wrap(attn), wrap(mlp), {}, {}
    if form == "torch":  # {"q_proj": {"weight": [out, in]}}
        wrap = lambda t: {n: {"weight": a.T} for n, a in t.items()}  # noqa: E731
        kw = dict(kernel_key="weight", transpose=True)
        return wrap(attn), wrap(mlp), kw, kw
    if form == "flat":  # {"q_proj": [in, out]}
        kw = dict(kernel_key=None)
        return attn, mlp, kw, kw
    # "heads": DenseGeneral-style q [D, H, HD], k, v [D, G, HD], o [H, HD, D]
    attn = dict(
        q_proj=w["q"].reshape(D, H, HD),
        k_proj=w["k"].reshape(D, G, HD),
        v_proj=w["v"].reshape(D, G, HD),
        o_proj=w["o"].reshape(H, HD, D),
    )
    attn = {n: {"kernel": a} for n, a in attn.items()}
    return attn, {n: {"kernel": a} for n, a in mlp.items()}, dict(split_heads=True), {}


@pytest.mark.parametrize("form", ["flax", "torch", "flat", "heads"])
def test_llama_round_trips(rand, form):
    attn, mlp, attn_kw, mlp_kw = checkpoint(llama_weights(rand), form)
    from_kw = {k: v for k, v in attn_kw.items() if k != "split_heads"}
    ub_attn = ck.from_llama_attention(attn, num_heads=H, num_kv_heads=G, **from_kw)
    assert ub_attn["qkv"]["kernel"].shape == (D, G * (H // G + 2) * HD)
    assert_trees_equal(ck.to_llama_attention(ub_attn, num_heads=H, num_kv_heads=G, **attn_kw), attn)
    ub_mlp = ck.from_llama_mlp(mlp, **mlp_kw)
    assert ub_mlp["gate_up"].shape == (D, 2, F)
    assert_trees_equal(ck.to_llama_mlp(ub_mlp, **mlp_kw), mlp)
    # and from jax_ub's side: jax_ub params -> checkpoint -> jax_ub params
    ub_attn = {
        "qkv": {"kernel": rand(D, G * (H // G + 2) * HD)},
        "out": {"kernel": rand(H * HD, D)},
    }
    back = ck.to_llama_attention(ub_attn, num_heads=H, num_kv_heads=G, **attn_kw)
    assert_trees_equal(
        ck.from_llama_attention(back, num_heads=H, num_kv_heads=G, **from_kw), ub_attn
    )
    ub_mlp = {"gate_up": rand(D, 2, F), "down_proj": rand(F, D)}
    assert_trees_equal(ck.from_llama_mlp(ck.to_llama_mlp(ub_mlp, **mlp_kw), **mlp_kw), ub_mlp)


def test_llama_attention_with_biases_as_flax_attention(rand):
    """With biases (Hugging Face's attention_bias) and G = H, the Llama path gives what the
    flax one does from the same weights split per head; and back again."""
    kernels = dict(q=(D, H * HD), k=(D, H * HD), v=(D, H * HD), o=(H * HD, D))
    llama = {f"{n}_proj": {"kernel": rand(*s), "bias": rand(s[1])} for n, s in kernels.items()}
    heads = lambda a: a.reshape(*a.shape[:-1], H, HD)  # noqa: E731
    flax = {
        name: {"kernel": heads(llama[p]["kernel"]), "bias": heads(llama[p]["bias"])}
        for name, p in zip(("query", "key", "value"), ("q_proj", "k_proj", "v_proj"))
    }
    flax["out"] = {"kernel": llama["o_proj"]["kernel"].reshape(H, HD, D)}
    flax["out"]["bias"] = llama["o_proj"]["bias"]
    converted = ck.from_llama_attention(llama, num_heads=H)
    assert_trees_equal(converted, ck.from_flax_attention(flax))
    assert_trees_equal(ck.to_llama_attention(converted, num_heads=H), llama)
    with pytest.raises(ValueError, match="kernel_key=None has no place"):
        ck.to_llama_attention(converted, num_heads=H, kernel_key=None)


def test_llama_nnx(rand):
    w = llama_weights(rand)
    attn, mlp, kw, _ = checkpoint(w, "torch")
    x = rand(B, S, D)
    with jax.set_mesh(make_mesh((TP, "tp"))):
        settings = dict(impl="ub", seq_axis=1, use_bias=False, rngs=nnx.Rngs(0))
        ub_attn = ubf.ParallelSelfAttention(D, H, num_kv_heads=G, rope_theta=THETA, **settings)
        ub_mlp = ubf.ParallelGatedMLP(D, F, impl="ub", seq_axis=1, rngs=nnx.Rngs(1))
    nnx.update(ub_attn, ck.from_llama_attention(attn, num_heads=H, num_kv_heads=G, **kw))
    nnx.update(ub_mlp, ck.from_llama_mlp(mlp, **kw))
    assert rel_err(run_nnx(ub_attn, x, is_causal=True), llama_attention(x, w)) < TOL
    assert rel_err(run_nnx(ub_mlp, x), swiglu(x, w)) < TOL


def test_llama_linen(rand):
    w = llama_weights(rand)
    attn, mlp, _, _ = checkpoint(w, "heads")
    x = rand(B, S, D)
    ub_attn = ubf.linen.ParallelSelfAttention(
        num_heads=H, num_kv_heads=G, rope_theta=THETA, use_bias=False, seq_axis=1, impl="ub"
    )
    ub_mlp = ubf.linen.ParallelGatedMLP(F, seq_axis=1, impl="ub")
    p_attn = ck.from_llama_attention(attn, num_heads=H, num_kv_heads=G)
    y = run_linen(ub_attn, p_attn, x, is_causal=True)
    assert rel_err(y, llama_attention(x, w)) < TOL
    assert rel_err(run_linen(ub_mlp, ck.from_llama_mlp(mlp), x), swiglu(x, w)) < TOL


# --- errors ---------------------------------------------------------------------------------


def test_errors_name_the_problem_and_shapes(rand):
    k = lambda *s: {"kernel": rand(*s), "bias": rand(*s[1:])}  # noqa: E731
    mha = dict(query=k(D, H, HD), key=k(D, H, HD), value=k(D, H, HD))
    mha["out"] = {"kernel": rand(H, HD, D), "bias": rand(D)}
    ck.from_flax_attention(mha)  # the right shapes; each case below breaks one
    with pytest.raises(ValueError, match=r"from_flax_attention: .*key/kernel \(16, 4, 3\)"):
        ck.from_flax_attention(mha | {"key": k(D, H, 3)})
    with pytest.raises(ValueError, match=r"from_flax_attention: out: .*unexpected \['b'\]"):
        ck.from_flax_attention(mha | {"out": mha["out"] | {"b": rand(D)}})
    with pytest.raises(ValueError, match=r"unexpected \['query_ln'\]"):
        ck.from_flax_attention(mha | {"query_ln": {"scale": rand(HD)}})
    with pytest.raises(ValueError, match="biases on some projections only"):
        ck.from_flax_attention(mha | {"out": {"kernel": rand(H, HD, D)}})
    gqa = ck.from_llama_attention(
        {n: rand(*s) for n, s in zip(ck.LLAMA_ATTENTION_NAMES, [(D, 16), (D, 8), (D, 8), (16, D)])},
        num_heads=H,
        num_kv_heads=G,
        kernel_key=None,
    )
    with pytest.raises(ValueError, match=r"to_flax_attention: .*num_heads H=4, num_kv_heads G=4"):
        ck.to_flax_attention(gqa, num_heads=H)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4"):
        ck.to_llama_attention(gqa, num_heads=H, num_kv_heads=3)
    bad = {n: {"kernel": rand(D, 12)} for n in ck.LLAMA_ATTENTION_NAMES}
    with pytest.raises(ValueError, match=r"num_kv_heads G=2.*q_proj/kernel \(16, 12\)"):
        ck.from_llama_attention(bad, num_heads=H, num_kv_heads=G)
    with pytest.raises(ValueError, match=r"transpose=True.*q_proj \(16, 4, 4\)"):
        ck.from_llama_attention(
            {n: rand(D, H, HD) for n in ck.LLAMA_ATTENTION_NAMES},
            num_heads=H,
            kernel_key=None,
            transpose=True,
        )
    with pytest.raises(ValueError, match=r"from_llama_mlp: expected gate and up"):
        ck.from_llama_mlp(
            {"gate_proj": rand(D, F), "up_proj": rand(D, 8), "down_proj": rand(F, D)},
            kernel_key=None,
        )
    with pytest.raises(ValueError, match=r"from_flax_mlp: .*\['Dense_0', 'Dense_1'\]"):
        ck.from_flax_mlp({"linear1": k(D, F), "linear2": k(F, D)})
    with pytest.raises(ValueError, match=r"from_flax_mlp: .*\(16, 32\).*\(16, 16\)"):
        ck.from_flax_mlp({"Dense_0": k(D, F), "Dense_1": k(D, D)})
    with pytest.raises(ValueError, match=r"to_llama_mlp: names must be 3 names"):
        ck.to_llama_mlp({"gate_up": rand(D, 2, F), "down_proj": rand(F, D)}, names=("w1", "w2"))
