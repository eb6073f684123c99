"""The linen layers called inside a user's shard_map over the tensor-parallel axis, on
local shards (params as nn.get_partition_spec places them, unboxed), as the NNX layers are:
the values and gradients of the same layers called on global arrays."""

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import jax_ub.flax.linen as ul

X = (8, 4, 16)  # [seq, batch, features]
CASES = {
    "column": (lambda: ul.ColumnParallelLinear(32), X, P("tp"), P(None, None, "tp")),
    "row": (lambda: ul.RowParallelLinear(16), (8, 4, 32), P(None, None, "tp"), P("tp")),
    "mlp": (lambda: ul.ParallelMLP(32), X, P("tp"), P("tp")),
    "gated": (lambda: ul.ParallelGatedMLP(32), X, P("tp"), P("tp")),
}


@pytest.mark.parametrize("case", CASES)
def test_linen_layers_on_local_shards(case):
    make, shape, x_spec, y_spec = CASES[case]
    layer, mesh = make(), make_mesh((2, "tp"))
    x = jax.random.normal(jax.random.key(1), shape)
    with jax.set_mesh(mesh):
        boxed = layer.init(jax.random.key(0), x)
        variables, specs = nn.meta.unbox(boxed), nn.get_partition_spec(boxed)
        f = jax.shard_map(layer.apply, mesh=mesh, in_specs=(specs, x_spec), out_specs=y_spec)
        loss = lambda f: lambda v, x: jnp.sum(jnp.sin(f(v, x)))  # noqa: E731
        got = jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1)))(variables, x)
        want = jax.jit(jax.value_and_grad(loss(layer.apply), argnums=(0, 1)))(variables, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5, case


def test_a_whole_kernel_on_local_shards_is_named():
    """The kernel given whole (in_specs P()) where the layer runs on local shards: an error
    naming the local shape it needs, not a product of the wrong width."""
    layer, mesh = ul.ColumnParallelLinear(32), make_mesh((2, "tp"))
    x = jax.random.normal(jax.random.key(1), X)
    with jax.set_mesh(mesh):
        variables = nn.meta.unbox(layer.init(jax.random.key(0), x))
        f = jax.shard_map(layer.apply, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P("tp"))
        want = r"kernel is the local shard \(16, 16\).*got \(16, 32\)"
        with pytest.raises(ValueError, match=want):
            jax.jit(f)(variables, x)
