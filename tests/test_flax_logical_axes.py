"""Logical axis names (``kernel_axes``) and the user's ``logical_axis_rules`` govern the Flax
layers' params and their tensor-parallel axis, as in public Flax LMs: a mesh whose axes are
("data", "model"), no axis named "tp", the rules saying where "mlp" and "heads" go."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf

SEQ, BATCH, D, F, HEADS = 16, 4, 16, 32, 4
RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("heads", "model"))


def _mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


class Block(nn.Module):
    impl: str

    @nn.compact
    def __call__(self, x):
        x = x + ubf.linen.ParallelSelfAttention(
            num_heads=HEADS, kernel_axes=("embed", "heads"), impl=self.impl
        )(x, None, True)
        return x + ubf.linen.ParallelMLP(F, kernel_axes=("embed", "mlp"), impl=self.impl)(x)


def test_linen_params_follow_the_rules_and_train_like_xla(rand):
    mesh = _mesh()
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("model", "data")))
    out = {}
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        for impl in ("ub", "xla"):
            block = Block(impl)
            abstract = jax.eval_shape(block.init, jax.random.key(0), x)
            logical = nn.get_partition_spec(abstract)["params"]
            assert logical["ParallelMLP_0"]["up_proj"]["kernel"] == P("embed", "mlp")
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
            up = shardings["params"]["ParallelMLP_0"]["up_proj"]["kernel"]
            assert up.spec == P(None, "model"), up
            variables = jax.jit(block.init, out_shardings=shardings)(jax.random.key(0), x)
            loss = lambda v, b=block: jnp.sum(jnp.sin(b.apply(v, x)))  # noqa: E731
            out[impl] = jax.jit(jax.value_and_grad(loss))(variables)
            if impl == "ub":
                hlo = jax.jit(block.apply).lower(variables, x).compile().as_text()
                assert "jax_ub_all_gather_matmul" in hlo  # over "model", from the rules
    assert rel_err(out["ub"][0], out["xla"][0]) < 1e-5
    grads = [jax.tree.leaves(nn.unbox(out[impl][1])) for impl in ("ub", "xla")]
    for g, r in zip(*grads):
        assert rel_err(g, r) < 1e-4


def test_nnx_params_follow_the_rules(rand):
    mesh = _mesh()
    x = rand(SEQ, BATCH, D)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        mlp = ubf.ParallelGatedMLP(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        assert mlp.axis_name == "model"
        assert mlp.gate_up[...].sharding.spec == P(None, None, "model")
        assert nnx.get_partition_spec(nnx.state(mlp))["down_proj"].get_value() == P("model", None)
        attn = ubf.ParallelSelfAttention(D, HEADS, kernel_axes=("embed", "heads"), rngs=nnx.Rngs(1))
        assert attn.qkv.kernel[...].sharding.spec == P(None, "model")
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
    want = jax_ub.gated_mlp_reference(x, mlp.gate_up[...], mlp.down_proj[...])
    assert rel_err(y, want) < 1e-5


def test_bad_logical_settings_are_named():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="either param_axes .* or kernel_axes"):
            ubf.ColumnParallelLinear(
                D, F, param_axes="data", kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0)
            )
        with pytest.raises(ValueError, match="kernel_axes must name each of the kernel's 2 dims"):
            ubf.ColumnParallelLinear(D, F, kernel_axes=("mlp",), rngs=nnx.Rngs(0))
        with (
            nnx.logical_axis_rules((("mlp", ("data", "model")),)),
            pytest.raises(ValueError, match="map 'mlp' to the mesh axes \\('data', 'model'\\)"),
        ):
            ubf.ColumnParallelLinear(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))


# A trainer's mesh and rules: every axis in the mesh, most of size 1, and a logical name
# mapped to several mesh axes, of which one ("tensor") has size > 1 here.
TRAINER_AXES = ("fsdp", "fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")
TRAINER_RULES = (
    ("embed", "fsdp"),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
)


def _trainer_mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 2, 1, 1), TRAINER_AXES)


@pytest.mark.parametrize("axis_name", [None, "tensor"])
def test_a_rule_listing_several_axes_splits_over_the_one_of_size_above_one(rand, axis_name):
    """'mlp' -> [fsdp_transpose, tensor, tensor_sequence, autoregressive]: with axis_name
    given (listed there) or not (the one listed axis of size > 1), the layers run over
    "tensor", their params placed as the rules place them, and compute x @ w."""
    mesh = _trainer_mesh()
    x = rand(SEQ, BATCH, D)
    kw = {} if axis_name is None else {"axis_name": axis_name}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(TRAINER_RULES):
        up = ubf.ColumnParallelLinear(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0), **kw)
        down = ubf.RowParallelLinear(F, D, kernel_axes=("mlp", "embed"), rngs=nnx.Rngs(1), **kw)
        assert up.axis_name == down.axis_name == "tensor"
        split = up.kernel[...].sharding
        assert split.shard_shape(up.kernel[...].shape) == (D // 2, F // 2)  # fsdp x tensor
        y = nnx.jit(lambda u, d, x: d(jax.nn.gelu(u(x))))(up, down, x)
    want = jax.nn.gelu(x @ up.kernel[...] + up.bias[...]) @ down.kernel[...] + down.bias[...]
    assert rel_err(y, want) < 1e-5

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = ubf.linen.ColumnParallelLinear(F, kernel_axes=("embed", "mlp"), **kw)(x)
            return ubf.linen.RowParallelLinear(D, kernel_axes=("mlp", "embed"), **kw)(h)

    with jax.set_mesh(mesh), nn.logical_axis_rules(TRAINER_RULES):
        variables = Mlp().init(jax.random.key(0), x)
        hlo = jax.jit(Mlp().apply).lower(variables, x).as_text()
        y = jax.jit(Mlp().apply)(variables, x)
    assert "jax_ub_all_gather_matmul" in hlo
    p = nn.unbox(variables["params"])
    c, r = p["ColumnParallelLinear_0"], p["RowParallelLinear_0"]
    want = (x @ c["kernel"] + c["bias"]) @ r["kernel"] + r["bias"]
    assert rel_err(y, want) < 1e-5


def test_a_rule_listing_two_axes_above_one_is_named_unless_axis_name_picks():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    rules = (("embed", None), ("mlp", ("fsdp", "tensor")))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        with pytest.raises(
            ValueError,
            match=r"map 'mlp' to the mesh axes \('fsdp', 'tensor'\), of which \('fsdp', "
            r"'tensor'\) have size > 1 \(fsdp=2, tensor=2\).*pass axis_name",
        ):
            ubf.ColumnParallelLinear(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        layer = ubf.ColumnParallelLinear(
            D, F, kernel_axes=("embed", "mlp"), axis_name="tensor", rngs=nnx.Rngs(0)
        )
        assert layer.axis_name == "tensor"
    with nnx.logical_axis_rules(rules), pytest.raises(ValueError, match="no mesh is known"):
        ubf.ColumnParallelLinear(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("linen", [False, True], ids=["nnx", "linen"])
def test_axis_name_of_size_one_while_the_kernel_is_split_elsewhere_is_said(rand, linen):
    """axis_name names a listed axis of size 1 ("fsdp_transpose") while the rules split
    the kernel over "tensor": a group of one, XLA gathering the kernel every call. The
    numbers stay right; a warning names both axes and the fix."""
    jax_ub.finalize()  # clears the warnings given once
    mesh = _trainer_mesh()
    x = rand(SEQ, BATCH, D)
    warning = (
        r"axis_name 'fsdp_transpose' \(size 1.*split over 'tensor' \(size 2\)"
        r".*axis_name='tensor'"
    )
    kw = dict(kernel_axes=("embed", "mlp"), axis_name="fsdp_transpose")
    with jax.set_mesh(mesh), nn.logical_axis_rules(TRAINER_RULES):
        with pytest.warns(UserWarning, match=warning):
            if linen:
                layer = ubf.linen.ColumnParallelLinear(F, **kw)
                variables = layer.init(jax.random.key(0), x)
                y = jax.jit(layer.apply)(variables, x)
                kernel = nn.unbox(variables["params"])["kernel"]
            else:
                layer = ubf.ColumnParallelLinear(D, F, rngs=nnx.Rngs(0), **kw)
                y = nnx.jit(lambda m, x: m(x))(layer, x)
                kernel = layer.kernel[...]
    assert rel_err(y, x @ kernel) < 1e-5
