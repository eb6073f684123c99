"""The ops and the Flax layers inside real model layouts, on CPU devices.

Meshes of several axes (dp, fsdp, tp) where only the tensor-parallel axis is the op's:
partial-auto shard_map (tp manual, the rest XLA's), plain jit on global arrays under
jax.set_mesh, and Flax layers called both ways. Every result is compared with the same
math written with lax collectives or plain jnp, forward and gradients.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf

# (sizes, names) of the meshes; the ops always run over "tp".
MESHES = {
    "dp2_tp2": ((2, 2), ("dp", "tp")),
    "fsdp2_tp2": ((2, 2), ("fsdp", "tp")),
    "dp2_fsdp2_tp2": ((2, 2, 2), ("dp", "fsdp", "tp")),
    "dp4_tp2": ((4, 2), ("dp", "tp")),
    "dp2_tp4": ((2, 4), ("dp", "tp")),
    "dp2_tp1": ((2, 1), ("dp", "tp")),  # a group of one: a plain matmul per dp shard
}
SEQ, BATCH, D, H = 16, 8, 16, 32
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)")


def mesh_of(name: str):
    sizes, names = MESHES[name]
    return make_mesh(*zip(sizes, names))


def batch_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a != "tp")


def operands(rand, mesh):
    """x [seq, batch, d] sequence-split over tp, batch over the other axes; w1 [d, h]
    column-split (its rows over fsdp where the mesh has it), w2 [h, d] row-split."""
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", batch_axes(mesh))))
    w1 = jax.device_put(rand(D, H, scale=0.3), NamedSharding(mesh, P(fsdp, "tp")))
    w2 = jax.device_put(rand(H, D, scale=0.3), NamedSharding(mesh, P("tp", fsdp)))
    return x, w1, w2


def mlp_reference(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def loss_and_grads(f, *args):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(*args)


def check_against_reference(f, x, w1, w2):
    y = jax.jit(f)(x, w1, w2)
    assert rel_err(y, mlp_reference(x, w1, w2)) < 1e-5
    (loss, grads), (loss_ref, grads_ref) = (
        loss_and_grads(f, x, w1, w2),
        loss_and_grads(mlp_reference, x, w1, w2),
    )
    assert rel_err(loss, loss_ref) < 1e-5
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 1e-5
    return y


def partial_auto_mlp(mesh, impl):
    """The MLP written by hand in a shard_map over tp alone, the rest left to XLA."""

    def body(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl=impl))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl=impl)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
        out_specs=P("tp"),
        axis_names={"tp"},
    )


def global_mlp(impl):
    def f(x, w1, w2):
        h = jnp.tanh(jax_ub.all_gather_matmul(x, w1, "tp", impl=impl))
        return jax_ub.matmul_reduce_scatter(h, w2, "tp", impl=impl)

    return f


@pytest.mark.parametrize("impl", ["ub", "xla"])
@pytest.mark.parametrize("name", list(MESHES))
def test_partial_auto_shard_map(rand, name, impl):
    mesh = mesh_of(name)
    x, w1, w2 = operands(rand, mesh)
    y = check_against_reference(partial_auto_mlp(mesh, impl), x, w1, w2)
    assert y.sharding.spec == P("tp", batch_axes(mesh)) or y.sharding.spec[1] == (
        batch_axes(mesh)[0] if len(batch_axes(mesh)) == 1 else batch_axes(mesh)
    ), y.sharding


@pytest.mark.parametrize("impl", ["ub", "xla"])
@pytest.mark.parametrize("name", list(MESHES))
def test_plain_jit_under_set_mesh(rand, name, impl):
    mesh = mesh_of(name)
    x, w1, w2 = operands(rand, mesh)
    with jax.set_mesh(mesh):
        check_against_reference(global_mlp(impl), x, w1, w2)


def test_one_jitted_function_on_meshes_of_one_shape(rand):
    """One jitted forward and training step, called under (dp, tp) meshes of one shape: the
    devices reversed, other devices, the grid transposed, and back. JAX reuses a program's
    lowering for another device assignment unless a primitive in it needs the devices;
    jax_ub's calls bake their group's devices, in order, into it, so each assignment is
    lowered again (the reversed mesh gave wrong numbers before)."""
    grid = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    names = ("dp", "tp")
    meshes = [
        Mesh(grid[0], names),
        Mesh(grid[0][::-1, ::-1], names),
        Mesh(grid[1], names),
        Mesh(grid[0].T, names),
        Mesh(grid[0], names),
    ]
    x, w1, w2 = rand(SEQ, BATCH, D), rand(D, H, scale=0.3), rand(H, D, scale=0.3)
    f = jax.jit(global_mlp("ub"))
    step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(global_mlp("ub")(*a) ** 2), (0, 1, 2)))
    want_y = mlp_reference(x, w1, w2)
    want_loss, want_grads = loss_and_grads(mlp_reference, x, w1, w2)
    for mesh in meshes:
        with jax.set_mesh(mesh):  # uncommitted operands: the computation takes the mesh's devices
            y = f(x, w1, w2)
            loss, grads = step(x, w1, w2)
        where = [d.id for d in mesh.devices.flat]
        assert rel_err(y, want_y) < 1e-5, where
        assert rel_err(loss, want_loss) < 1e-5, where
        for g, r in zip(grads, want_grads):
            assert rel_err(g, r) < 1e-5, where


def test_eager_global_arrays(rand):
    """Concrete global arrays need no mesh context: their sharding names it."""
    mesh = mesh_of("dp2_tp2")
    x, w1, w2 = operands(rand, mesh)
    y = global_mlp("ub")(x, w1, w2)
    assert rel_err(y, mlp_reference(x, w1, w2)) < 1e-5


def test_forward_hlo_has_no_collective_over_dp(rand):
    """(dp, tp) forward, weights replicated over dp: the only communication left in the
    compiled program is jax_ub's; activations are not gathered over dp."""
    mesh = mesh_of("dp2_tp2")
    x, w1, w2 = operands(rand, mesh)
    f = jax.jit(partial_auto_mlp(mesh, "ub"))
    hlo = f.lower(x, w1, w2).compile().as_text()
    assert "jax_ub_all_gather_matmul" in hlo and "jax_ub_matmul_reduce_scatter" in hlo
    assert not COLLECTIVE.findall(hlo), COLLECTIVE.findall(hlo)
    with jax.set_mesh(mesh):
        hlo = jax.jit(global_mlp("ub")).lower(x, w1, w2).compile().as_text()
    assert "jax_ub_all_gather_matmul" in hlo and not COLLECTIVE.findall(hlo)


@pytest.mark.parametrize("name", ["dp2_tp1", "dp2_tp2"])
def test_no_empty_array_crosses_the_nested_shard_map(rand, name):
    """The shard_map the lowering nests over the automatic axes carries no empty array
    (the absent bias and GELU input, the unrequested gathered x): XLA's GPU compiler turns
    those into constants before Shardy runs, and Shardy then crashes on the manual
    computation's unused inputs (tests/test_gpu_layouts.py)."""
    mesh = mesh_of(name)
    x, w1, w2 = operands(rand, mesh)
    with jax.set_mesh(mesh):
        f = jax.value_and_grad(lambda *a: jnp.sum(global_mlp("ub")(*a) ** 2), argnums=(0, 1, 2))
        text = jax.jit(f).lower(x, w1, w2).as_text()
    computations = [line for line in text.splitlines() if "sdy.manual_computation(" in line]
    assert computations, "expected the lowering's nested shard_map"
    for line in computations:
        assert not re.search(r"tensor<0x|x0x", line), line


def test_fsdp_weights_are_gathered_by_xla(rand):
    """(fsdp, tp): XLA gathers the fsdp-split weights; the activations stay put."""
    mesh = mesh_of("fsdp2_tp2")
    x, w1, w2 = operands(rand, mesh)
    hlo = jax.jit(partial_auto_mlp(mesh, "ub")).lower(x, w1, w2).compile().as_text()
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathers, "the fsdp-split weights must be gathered"
    # Each gather produces a local weight block ([D, H/tp] or [H/tp, D]), never activations.
    shapes = {re.search(r"= \w+\[([\d,]+)\]", line).group(1) for line in gathers}
    assert shapes <= {f"{D},{H // 2}", f"{H // 2},{D}"}, shapes


def test_explicit_axes_like_lax(rand):
    """Explicit axes: the ops work wherever the lax collectives do (batch replicated)."""
    mesh = jax.make_mesh(
        (2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
    )
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp")))
    w1 = jax.device_put(rand(D, H, scale=0.3), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(rand(H, D, scale=0.3), NamedSharding(mesh, P("tp", None)))
    expected = mlp_reference(*(np.asarray(a) for a in (x, w1, w2)))
    with jax.set_mesh(mesh):
        for impl in ("ub", "xla"):
            y = jax.jit(global_mlp(impl))(x, w1, w2)
            assert rel_err(y, expected) < 1e-5


def test_explicit_axes_with_the_batch_split_over_dp(rand):
    """Explicit axes, the batch split over dp: forward and gradients of plain JAX (lax's
    collectives fail here, gap 7). The weight gradients' products sum over the explicit dp
    split, which JAX has them name their output's sharding for."""
    mesh = jax.make_mesh(
        (2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
    )
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", "dp")))
    w1 = jax.device_put(rand(D, H, scale=0.3), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(rand(H, D, scale=0.3), NamedSharding(mesh, P("tp", None)))
    plain = [np.asarray(a) for a in (x, w1, w2)]
    want_loss, want_grads = loss_and_grads(mlp_reference, *plain)
    with jax.set_mesh(mesh):
        y = jax.jit(global_mlp("ub"))(x, w1, w2)
        loss, grads = loss_and_grads(global_mlp("ub"), x, w1, w2)
    assert rel_err(y, mlp_reference(*plain)) < 1e-5
    assert rel_err(loss, want_loss) < 1e-5
    for g, r in zip(grads, want_grads):
        assert rel_err(g, r) < 1e-5


def test_wrong_global_layout_names_both_shardings(rand):
    mesh = mesh_of("dp2_tp2")
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P(None, "dp")))  # seq not on tp
    w = jax.device_put(rand(D, H), NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(
        ValueError,
        match=r"x of shape \(16, 8, 16\) must be sharded "
        r"P\('tp', None, None\) over axis 'tp', but it is sharded P\(None, 'dp'\)",
    ):
        jax_ub.all_gather_matmul(x, w, "tp")
    with pytest.raises(ValueError, match=r"axis 'model' is not in the mesh"):
        with jax.set_mesh(mesh):
            jax.jit(lambda x, w: jax_ub.all_gather_matmul(x, w, "model"))(x, w)
    with pytest.raises(ValueError, match=r"return_gathered is for calls inside shard_map"):
        jax_ub.all_gather_matmul(x, w, "tp", return_gathered=True)


# --- Flax layers -------------------------------------------------------------------------


class NnxReference(nnx.Module):
    """The same MLP as a plain Flax model: nnx.Linear, no communication written."""

    def __init__(self, mlp: ubf.ParallelMLP):
        self.w1, self.b1 = mlp.up_proj.kernel[...], mlp.up_proj.bias[...]
        self.w2, self.b2 = mlp.down_proj.kernel[...], mlp.down_proj.bias[...]

    def __call__(self, x):
        return (jax.nn.gelu(x @ self.w1 + self.b1)) @ self.w2 + self.b2


def _grads(model, x):
    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    return nnx.jit(nnx.value_and_grad(loss))(model, x)


@pytest.mark.parametrize("name", ["dp2_tp2", "dp2_fsdp2_tp2"])
def test_nnx_layers_from_jit_keep_batch_sharding(rand, name):
    mesh = mesh_of(name)
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    with jax.set_mesh(mesh):
        # Created sharded under jit, no mesh argument: the params' metadata places them.
        mlp = nnx.jit(lambda: ubf.ParallelMLP(D, H, param_axes=fsdp, impl="ub", rngs=nnx.Rngs(0)))()
        assert nnx.get_partition_spec(nnx.state(mlp))["up_proj"]["kernel"].get_value() == P(
            fsdp, "tp"
        )
        assert mlp.up_proj.kernel[...].sharding.spec == P(fsdp, "tp")
        x = jax.device_put(rand(SEQ, BATCH, D), P("tp", batch_axes(mesh)))
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
        assert y.sharding.spec[1] is not None, y.sharding  # batch still split
        ref = NnxReference(mlp)
        assert rel_err(y, ref(x)) < 1e-5
        loss, grads = _grads(mlp, x)
        hlo = nnx.jit(lambda m, x: m(x)).lower(mlp, x).compile().as_text()
    ref_grads = jax.grad(
        lambda w1, b1, w2, b2: jnp.sum((jax.nn.gelu(x @ w1 + b1) @ w2 + b2) ** 2),
        argnums=(0, 1, 2, 3),
    )(ref.w1, ref.b1, ref.w2, ref.b2)
    got = (
        grads["up_proj"]["kernel"][...],
        grads["up_proj"]["bias"][...],
        grads["down_proj"]["kernel"][...],
        grads["down_proj"]["bias"][...],
    )
    for g, r in zip(got, ref_grads):
        assert rel_err(g, r) < 1e-5
    # Activations are never gathered: any all-gather left is of a weight (fsdp).
    for line in hlo.splitlines():
        if " all-gather(" in line:
            assert re.search(r"= \w+\[(\d+),(\d+)\]", line), line


def test_nnx_layer_inside_user_shard_map(rand):
    """Inside the user's shard_map over tp, the layer runs on the local shards it is given,
    with no mesh argument, like nnx.Linear."""
    mesh = mesh_of("dp2_tp2")
    with jax.set_mesh(mesh):
        mlp = ubf.ParallelMLP(D, H, impl="ub", rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(mlp)
    specs = nnx.get_partition_spec(state)

    def body(state, x):
        return nnx.merge(graphdef, state)(x)

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P("tp", "dp")), out_specs=P("tp", "dp"))
    )
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", "dp")))
    y = f(state, x)
    assert rel_err(y, NnxReference(mlp)(x)) < 1e-5


def test_no_mesh_set_finds_it_from_sharded_arrays(rand):
    """A model jitted on arrays sharded over a mesh, with no mesh set or given (a training
    loop's jit with in_shardings, no jax.set_mesh): the layers find the mesh in the arrays'
    types and its devices where the program lowers, and run jax_ub's calls, no warning."""
    mesh = mesh_of("dp2_tp2")
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", "dp")))
    mlp = ubf.ParallelMLP(D, H, rngs=nnx.Rngs(0))  # built with no mesh: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = nnx.jit(lambda m, x: m(x))
        y = step(mlp, x)
    up, down = mlp.up_proj, mlp.down_proj
    h = jax.nn.gelu(np.asarray(x) @ up.kernel[...] + up.bias[...])
    assert rel_err(y, h @ down.kernel[...] + down.bias[...]) < 1e-5
    text = jax.jit(lambda x: mlp(x)).lower(x).as_text()
    assert "jax_ub_all_gather_matmul" in text and "jax_ub_matmul_reduce_scatter" in text
    linen_mlp = ubf.linen.ParallelMLP(H, impl="ub")
    with jax.set_mesh(mesh):
        variables = jax.jit(linen_mlp.init)(jax.random.key(0), x)
    apply = jax.jit(linen_mlp.apply)  # no mesh set: the params' and x's types carry it
    assert "jax_ub_matmul_reduce_scatter" in apply.lower(variables, x).as_text()
    assert rel_err(apply(variables, x), linen_mlp.apply(variables, x)) < 1e-5


def test_no_mesh_anywhere_runs_plain_matmuls_or_names_the_remedy(rand):
    """Arrays that carry no mesh (uncommitted) and none set or given: impl="auto" runs
    XLA's plain matmuls, with one warning; impl="ub" says how to give a mesh."""
    x = rand(SEQ, BATCH, D)
    mlp = ubf.ParallelMLP(D, H, rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match="no mesh set .* not overlapped"):
        y = nnx.jit(lambda m, x: m(x))(mlp, x)
    up, down = mlp.up_proj, mlp.down_proj
    h = jax.nn.gelu(np.asarray(x) @ up.kernel[...] + up.bias[...])
    assert rel_err(y, h @ down.kernel[...] + down.bias[...]) < 1e-5
    layer = ubf.ColumnParallelLinear(D, H, impl="ub", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no mesh to run over.*impl='ub' does not"):
        layer(x)


@pytest.mark.parametrize("name", ["dp2_tp2", "fsdp2_tp2"])
def test_linen_layers_from_jit(rand, name):
    mesh = mesh_of(name)
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    model = ubf.linen.ParallelMLP(H, param_axes=fsdp, impl="ub")
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", batch_axes(mesh))))
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        specs = nn.get_partition_spec(abstract)
        assert specs["params"]["up_proj"]["kernel"] == P(fsdp, "tp")
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        kernel = variables["params"]["up_proj"]["kernel"].value
        assert kernel.sharding.spec == P(fsdp, "tp")
        y = jax.jit(model.apply)(variables, x)
        grads = jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))(variables, x)
    p = nn.unbox(variables)["params"]
    w1, b1 = p["up_proj"]["kernel"], p["up_proj"]["bias"]
    w2, b2 = p["down_proj"]["kernel"], p["down_proj"]["bias"]

    def ref(w1, b1, w2, b2):
        return jax.nn.gelu(x @ w1 + b1) @ w2 + b2

    assert rel_err(y, ref(w1, b1, w2, b2)) < 1e-5
    ref_grads = jax.grad(lambda *a: jnp.sum(ref(*a) ** 2), argnums=(0, 1, 2, 3))(w1, b1, w2, b2)
    g = nn.unbox(grads)["params"]
    got = (
        g["up_proj"]["kernel"],
        g["up_proj"]["bias"],
        g["down_proj"]["kernel"],
        g["down_proj"]["bias"],
    )
    for a, r in zip(got, ref_grads):
        assert rel_err(a, r) < 1e-5


def test_two_dim_activations_warn_and_stay_correct(rand):
    """[rows, features] activations have no batch dim to keep split over dp: the op runs,
    correct, on the whole batch on each dp device, and says so once."""
    mesh = mesh_of("dp2_tp2")
    x = jax.device_put(rand(SEQ, D), NamedSharding(mesh, P("tp")))
    w = jax.device_put(rand(D, H, scale=0.3), NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=P(None, "tp"),
            axis_names={"tp"},
        )
    )
    with pytest.warns(UserWarning, match=r"no batch dim .* \('dp',\) \(size 2\)"):
        y = f(x, w)
    assert rel_err(y, x @ w) < 1e-5
