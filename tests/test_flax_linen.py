"""jax_ub.flax.linen layers and blocks against plain linen models with explicit lax collectives."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _layer_refs import (
    assert_matches_reference,
    column_parallel_reference,
    row_parallel_reference,
)
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax
import jax_ub.flax.linen as ubl

TP = 4
SEQ, BATCH, D, HIDDEN, HEADS = 16, 2, 16, 32, 4
IMPLS = ["ub", "xla"]
TOL = dict(rtol=2e-5, atol=2e-5)
CAUSAL = np.tril(np.ones((SEQ, SEQ), bool))


# --- plain linen reference: same parameter names, explicit lax collectives ----------------


class _RefParallel(nn.Module):
    """A plain parallel linear layer's parameters, global; its call is the subclass's."""

    features: int
    mesh: Mesh
    use_bias: bool = True

    def _params(self, in_features):
        """(kernel, bias or None), declared from the subclass's compact call."""
        init = nn.initializers.normal()
        k = self.param("kernel", init, (in_features, self.features))
        return k, self.param("bias", init, (self.features,)) if self.use_bias else None


class RefColumn(_RefParallel):
    @nn.compact
    def __call__(self, x):
        return column_parallel_reference(x, *self._params(x.shape[-1]), self.mesh)


class RefRow(_RefParallel):
    @nn.compact
    def __call__(self, h):
        return row_parallel_reference(h, *self._params(h.shape[-1]), self.mesh)


class RefMLP(nn.Module):
    hidden: int
    mesh: Mesh

    @nn.compact
    def __call__(self, x):
        h = RefColumn(self.hidden, self.mesh, name="up_proj")(x)
        return RefRow(x.shape[-1], self.mesh, name="down_proj")(nn.gelu(h))


class RefAttention(nn.Module):
    heads: int
    mesh: Mesh

    @nn.compact
    def __call__(self, x, mask=None):
        seq, batch, d = x.shape[0], x.shape[1:-1], x.shape[-1]
        hd = d // self.heads
        qkv = RefColumn(3 * d, self.mesh, name="qkv")(x).reshape(seq, *batch, self.heads, 3, hd)
        q, k, v = (jnp.moveaxis(qkv[..., i, :], 0, -2) for i in range(3))  # [*b, h, s, hd]
        logits = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(hd)
        if mask is not None:
            logits = jnp.where(mask, logits, -1e30)
        o = jnp.moveaxis(jax.nn.softmax(logits, axis=-1) @ v, -2, 0)  # [s, *b, h, hd]
        return RefRow(d, self.mesh, name="out")(o.reshape(seq, *batch, -1))


# --- cases ----------------------------------------------------------------------------------


def make_pair(kind, mesh, impl, use_bias=True):
    """(jax_ub module, reference module, input shape, extra call args)."""
    kw = dict(mesh=mesh, impl=impl, use_bias=use_bias, bias_init=nn.initializers.normal(1.0))
    if kind == "column":
        return (
            ubl.ColumnParallelLinear(HIDDEN, **kw),
            RefColumn(HIDDEN, mesh, use_bias),
            (SEQ, BATCH, D),
            (),
        )
    if kind == "row":
        return ubl.RowParallelLinear(D, **kw), RefRow(D, mesh, use_bias), (SEQ, BATCH, HIDDEN), ()
    if kind == "mlp":
        return ubl.ParallelMLP(HIDDEN, **kw), RefMLP(HIDDEN, mesh), (SEQ, BATCH, D), ()
    if kind == "attention_causal":
        return (
            ubl.ParallelSelfAttention(HEADS, **kw),
            RefAttention(HEADS, mesh),
            (SEQ, BATCH, D),
            (jnp.asarray(CAUSAL),),
        )
    raise AssertionError(kind)


def forward_and_grads(module, params, x, ct, extra):
    """module(x) and the gradients of <module(x), ct> w.r.t. params and x, in one jit."""

    @jax.jit
    def run(params, x):
        y, vjp = jax.vjp(lambda p, x: module.apply({"params": p}, x, *extra), params, x)
        return (y, *vjp(ct))

    return run(params, x)


_REF_CACHE = {}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["column", "row", "mlp", "attention_causal"])
def test_matches_reference_forward_and_grads(mesh, kind, impl):
    module, ref, shape, extra = make_pair(kind, mesh, impl)
    x = jax.random.normal(jax.random.key(2), shape)
    variables = jax.jit(module.init)(jax.random.key(0), x, *extra)
    params = nn.meta.unbox(variables["params"])
    y_shape = jax.eval_shape(lambda: module.apply(variables, x, *extra)).shape
    ct = jax.random.normal(jax.random.key(3), y_shape)

    got = forward_and_grads(module, params, x, ct, extra)
    reference = lambda: forward_and_grads(ref, params, x, ct, extra)  # noqa: E731
    assert_matches_reference(got, _REF_CACHE, kind, reference, **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_bias_added_once(mesh, impl):
    module, _, shape, _ = make_pair("row", mesh, impl)
    h = jax.random.normal(jax.random.key(2), shape)
    variables = module.init(jax.random.key(0), h)
    p = nn.meta.unbox(variables["params"])
    np.testing.assert_allclose(module.apply(variables, h), h @ p["kernel"] + p["bias"], **TOL)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_without_bias(mesh, kind):
    module, ref, shape, _ = make_pair(kind, mesh, "auto", use_bias=False)
    x = jax.random.normal(jax.random.key(2), shape)
    variables = module.init(jax.random.key(0), x)
    assert set(variables["params"]) == {"kernel"}
    np.testing.assert_allclose(module.apply(variables, x), ref.apply(variables, x), **TOL)


def test_partition_specs_and_sharded_init(mesh):
    attn = ubl.ParallelSelfAttention(HEADS, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    abstract = jax.eval_shape(attn.init, jax.random.key(0), x)
    specs = nn.get_partition_spec(abstract)["params"]
    assert specs["qkv"] == {"kernel": P(None, "tp"), "bias": P("tp")}
    assert specs["out"] == {"kernel": P("tp", None), "bias": P(None)}

    shardings = nn.get_sharding(abstract, mesh)  # init straight into the sharded layout
    variables = jax.jit(attn.init, out_shardings=shardings)(jax.random.key(0), x)
    kernel = variables["params"]["qkv"]["kernel"].unbox()
    assert kernel.shape == (D, 3 * D) and kernel.sharding.spec == P(None, "tp")
    y = jax.jit(attn.apply)(variables, x, CAUSAL)
    assert y.shape == x.shape
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), y.ndim)


def test_pytree_roundtrip(mesh):
    """Variables hold only arrays (boxed by flax); they save and restore as plain numpy."""
    mlp = ubl.ParallelMLP(HIDDEN, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    variables = mlp.init(jax.random.key(0), x)
    assert "jax_ub" not in str(jax.tree.structure(variables))
    saved = jax.tree.map(np.asarray, nn.meta.unbox(variables))  # e.g. for np.savez / pickle
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(saved))
    restored = jax.tree.map(jnp.asarray, saved)
    np.testing.assert_array_equal(mlp.apply(restored, x), mlp.apply(variables, x))


def test_orbax_roundtrip(mesh, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    attn = ubl.ParallelSelfAttention(HEADS, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    abstract = jax.eval_shape(attn.init, jax.random.key(0), x)
    shardings = nn.get_sharding(abstract, mesh)
    params = nn.meta.unbox(jax.jit(attn.init, out_shardings=shardings)(jax.random.key(0), x))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "params", params)
        ckpt.wait_until_finished()
        restored = ckpt.restore(
            tmp_path / "params", jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
        )
    kernel = restored["params"]["out"]["kernel"]
    assert kernel.sharding.spec == P("tp", None)
    np.testing.assert_array_equal(attn.apply(restored, x, CAUSAL), attn.apply(params, x, CAUSAL))


def test_same_as_nnx_with_same_params(mesh):
    """linen and NNX blocks share parameter names and math."""
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    model = jax_ub.flax.ParallelSelfAttention(D, HEADS, mesh=mesh, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    module = ubl.ParallelSelfAttention(HEADS, mesh=mesh)
    y = module.apply({"params": params}, x, CAUSAL)
    np.testing.assert_allclose(y, model(x, mask=CAUSAL), **TOL)
    y_causal = module.apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(y_causal, model(x, is_causal=True), **TOL)
    np.testing.assert_allclose(y_causal, y, **TOL)  # is_causal == the tril mask


def test_argument_errors(mesh):
    x = jnp.ones((SEQ, BATCH, D))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="features=30 must be a positive multiple"):
        ubl.ColumnParallelLinear(30, mesh=mesh).init(key, x)
    with pytest.raises(ValueError, match="in_features=18 must be a positive multiple"):
        ubl.RowParallelLinear(D, mesh=mesh).init(key, jnp.ones((SEQ, BATCH, 18)))
    with pytest.raises(ValueError, match="hidden_features=30 must be a positive multiple"):
        ubl.ParallelMLP(30, mesh=mesh).init(key, x)
    with pytest.raises(ValueError, match="num_heads=6 must be a positive multiple"):
        ubl.ParallelSelfAttention(6, mesh=mesh).init(key, x)
    with pytest.raises(ValueError, match="qkv_features=16 is not divisible by num_heads=12"):
        ubl.ParallelSelfAttention(12, mesh=mesh).init(key, x)
    with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
        ubl.ColumnParallelLinear(HIDDEN, mesh=mesh, axis_name="model").init(key, x)
    with pytest.raises(ValueError, match="impl must be one of"):
        ubl.ColumnParallelLinear(HIDDEN, mesh=mesh, impl="nccl").init(key, x)
    # A sequence tp does not divide runs with the activations replicated over tp.
    ubl.ColumnParallelLinear(HIDDEN, mesh=mesh).init(key, jnp.ones((18, BATCH, D)))
    with pytest.raises(ValueError, match="'cudnn' needs GPU devices"):
        ubl.ParallelSelfAttention(HEADS, mesh=mesh, attention_implementation="cudnn").init(key, x)
    with pytest.raises(ValueError, match="head dim of the mask must be 1"):
        ubl.ParallelSelfAttention(HEADS, mesh=mesh).init(
            key, x, jnp.ones((BATCH, HEADS, SEQ, SEQ), bool)
        )
