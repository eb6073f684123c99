"""The column- and row-parallel layers shaped as flax's ``nn.DenseGeneral`` /
``nnx.LinearGeneral``: multi-dim features and contracted dims, the same param shapes,
names and initial values as flax's own layers (so a checkpoint loads unchanged), sharding
names from ``kernel_axes`` or the user's ``kernel_init`` partitioning, and several column
projections of one input from one all-gather (``project``).

Each is checked against flax's own layer (or plain ``jnp.einsum``) on unsharded arrays, f32:
values and gradients, sequence-parallel and replicated, ``seq_axis`` 0 and 1, under
``jax.set_mesh`` and inside a user's ``shard_map``; and the messages of bad input.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf

E, H, KV, HD = 16, 4, 2, 8
TOL = 2e-5
RULES = (("batch", "data"), ("embed", None), ("heads", "tensor"), ("kv", None))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, "data"), (2, "tensor"))


def ub(**kw):
    return dict(axis_name="tensor", impl="ub", seq_axis=1) | kw


def _calls(fn, *args) -> list[str]:
    return re.findall(r"custom_call @(jax_ub_\w+)", jax.jit(fn).lower(*args).as_text())


@pytest.mark.parametrize("length", [8, 5])  # tp divides it: sequence-parallel; else replicated
def test_nnx_column_and_row_match_linear_general(rand, mesh, length):
    """q [embed] -> [heads, head_dim] and o [heads, head_dim] -> [embed], built and called
    as nnx.LinearGeneral: same params (same rngs), same outputs and gradients."""
    x = rand(2, length, E)
    with jax.set_mesh(mesh):
        q = ubf.ColumnParallelLinear(E, (H, HD), rngs=nnx.Rngs(0), **ub())
        o = ubf.RowParallelLinear((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(1), **ub())
    q_ref = nnx.LinearGeneral(E, (H, HD), rngs=nnx.Rngs(0))
    o_ref = nnx.LinearGeneral((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(1))
    for ours, ref in ((q, q_ref), (o, o_ref)):
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(getattr(ours, name)[...], getattr(ref, name)[...])
    assert q.kernel[...].sharding.spec == P(None, "tensor", None)
    assert o.kernel[...].sharding.spec == P("tensor", None, None)
    assert q.bias[...].sharding.spec == P("tensor", None)

    def loss(models, x):
        q, o = models
        return jnp.sum(jnp.tanh(o(jnp.tanh(q(x)))) ** 2)

    with jax.set_mesh(mesh):
        got = nnx.jit(nnx.value_and_grad(loss))((q, o), x)
        assert _calls(lambda m, x: loss(nnx.merge(*m), x), nnx.split((q, o)), x)
    want = nnx.value_and_grad(loss)((q_ref, o_ref), x)
    assert rel_err(got[0], want[0]) < TOL
    for a, b in zip(jax.tree.leaves(nnx.state(got[1])), jax.tree.leaves(nnx.state(want[1]))):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("seq_axis", [0, 1])
def test_linen_matches_dense_general(rand, mesh, seq_axis):
    """linen: the same param tree and values as nn.DenseGeneral, outputs and gradients,
    with the user's logical partitioning (kernel_init) placed by the rules."""
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
    o_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("heads", "kv", "embed"))

    class Block(nn.Module):
        column: type
        row: type
        kw: dict

        @nn.compact
        def __call__(self, x):
            h = self.column((H, HD), kernel_init=init, name="q", **self.kw)(x)
            return self.row(E, axis=(-2, -1), kernel_init=o_init, name="o", **self.kw)(jnp.tanh(h))

    ours = Block(ubf.linen.ColumnParallelLinear, ubf.linen.RowParallelLinear, ub(seq_axis=seq_axis))
    ref = Block(nn.DenseGeneral, nn.DenseGeneral, {})
    x = rand(8, 2, E) if seq_axis == 0 else rand(2, 8, E)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        variables = ours.init(jax.random.key(0), x)
        specs = nn.get_partition_spec(variables)["params"]
        loss = lambda v, x: jnp.sum(ours.apply(v, x) ** 2)  # noqa: E731
        got = jax.jit(jax.value_and_grad(loss))(variables, x)
        calls = set(_calls(loss, variables, x))
    assert {"jax_ub_all_gather_matmul", "jax_ub_matmul_reduce_scatter"} <= calls, calls
    ref_vars = ref.init(jax.random.key(0), x)
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), nn.unbox(variables), nn.unbox(ref_vars))
    assert all(jax.tree.leaves(same)), same
    assert specs["q"]["kernel"] == P("embed", "heads", "kv")  # logical names, as given
    with nn.logical_axis_rules(RULES):
        mesh_specs = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    assert mesh_specs["q"]["kernel"].spec == P(None, "tensor", None)
    want = jax.value_and_grad(lambda v, x: jnp.sum(ref.apply(v, x) ** 2))(nn.unbox(ref_vars), x)
    assert rel_err(got[0], want[0]) < TOL
    for a, b in zip(jax.tree.leaves(nn.unbox(got[1])), jax.tree.leaves(want[1])):
        assert rel_err(a, b) < TOL


def test_project_gathers_once(rand, mesh):
    """q, k and v with their own kernels from one all-gather of x: each equal to its own
    einsum, gradients too; one all_gather_matmul forward."""
    with jax.set_mesh(mesh):
        layers = [
            ubf.ColumnParallelLinear(E, (n, HD), rngs=nnx.Rngs(i), **ub())
            for i, n in enumerate((H, KV, KV))
        ]
    x = rand(2, 8, E)

    def loss(layers, x):
        return sum(jnp.sum(jnp.sin(y)) for y in ubf.nnx.project(x, *layers))

    def ref_loss(layers, x):
        ys = [jnp.einsum("bse,ehd->bshd", x, m.kernel[...]) + m.bias[...] for m in layers]
        return sum(jnp.sum(jnp.sin(y)) for y in ys)

    with jax.set_mesh(mesh):
        got = nnx.jit(nnx.value_and_grad(loss))(layers, x)
        graph, state = nnx.split(layers)
        calls = _calls(lambda s, x: loss(nnx.merge(graph, s), x), state, x)
    assert calls.count("jax_ub_all_gather_matmul") == 1, calls
    want = nnx.value_and_grad(ref_loss)(layers, x)
    assert rel_err(got[0], want[0]) < TOL
    for a, b in zip(jax.tree.leaves(nnx.state(got[1])), jax.tree.leaves(nnx.state(want[1]))):
        assert rel_err(a, b) < TOL


def test_project_under_plain_jit_with_no_mesh_set(rand, mesh):
    """The unchanged loop of a model jitted on sharded params, no mesh set (as flax's own
    layers allow): project and the row layer find the mesh from the params' shardings and
    run jax_ub's calls; values and gradients as plain unsharded JAX's."""
    with jax.set_mesh(mesh):
        qkv = [
            ubf.ColumnParallelLinear(E, (n, HD), rngs=nnx.Rngs(i), **ub(impl="auto"))
            for i, n in enumerate((H, KV, KV))
        ]
        o = ubf.RowParallelLinear((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(9), **ub())
    graph, state = nnx.split((qkv, o))
    x = rand(2, 8, E)

    def loss(state, x):
        qkv, o = nnx.merge(graph, state)
        q, k, v = ubf.nnx.project(x, *qkv)
        kv = jnp.repeat(jnp.tanh(k) + v, H // KV, axis=2)
        return jnp.sum(jnp.sin(o(q * kv)))

    def plain(state, x):
        (qkv, o) = nnx.merge(graph, state)
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, m.kernel[...]) + m.bias[...] for m in qkv)
        kv = jnp.repeat(jnp.tanh(k) + v, H // KV, axis=2)
        y = jnp.einsum("bshd,hde->bse", q * kv, o.kernel[...]) + o.bias[...]
        return jnp.sum(jnp.sin(y))

    assert jax.sharding.get_abstract_mesh().empty
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    got = step(state, x)
    calls = _calls(loss, state, x)
    assert calls.count("jax_ub_all_gather_matmul") == 1, calls
    assert calls.count("jax_ub_matmul_reduce_scatter") == 1, calls
    want = jax.value_and_grad(plain, argnums=(0, 1))(state, x)
    assert rel_err(got[0], want[0]) < TOL
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("partial_auto", [False, True], ids=["all_manual", "partial_auto"])
def test_inside_shard_map(rand, mesh, partial_auto, check_vma):
    """On local shards in the user's shard_map (every axis manual, or "tensor" alone), with
    check_vma on and off: q, k, v from one gather (project), the attention-like product,
    the row layer back; values and gradients (params and input) as plain unsharded JAX's."""
    with jax.set_mesh(mesh):
        qkv = [
            ubf.ColumnParallelLinear(E, (n, HD), rngs=nnx.Rngs(i), **ub())
            for i, n in enumerate((H, H, H))
        ]
        o = ubf.RowParallelLinear((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(9), **ub())
    graph, state = nnx.split((qkv, o))
    x = rand(2, 8, E)

    def body(state, x):
        qkv, o = nnx.merge(graph, state)
        q, k, v = ubf.nnx.project(x, *qkv)
        return o(q * jnp.tanh(k) + v)

    def plain(state, x):
        (qkv, o) = nnx.merge(graph, state)
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, m.kernel[...]) + m.bias[...] for m in qkv)
        return jnp.einsum("bshd,hde->bse", q * jnp.tanh(k) + v, o.kernel[...]) + o.bias[...]

    specs = nnx.get_partition_spec(state)
    kw = dict(axis_names={"tensor"}) if partial_auto else {}
    batch = None if partial_auto else "data"
    f = jax.shard_map(
        body, mesh=mesh, in_specs=(specs, P(batch, "tensor")), out_specs=P(batch, "tensor"),
        check_vma=check_vma, **kw,
    )  # fmt: skip
    loss = lambda f: lambda s, x: jnp.sum(jnp.sin(f(s, x)))  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1)))(state, x)
    want = jax.value_and_grad(loss(plain), argnums=(0, 1))(state, x)
    assert rel_err(got[0], want[0]) < TOL
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert rel_err(a, b) < TOL


def test_rules_without_the_split_name_warn(rand, mesh):
    """Rules that map none of a kernel's split candidates say which name is missing."""
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "n_heads", "kv"))
    with nnx.logical_axis_rules(RULES), pytest.warns(UserWarning, match="named 'n_heads'"):
        ubf.ColumnParallelLinear(E, (H, HD), kernel_init=init, rngs=nnx.Rngs(0), impl="xla")
    with nnx.logical_axis_rules(RULES + (("n_heads", "tensor"),)):
        layer = ubf.ColumnParallelLinear(E, (H, HD), kernel_init=init, rngs=nnx.Rngs(0))
    assert layer.axis_name == "tensor" and layer.projection.split == 1
    # nnx.LinearGeneral's kernel_metadata names them too.
    with nnx.logical_axis_rules(RULES):
        names = {"out_sharding": ("embed", "heads", "kv")}
        layer = ubf.ColumnParallelLinear(E, (H, HD), kernel_metadata=names, rngs=nnx.Rngs(0))
    assert layer.axis_name == "tensor" and layer.projection.split == 1
    unnamed = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None, None))
    with pytest.warns(UserWarning, match=r"name none of the dims it splits .*dim 1"):
        ubf.ColumnParallelLinear(E, (H, HD), kernel_init=unnamed, rngs=nnx.Rngs(0), impl="xla")


def test_bad_shapes_are_named(rand, mesh):
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"axis=\(1, 2\) counts from the front"):
        ubf.RowParallelLinear((H, HD), E, axis=(1, 2), rngs=rngs)
    with pytest.raises(ValueError, match=r"axis=\(-1, -2\) must be the input's last 2 dims"):
        ubf.RowParallelLinear((H, HD), E, axis=(-1, -2), rngs=rngs)
    with pytest.raises(ValueError, match="same length"):
        ubf.RowParallelLinear((H, HD), E, rngs=rngs)
    with pytest.raises(ValueError, match=r"out_features\[0\]=3 must be a positive multiple"):
        ubf.ColumnParallelLinear(E, (3, HD), mesh=mesh, axis_name="tensor", rngs=rngs)
    with jax.set_mesh(mesh):
        q = ubf.ColumnParallelLinear(E, (H, HD), rngs=rngs, **ub())
        o = ubf.RowParallelLinear((H, HD), E, axis=(-2, -1), rngs=rngs, **ub())
        with pytest.raises(ValueError, match=r"input has \(4, 4\) features \(last 2 dims\)"):
            o(rand(2, 8, H, 4))
        with pytest.raises(ValueError, match="a row-parallel layer runs alone"):
            ubf.nnx.project(rand(2, 8, E), q, o)
        k = ubf.ColumnParallelLinear(E, (KV, HD), rngs=rngs, **ub(fp8="delayed"))
        with pytest.raises(ValueError, match="same input features and settings"):
            ubf.nnx.project(rand(2, 8, E), q, k)
