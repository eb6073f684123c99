"""x gathered again inside the backward's reduce-scatter (``keep_gathered=False``): the
reduce-scatter call that also all-gathers a second input beside its GEMMs, on groups of
every size, folded and not; a rank that gathers beside it while its peer does not; the
buffer it needs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import bits
from conftest import rel_err, smap, to_f32, tol, use_tuning
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.lowering.primitives import bind_matmul_reduce_scatter

pytestmark = pytest.mark.usefixtures("fresh_communicators")


def _rs_and_gather(mesh, n_dev):
    """jit(shard_map): (psum_scatter(x @ w), every rank's all_gather(g) stacked) by one call
    per rank; g laid out as the result, [m, n] per rank."""

    def body(x, w, g):
        out, gathered = bind_matmul_reduce_scatter(x, w, "tp", n_dev, gather=g)
        return out, gathered[None]

    return smap(body, mesh, (P(None, "tp"), P("tp", None), P("tp")), (P("tp"), P("tp")))


@pytest.mark.parametrize("fold", [-1, 0])
@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reduce_scatter_gathers_beside_it(mesh1d, rand, n_dev, fold, dtype):
    """The product reduce-scattered as without the gather, and every rank's gathered copy
    of the second input bit for bit; over several calls (the buffer's third region reused,
    credits and epochs advancing) with fresh data each time. fold=0 folds every group of 2
    (Schedule::ReduceScatterFolds), whose first piece's flag releases the gathered chunk."""
    use_tuning(reduce_scatter_fold_rows=fold)
    jax_ub.finalize()  # the communicator takes the fold setting when created
    mesh, m, k, n = mesh1d(n_dev), 6, 4 * n_dev, 8
    f = _rs_and_gather(mesh, n_dev)
    for call in range(3):
        x, w, g = rand(n_dev * m, k, dtype=dtype), rand(k, n, dtype=dtype), rand(n_dev * m, n)
        g = g.astype(dtype) + call
        out, gathered = f(x, w, g)
        want = to_f32(x) @ to_f32(w)
        assert rel_err(out, want) < tol(dtype), (call, rel_err(out, want))
        assert gathered.shape == (n_dev, *g.shape)
        for copy in np.asarray(gathered):  # every rank's, bit for bit
            np.testing.assert_array_equal(bits(copy), bits(g))


def test_gather_must_be_laid_out_as_the_result(mesh1d, rand):
    """Anything but the result's shape and dtype is refused at trace time, naming both."""
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 2 * 8), rand(2 * 8, 6)
    wrong = [(rand(2 * 4, 5), r"\(4, 5\)"), (rand(2 * 4, 6, dtype=jnp.bfloat16), "bfloat16")]
    for g, what in wrong:
        with pytest.raises(ValueError, match=rf"as its result, \(4, 6\) of float32.*{what}"):
            _rs_and_gather(mesh, 2)(x, w, g)


def test_peer_without_the_gather_is_named(mesh1d, rand):
    """Rank 0 gathers beside its reduce-scatter, rank 1 runs the plain one (another branch:
    the calls never pair): once the timeout passes an error names both calls (the gathering
    one as matmul_reduce_scatter+all_gather), never a read of a chunk that was not sent."""
    jax_ub.configure(timeout_s=2.0)
    mesh = mesh1d(2)
    x, w, g = rand(2 * 4, 2 * 8), rand(2 * 8, 6), rand(2 * 4, 6)

    def body(x, w, g):
        def gathers(x, w, g):
            return bind_matmul_reduce_scatter(x, w, "tp", 2, gather=g)[0]

        def plain(x, w, g):
            return bind_matmul_reduce_scatter(x, w, "tp", 2)

        return lax.cond(lax.axis_index("tp") == 0, gathers, plain, x, w, g)

    f = smap(body, mesh, (P(None, "tp"), P("tp", None), P("tp")), P("tp"))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(f(x, w, g))
    msg = str(info.value)
    shape = "(float32, rows=4, k=8, n=6, call #1)"
    want = {f"matmul_reduce_scatter+all_gather{shape}", f"matmul_reduce_scatter{shape}"}
    m = re.search(r"rank \d holds (.*\)) in place of this rank's (.*\)):", msg) or re.search(
        r"rank 0 of the group ran (.*\)), and this .* it made (.*\)) in its place", msg
    )
    assert m and {m.group(1), m.group(2)} == want, msg


def test_buffer_holds_the_gathered_chunks(mesh1d, rand):
    """A call that gathers beside it needs a third chunk per rank in the buffer: a fixed
    buffer too small for it is refused at lowering, naming the bytes."""
    mesh = mesh1d(2)
    x, w, g = rand(2 * 4, 2 * 8), rand(2 * 8, 6), rand(2 * 4, 6)
    chunk = 4 * 6 * 4  # one rank's [4, 6] float32 result
    jax_ub.configure(buffer_bytes=2 * 2 * chunk, allow_grow=False)  # the plain call's need
    rs = smap(
        lambda x, w: bind_matmul_reduce_scatter(x, w, "tp", 2),
        mesh,
        (P(None, "tp"), P("tp", None)),
        P("tp"),
    )
    assert rel_err(rs(x, w), to_f32(x) @ to_f32(w)) < 1e-5
    with pytest.raises(ValueError, match=rf"it needs {3 * 2 * chunk} bytes per device"):
        _rs_and_gather(mesh, 2)(x, w, g)
