"""The plain references of the Flax layer tests: a column- and a row-parallel layer written
with lax collectives, a model's outputs and gradients against its reference's, and an NNX
model called inside a user's shard_map."""

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def assert_trees_close(a, b, **tol):
    """Two pytrees of the same structure, leaf by leaf within ``tol`` (assert_allclose's)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol), a, b)


def assert_matches_reference(got, cache: dict, kind: str, reference, **tol):
    """``got``, a model's ``(y, parameter gradients, x gradient)``, against its reference's,
    ``reference()``, computed once per ``kind`` into ``cache`` (the reference does not
    depend on impl)."""
    if kind not in cache:
        cache[kind] = reference()
    (y, g_params, g_x), (y_ref, g_ref, g_x_ref) = got, cache[kind]
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(g_x, g_x_ref, **tol)
    assert_trees_close(g_params, g_ref, **tol)


def nnx_in_shard_map(model, mesh: Mesh):
    """``(f, state)``: ``f(state, x)`` calls the Flax NNX ``model`` on local shards inside a
    user's shard_map over ``mesh``, its state split as its partition specs say and ``x``
    and the result sequence-sharded over ``"tp"``."""
    from flax import nnx  # here: most test files need no flax

    graphdef, state = nnx.split(model)
    f = jax.shard_map(
        lambda state, x: nnx.merge(graphdef, state)(x),
        mesh=mesh,
        in_specs=(nnx.get_partition_spec(state), P("tp")),
        out_specs=P("tp"),
    )
    return f, state


def _feature_spec(ndim: int) -> P:
    return P(*[None] * (ndim - 1), "tp")


def column_parallel_reference(x, kernel, bias, mesh: Mesh):
    """``all_gather(x) @ kernel + bias`` with explicit lax collectives over ``"tp"`` of
    ``mesh``: the plain reference of a column-parallel layer (``bias`` may be None). ``x``
    is sequence-sharded, ``kernel`` and ``bias`` split by columns; the result is
    feature-sharded."""

    def f(x, k, b):
        y = lax.all_gather(x, "tp", axis=0, tiled=True) @ k
        return y if b is None else y + b

    return jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), None if bias is None else P("tp")),
        out_specs=_feature_spec(x.ndim),
    )(x, kernel, bias)


def row_parallel_reference(h, kernel, bias, mesh: Mesh):
    """``psum_scatter(h @ kernel) + bias`` with explicit lax collectives over ``"tp"`` of
    ``mesh``: the plain reference of a row-parallel layer (``bias`` may be None, else
    replicated). ``h`` is feature-sharded, ``kernel`` split by rows; the result is
    sequence-sharded."""

    def f(h, k, b):
        y = lax.psum_scatter(h @ k, "tp", scatter_dimension=0, tiled=True)
        return y if b is None else y + b

    return jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(_feature_spec(h.ndim), P("tp", None), None if bias is None else P()),
        out_specs=P("tp"),
    )(h, kernel, bias)
