"""jax_ub.flax NNX layers and blocks against plain Flax NNX models with explicit lax collectives."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_refs import (
    assert_matches_reference,
    assert_trees_close,
    column_parallel_reference,
    row_parallel_reference,
)
from conftest import rel_err
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf

TP = 4
SEQ, BATCH, D, HIDDEN, HEADS = 16, 2, 16, 32, 4
IMPLS = ["ub", "xla"]


# --- plain Flax reference: global params, explicit lax collectives ------------------------


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, dtype)


class _RefParallel(nnx.Module):
    """A plain parallel linear layer's parameters, global; its call is the subclass's."""

    def __init__(self, d_in, d_out, mesh, use_bias=True, *, rngs):
        self.kernel = nnx.Param(_normal(rngs.params(), (d_in, d_out)))
        self.bias = nnx.Param(_normal(rngs.params(), (d_out,))) if use_bias else nnx.data(None)
        self.mesh = mesh

    def _params(self):
        return self.kernel[...], None if self.bias is None else self.bias[...]


class RefColumn(_RefParallel):
    def __call__(self, x):
        return column_parallel_reference(x, *self._params(), self.mesh)


class RefRow(_RefParallel):
    def __call__(self, h):
        return row_parallel_reference(h, *self._params(), self.mesh)


class RefMLP(nnx.Module):
    def __init__(self, d, hidden, mesh, *, rngs):
        self.up_proj = RefColumn(d, hidden, mesh, rngs=rngs)
        self.down_proj = RefRow(hidden, d, mesh, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.gelu(self.up_proj(x)))


class RefAttention(nnx.Module):
    def __init__(self, d, heads, mesh, *, rngs):
        self.qkv = RefColumn(d, 3 * d, mesh, rngs=rngs)
        self.out = RefRow(d, d, mesh, rngs=rngs)
        self.heads = heads

    def __call__(self, x, mask=None, is_causal=False):
        seq, batch = x.shape[0], x.shape[1:-1]
        hd = x.shape[-1] // self.heads
        if is_causal:
            mask = np.tril(np.ones((seq, seq), bool))
        qkv = self.qkv(x).reshape(seq, *batch, self.heads, 3, hd)
        q, k, v = (jnp.moveaxis(qkv[..., i, :], 0, -2) for i in range(3))  # [*b, h, s, hd]
        logits = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(hd)
        if mask is not None:
            logits = jnp.where(mask, logits, -1e30)
        o = jax.nn.softmax(logits, axis=-1) @ v  # [*b, h, s, hd]
        o = jnp.moveaxis(o, -2, 0)  # [s, *b, h, hd]
        return self.out(o.reshape(seq, *batch, -1))


# --- cases ----------------------------------------------------------------------------------

CAUSAL = np.tril(np.ones((SEQ, SEQ), bool))


def make_pair(kind, mesh, impl, use_bias=True):
    """(jax_ub model, reference model with the same params, input shape, call kwargs)."""
    rngs = nnx.Rngs(0)
    kw = dict(mesh=mesh, impl=impl, use_bias=use_bias, rngs=nnx.Rngs(1))
    kw["bias_init"] = nnx.initializers.normal(1.0)  # nonzero, so a misplaced bias shows
    if kind in ("column", "column2d"):  # column2d: an input with no batch dim
        model = ubf.ColumnParallelLinear(D, HIDDEN, **kw)
        ref = RefColumn(D, HIDDEN, mesh, use_bias, rngs=rngs)
        shape, extra = ((SEQ, BATCH, D) if kind == "column" else (SEQ, D)), {}
    elif kind == "row":
        model = ubf.RowParallelLinear(HIDDEN, D, **kw)
        ref = RefRow(HIDDEN, D, mesh, use_bias, rngs=rngs)
        shape, extra = (SEQ, BATCH, HIDDEN), {}
    elif kind == "mlp":
        model = ubf.ParallelMLP(D, HIDDEN, **kw)
        ref = RefMLP(D, HIDDEN, mesh, rngs=rngs)
        shape, extra = (SEQ, BATCH, D), {}
    elif kind in ("attention", "attention_causal", "attention_is_causal"):
        model = ubf.ParallelSelfAttention(D, HEADS, **kw)
        ref = RefAttention(D, HEADS, mesh, rngs=rngs)
        shape = (SEQ, BATCH, D)
        extra = {
            "attention": {},
            "attention_causal": {"mask": jnp.asarray(CAUSAL)},
            "attention_is_causal": {"is_causal": True},
        }[kind]
    else:
        raise AssertionError(kind)
    nnx.update(ref, nnx.state(model, nnx.Param))  # same parameter values
    return model, ref, shape, extra


def forward_and_grads(model, x, ct, extra):
    """model(x) and the gradients of <model(x), ct> w.r.t. the parameters and x, in one jit."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, x):
        def f(params, x):
            return nnx.merge(graphdef, params, rest)(x, **extra)

        y, vjp = jax.vjp(f, params, x)
        g_params, g_x = vjp(ct)
        return y, nnx.to_pure_dict(g_params), g_x

    return run(params, x)


def model_out_features(model):
    if isinstance(model, ubf.ParallelMLP):
        return model.down_proj.out_features
    if isinstance(model, ubf.ParallelSelfAttention):
        return model.out.out_features
    return model.out_features


TOL = dict(rtol=2e-5, atol=2e-5)
_REF_CACHE = {}
KINDS = ["column", "column2d", "row", "mlp", "attention", "attention_causal", "attention_is_causal"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference_forward_and_grads(mesh, kind, impl):
    model, ref, shape, extra = make_pair(kind, mesh, impl)
    x = jax.random.normal(jax.random.key(2), shape)
    ct = jax.random.normal(jax.random.key(3), shape[:-1] + (model_out_features(model),))
    got = forward_and_grads(model, x, ct, extra)
    reference = lambda: forward_and_grads(ref, x, ct, extra)  # noqa: E731
    assert_matches_reference(got, _REF_CACHE, kind, reference, **TOL)
    assert got[0].shape == _REF_CACHE[kind][0].shape == ct.shape


@pytest.mark.parametrize("impl", IMPLS)
def test_layers_match_dense_math(mesh, impl):
    """Column then row equals x @ K1 + b1 @ K2 + b2: each bias added exactly once."""
    model, _, _, _ = make_pair("column", mesh, impl)
    row = ubf.RowParallelLinear(
        HIDDEN, D, mesh=mesh, impl=impl, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(5)
    )
    x = jax.random.normal(jax.random.key(2), (SEQ, BATCH, D))
    h = model(x)
    np.testing.assert_allclose(h, x @ model.kernel[...] + model.bias[...], **TOL)
    y = row(h)
    np.testing.assert_allclose(y, h @ row.kernel[...] + row.bias[...], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_without_bias(mesh, kind, impl):
    model, ref, shape, _ = make_pair(kind, mesh, impl, use_bias=False)
    assert model.bias is None
    x = jax.random.normal(jax.random.key(2), shape)
    np.testing.assert_allclose(model(x), ref(x), **TOL)
    assert set(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == {"kernel"}


def test_param_and_output_sharding(mesh):
    col = ubf.ColumnParallelLinear(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0))
    row = ubf.RowParallelLinear(HIDDEN, D, mesh=mesh, rngs=nnx.Rngs(0))
    assert col.kernel.shape == (D, HIDDEN) and row.kernel.shape == (HIDDEN, D)  # global
    assert col.kernel[...].sharding.spec == P(None, "tp")
    assert col.bias[...].sharding.spec == P("tp")
    assert row.kernel[...].sharding.spec == P("tp", None)
    assert row.bias[...].sharding.is_fully_replicated
    assert col.kernel.get_metadata()["out_sharding"] == (None, "tp")
    specs = nnx.get_partition_spec(nnx.state(row))
    assert specs["kernel"].get_value() == P("tp", None)

    x = jax.random.normal(jax.random.key(0), (SEQ, BATCH, D))
    h = jax.jit(lambda x: col(x))(x)
    assert h.sharding.spec == P(None, None, "tp")
    y = jax.jit(lambda h: row(h))(h)
    assert y.sharding.is_equivalent_to(jax.NamedSharding(mesh, P("tp")), y.ndim)


@pytest.mark.parametrize("impl", IMPLS)
def test_split_merge_under_jit(mesh, impl):
    attn = ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    graphdef, state = nnx.split(attn)

    @jax.jit
    def step(state, x):
        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(x, mask=CAUSAL) ** 2)

        value, grads = jax.value_and_grad(loss)(state)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    value, new_state = step(state, x)
    np.testing.assert_allclose(value, jnp.mean(attn(x, mask=CAUSAL) ** 2), rtol=1e-5)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    moved = nnx.merge(graphdef, new_state)
    assert moved.qkv.kernel[...].sharding.spec == P(None, "tp")
    assert jnp.mean(moved(x, mask=CAUSAL) ** 2) < value  # one SGD step helps


def _assert_plain_arrays(tree):
    leaves, treedef = jax.tree.flatten(tree)
    assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert "jax_ub" not in str(treedef)


def test_pure_dict_roundtrip(mesh):
    mlp = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    pure = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
    _assert_plain_arrays(pure)
    saved = jax.tree.map(np.asarray, pure)  # e.g. np.savez / pickle

    fresh = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(7))
    state = nnx.state(fresh, nnx.Param)
    nnx.replace_by_pure_dict(state, saved)
    nnx.update(fresh, state)
    np.testing.assert_array_equal(fresh(x), mlp(x))


def test_orbax_roundtrip(mesh, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")

    def create(seed):
        return ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, rngs=nnx.Rngs(seed))

    attn = create(0)
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    _, state = nnx.split(attn)
    _assert_plain_arrays(state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create(1)))
        restored = ckpt.restore(tmp_path / "state", abstract)
    back = nnx.merge(graphdef, restored)
    assert back.qkv.kernel[...].sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(back(x), attn(x))


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_compute(mesh, impl):
    model = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, impl=impl, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    y = jax.jit(lambda x: model(x))(x)
    assert y.dtype == jnp.bfloat16
    ref = RefMLP(D, HIDDEN, mesh, rngs=nnx.Rngs(0))
    nnx.update(ref, nnx.state(model, nnx.Param))
    assert rel_err(y, ref(x)) < 1e-2  # bf16 operands and outputs


@pytest.mark.parametrize("impl", IMPLS)
def test_mesh_with_data_axis(impl):
    """On a (dp, tp) mesh the layers split over tp only and are replicated over dp."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    mesh2 = Mesh(np.array(devices[:4]).reshape(2, 2), ("dp", "tp"))
    mlp = ubf.ParallelMLP(D, HIDDEN, mesh=mesh2, impl=impl, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    params = nnx.to_pure_dict(nnx.state(mlp, nnx.Param))
    up, down = params["up_proj"], params["down_proj"]
    expected = nnx.gelu(x @ up["kernel"] + up["bias"]) @ down["kernel"] + down["bias"]
    np.testing.assert_allclose(jax.jit(lambda x: mlp(x))(x), expected, **TOL)


def test_argument_errors(mesh):
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="out_features=30 must be a positive multiple"):
        ubf.ColumnParallelLinear(D, 30, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="in_features=30 must be a positive multiple"):
        ubf.RowParallelLinear(30, D, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="num_heads=6 must be a positive multiple"):
        ubf.ParallelSelfAttention(24, 6, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="qkv_features=16 is not divisible by num_heads=12"):
        ubf.ParallelSelfAttention(16, 12, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="hidden_features=30|in_features=30"):
        ubf.ParallelMLP(D, 30, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        ubf.ColumnParallelLinear(D, HIDDEN, mesh=mesh, axis_name="model", rngs=rngs)
    with pytest.raises(ValueError, match="must be a concrete jax.sharding.Mesh"):
        ubf.ColumnParallelLinear(D, HIDDEN, mesh=mesh.abstract_mesh, rngs=rngs)
    with pytest.raises(ValueError, match="impl must be one of"):
        ubf.RowParallelLinear(HIDDEN, D, mesh=mesh, impl="nccl", rngs=rngs)
    with pytest.raises(ValueError, match="attention_implementation must be one of"):
        ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, attention_implementation="flash", rngs=rngs)
    with pytest.raises(ValueError, match="'cudnn' needs GPU devices, but the mesh is on 'cpu'"):
        ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, attention_implementation="cudnn", rngs=rngs)

    col = ubf.ColumnParallelLinear(D, HIDDEN, mesh=mesh, rngs=rngs)
    # A sequence tp does not divide runs with the activations replicated over tp.
    x18 = jax.random.normal(jax.random.key(7), (18, BATCH, D))
    assert rel_err(col(x18), x18 @ col.kernel[...] + col.bias[...]) < 1e-5
    with pytest.raises(ValueError, match="input has 8 features"):
        col(jnp.ones((SEQ, BATCH, 8)))
    with pytest.raises(ValueError, match=r"input must be \[seq, \*batch, features\]"):
        col(jnp.ones((D,)))
    attn = ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="head dim of the mask must be 1"):
        attn(jnp.ones((SEQ, BATCH, D)), mask=jnp.ones((BATCH, HEADS, SEQ, SEQ), bool))


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_mesh_axes(mesh, impl):
    """A mesh with Explicit axes (jax.make_mesh's default in newer JAX) works the same."""
    explicit = jax.make_mesh(
        (TP,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:TP]
    )
    model = ubf.ParallelMLP(D, HIDDEN, mesh=explicit, impl=impl, rngs=nnx.Rngs(0))
    auto = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    with jax.set_mesh(explicit):
        y, grads = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2)))(model, x)
    y_ref, grads_ref = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2)))(auto, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(grads_ref), **TOL)
