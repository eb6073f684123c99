"""matmul_all_reduce on CPU devices: values and gradients against psum(x @ w), the rows
that tp does not divide, both sequence layouts, global arrays, the HLO, impl="auto"'s
choice and bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh, rel_err, smap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub

K, N = 64, 48


def _sum_over_tp(x, w, b):
    """The unsharded layer: x [..., K] @ w [K, N] + b, at full float32 precision."""
    return jnp.einsum("...k,kn->...n", x, w, precision="highest") + b


def _call(mesh, impl, ndim, seq_axis=0):
    spec = P(*([None] * (ndim - 1)), "tp")

    def f(x, w, b):
        return jax_ub.matmul_all_reduce(x, w, "tp", bias=b, impl=impl, seq_axis=seq_axis)

    return smap(f, mesh, (spec, P("tp", None), P()), P())


@pytest.mark.parametrize("impl", ["ub", "xla", "auto"])
@pytest.mark.parametrize(
    "rows, seq_axis",
    [((8,), 0), ((1,), 0), ((7,), 0), ((6, 4), 0), ((4, 3), 1), ((4, 1), 1)],
)
def test_values_and_grads_equal_the_unsharded_layer(rand, impl, rows, seq_axis):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w, b = rand(*rows, K), rand(K, N), rand(N)
    f = _call(mesh, impl, x.ndim, seq_axis)
    assert rel_err(f(x, w, b), _sum_over_tp(x, w, b)) < 1e-5

    def loss(fn):
        return lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b)))

    got = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(_sum_over_tp), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("impl", ["ub", "auto", "xla"])
def test_no_rows(rand, impl):
    """An empty sequence sums nothing: [0, n] out, gradients as psum(x @ w)'s (XLA's dot,
    whatever the impl; ub's reduce-scatter failed on the empty all-gather)."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w, b = jnp.zeros((0, K)), rand(K, N), rand(N)
    f = _call(mesh, impl, x.ndim)
    assert f(x, w, b).shape == (0, N)
    loss = lambda fn: lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b)))  # noqa: E731
    got = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(_sum_over_tp), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(got, want):
        assert g.shape == r.shape and bool(jnp.all(g == r))


def test_bfloat16(rand):
    mesh = make_mesh((4, "tp"))
    x, w, b = (a.astype(jnp.bfloat16) for a in (rand(16, 2, K), rand(K, N), rand(N)))
    y = _call(mesh, "ub", 3)(x, w, b)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, _sum_over_tp(x.astype(jnp.float32), w.astype(jnp.float32), b)) < 2e-2


def test_hlo_scatters_in_the_op_and_gathers_in_xla(rand):
    mesh = make_mesh((2, "tp"))
    x, w, b = rand(8, K), rand(K, N), rand(N)
    hlo = _call(mesh, "ub", 2).lower(x, w, b).compile().as_text()
    assert 'custom_call_target="jax_ub_matmul_reduce_scatter"' in hlo
    assert " all-gather(" in hlo and " all-reduce(" not in hlo
    hlo = _call(mesh, "xla", 2).lower(x, w, b).compile().as_text()
    assert 'custom_call_target="jax_ub_' not in hlo and " all-reduce(" in hlo
    # the backward communicates nothing: dy is the same on every rank
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(_call(mesh, "ub", 2)(x, w, b) ** 2), (0, 1)))
    backward_only = grad.lower(x, w).compile().as_text()
    assert backward_only.count("custom_call_target=") == 1  # the forward's


def test_on_global_arrays_under_set_mesh(rand):
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w = rand(6, 4, K), rand(K, N)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "tp")))
        ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
        y = jax.jit(lambda x, w: jax_ub.matmul_all_reduce(x, w, "tp", impl="ub"))(xs, ws)
    assert rel_err(y, _sum_over_tp(x, w, 0.0)) < 1e-5
    # the same on every tp rank (the batch may stay split over dp, as XLA keeps it)
    assert "tp" not in jax.tree.leaves(tuple(y.sharding.spec))


def test_auto_takes_xla_where_tp_does_not_divide_the_rows(rand):
    mesh = make_mesh((2, "tp"))
    x, w, b = rand(3, K), rand(K, N), rand(N)
    # (the custom call's name: the text may hold paths with "jax_ub" in them)
    assert "custom_call @jax_ub_" not in _call(mesh, "auto", 2).lower(x, w, b).as_text()
    assert "custom_call @jax_ub_" in _call(mesh, "ub", 2).lower(x, w, b).as_text()


def test_explain_impl_counts_both_halves():
    choice = jax_ub.explain_impl("matmul_all_reduce", (8, 4, K), (K, N), jnp.bfloat16, 4)
    # 3/4 of the 32 rows' partial sums scattered in, as many gathered back
    assert choice.comm_bytes == 2 * 3 * 8 * 4 // 4 * N * 2


def test_bad_shapes_name_them(rand):
    mesh = make_mesh((2, "tp"))
    message = r"matmul_all_reduce: contracting dims differ.*x.shape=\(8, 32\) w.shape=\(20, 48\)"
    with pytest.raises(ValueError, match=message):
        _call(mesh, "ub", 2)(rand(8, K), rand(K // 2 + 8, N), rand(N))
