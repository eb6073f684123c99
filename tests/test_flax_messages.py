"""Messages name what the user wrote: a defaulted tensor-parallel axis says it is the
default and how to set it; a logical name the rules do not map is not replicated silently;
a batch that does not split over the data axes is called a batch, not a missing dim."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
from jax_ub._src.settings.warn_registry import clear_warnings


@pytest.fixture(autouse=True)
def _fresh_warnings():
    clear_warnings()
    yield
    clear_warnings()


def test_default_axis_not_in_mesh_says_it_is_the_default(rand):
    mesh = make_mesh((2, "data"), (1, "fsdp"), (2, "tensor"))
    layer = ubf.linen.RowParallelLinear(16, impl="ub")
    x = rand(8, 2, 16)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as err:
        layer.init(jax.random.key(0), x)
    text = str(err.value)
    assert "RowParallelLinear: axis_name 'tp' is not an axis of the mesh" in text
    assert "'tp' is the default" in text and "axis_name=" in text, text
    assert "('data', 'fsdp', 'tensor')" in text


def test_arrays_on_a_mesh_without_the_axis_name_it_eager_as_under_set_mesh(rand):
    """Arrays sharded over a mesh that lacks the layer's axis: the same error with no mesh
    set as under jax.set_mesh (not the plain layer with a no-mesh warning)."""
    from flax import nnx  # noqa: PLC0415

    mesh = make_mesh((2, "data"))
    layer = ubf.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    x = jax.device_put(rand(8, 16), NamedSharding(mesh, P("data")))
    for context in (jax.set_mesh(mesh), warnings.catch_warnings()):
        with context, pytest.raises(ValueError, match="axis_name 'tp' is not an axis of the mesh"):
            layer(x)


def test_no_mesh_warning_says_the_axis_is_the_default(rand):
    mlp = ubf.linen.ParallelMLP(32)
    x = rand(8, 2, 16)
    with pytest.warns(UserWarning, match="'tp' is the default"):
        mlp.init(jax.random.key(0), x)


# The init runs with no mesh: the once-per-process no-mesh warning may come too.
@pytest.mark.filterwarnings("ignore:jax_ub.flax. a layer was traced with no mesh set")
@pytest.mark.parametrize("rules", [None, (("embed", None), ("heads", "tensor"))])
def test_unmapped_logical_name_warns(rand, rules):
    """lm1b's attention names its kernels ('embed', 'kv'); rules without 'kv' (or none at
    all) would leave the params unsplit: a warning names 'kv' and what to do."""
    layer = ubf.linen.ColumnParallelLinear(32, kernel_axes=("embed", "kv"))
    x = rand(8, 2, 16)
    with pytest.warns(UserWarning, match="split dim is named 'kv'") as record:
        if rules is None:
            layer.init(jax.random.key(0), x)
        else:
            with nn.logical_axis_rules(rules):
                layer.init(jax.random.key(0), x)
    text = str(record[0].message)
    assert ("no logical axis rules are active" if rules is None else "map 'kv' to no") in text


def test_mapped_logical_name_does_not_warn(rand):
    mesh = make_mesh((2, "tensor"))
    layer = ubf.linen.ColumnParallelLinear(32, kernel_axes=("embed", "mlp"), impl="ub")
    x = rand(8, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.set_mesh(mesh), nn.logical_axis_rules((("embed", None), ("mlp", "tensor"))):
            layer.init(jax.random.key(0), x)


def test_batch_that_does_not_split_is_called_a_batch(rand):
    """A per-step batch of 1 on a (dp=2, tp=2) mesh: its batch dim exists but does not
    divide over dp; the warning says so (values stay right)."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = jax.device_put(rand(8, 1, 16), NamedSharding(mesh, P("tp")))
    w = jax.device_put(rand(16, 8), NamedSharding(mesh, P(None, "tp")))
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match=r"batch dims \(1,\)") as record:
        y = jax.jit(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"))(x, w)
    assert "has no batch dim" not in str(record[0].message)
    assert jnp.allclose(y, jnp.einsum("sbk,kn->sbn", x, w), rtol=1e-5, atol=1e-5)
