"""``jax.export`` of programs with jax_ub ops: an exported program runs in another process on
devices it names then, so it cannot carry a communicator. impl="auto" exports the unfused
reference (XLA's collectives); impl="ub" fails naming the remedy."""

import jax
import jax.numpy as jnp
import pytest
from _op_cases import OPS, op_call, op_operands, op_specs
from conftest import rel_err
from jax.sharding import NamedSharding

TP = 4


def _loss_and_grads(op, mesh, impl):
    (x_spec, w_spec), out_spec = op_specs(op)

    def loss(x, w):
        out = jax.shard_map(
            lambda x, w: op_call(op)(x, w, "tp", impl=impl),
            mesh=mesh,
            in_specs=(x_spec, w_spec),
            out_specs=out_spec,
        )(x, w)
        return jnp.sum(jnp.sin(out))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (x_spec, w_spec)


@pytest.mark.parametrize("op", OPS)
def test_auto_exports_the_reference(mesh1d, rand, op):
    """The exported loss and gradients equal plain JAX's on the whole arrays."""
    mesh = mesh1d(TP)
    f, specs = _loss_and_grads(op, mesh, "auto")
    x, w = op_operands(rand, op, TP, 4, 16 if op == "ag" else 8, 8)
    x, w = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs))
    exported = jax.export.export(f)(x, w)
    text = exported.mlir_module()
    assert "custom_call @jax_ub" not in text, op
    assert "all_gather" in text or "reduce_scatter" in text, op
    loss, (dx, dw) = exported.call(x, w)
    truth = jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.sin(jnp.dot(x, w, precision="highest"))), argnums=(0, 1)
    )(x, w)
    for got, want in zip((loss, dx, dw), (truth[0], *truth[1])):
        assert rel_err(got, want) < 1e-5, op


@pytest.mark.parametrize("op", OPS)
def test_ub_names_the_remedy(mesh1d, rand, op):
    mesh = mesh1d(TP)
    f, specs = _loss_and_grads(op, mesh, "ub")
    x, w = op_operands(rand, op, TP, 4, 8, 8)
    x, w = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs))
    with pytest.raises(ValueError, match=r"impl='ub' cannot be exported.*impl='auto'"):
        jax.export.export(f)(x, w)


@pytest.mark.parametrize("platforms", [("cuda",), ("cpu", "cuda")])
def test_auto_exports_for_other_platforms(mesh1d, rand, platforms):
    """For a platform this process may not have (a GPU target from a CPU host) and for
    several at once: the reference, with no jax_ub call."""
    mesh = mesh1d(TP)
    f, specs = _loss_and_grads("ag", mesh, "auto")
    x, w = op_operands(rand, "ag", TP, 4, 16, 8)
    x, w = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs))
    exported = jax.export.export(f, platforms=platforms)(x, w)
    assert exported.platforms == platforms
    assert "custom_call @jax_ub" not in exported.mlir_module()
