"""What only matmul_reduce_scatter has: each rank's output block is the sum over ranks of
that block's partial products, and at 2 devices a block goes in row pieces folded into the
own product or summed in one pass (reduce_scatter_fold_rows); above 2, with
reduce_scatter_ring, folded along a ring."""

import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import op_fn
from conftest import rel_err, to_f32, tol
from test_gelu_mlp import assert_grads_match_xla, operands

import jax_ub
from jax_ub._src.settings import options


@pytest.mark.parametrize(
    "fold_rows,m",
    [(0, 1), (0, 3), (0, 8), (-1, 3), (-1, 8), (4, 7), (4, 8)],
    ids=lambda v: str(v),
)
def test_fold_on_and_off(mesh1d, rand, fold_rows, m):
    """At 2 devices a block of m rows goes in two row pieces and the peer's is added to our
    own piece by piece when each piece has at least `fold_rows` rows (0: always, -1:
    never), else in one piece and a sum pass. m = 1 and 3 make empty and uneven pieces;
    (4, 7) and (4, 8) sit either side of the threshold. Every case must give the
    reference's result."""
    jax_ub.finalize()  # communicators take the setting when they are created
    try:
        with options.experimental_tuning(reduce_scatter_fold_rows=fold_rows):
            x = rand(2 * m, 2 * 6, dtype=jnp.bfloat16)
            w = rand(2 * 6, 10, dtype=jnp.bfloat16)
            mesh = mesh1d(2)
            out, ref = op_fn("rs", mesh, "ub")(x, w), op_fn("rs", mesh, "xla")(x, w)
            assert out.shape == ref.shape == (x.shape[0], w.shape[1])
            assert out.dtype == ref.dtype == jnp.bfloat16
            assert rel_err(out, ref) < tol(jnp.bfloat16)
            # And against the plain product, so a wrong reference cannot hide a wrong result.
            assert rel_err(out, to_f32(x) @ to_f32(w)) < tol(jnp.bfloat16)
    finally:
        jax_ub.finalize()


def test_local_partials_differ_per_rank(mesh1d, rand):
    """Each rank's output block is the sum over ranks of *its* rows: check block by block."""
    n_dev, m, k, n = 4, 2, 8, 4
    x = rand(n_dev * m, n_dev * k)
    w = rand(n_dev * k, n)
    out = np.asarray(op_fn("rs", mesh1d(n_dev), "ub")(x, w))
    xs, ws = to_f32(x), to_f32(w)
    for r in range(n_dev):
        want = sum(
            xs[r * m : (r + 1) * m, j * k : (j + 1) * k] @ ws[j * k : (j + 1) * k]
            for j in range(n_dev)
        )
        np.testing.assert_allclose(out[r * m : (r + 1) * m], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_dev", [3, 4, 8])
@pytest.mark.parametrize(
    "fold_rows,m", [(0, 1), (0, 3), (0, 8), (-1, 8), (4, 7), (4, 8)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ring_above_two_ranks(mesh1d, rand, n_dev, fold_rows, m, dtype):
    """With reduce_scatter_ring, groups above 2 fold too: each block's partial sum passes
    around the ring, each rank's GEMM adding its own partial, its pieces as at 2 devices
    (fold_rows; -1: never, the sum pass). Each rank's block must be the sum over ranks of
    that block's partials, checked block by block against float32 math."""
    jax_ub.finalize()  # communicators take the setting when they are created
    try:
        with options.experimental_tuning(
            reduce_scatter_fold_rows=fold_rows, reduce_scatter_ring=True
        ):
            k, n = 6, 10
            x = rand(n_dev * m, n_dev * k, dtype=dtype)
            w = rand(n_dev * k, n, dtype=dtype, scale=0.5)
            out = op_fn("rs", mesh1d(n_dev), "ub")(x, w)
            assert out.shape == (n_dev * m, n) and out.dtype == dtype
            xs, ws, got = to_f32(x), to_f32(w), to_f32(out)
            for r in range(n_dev):
                rows = slice(r * m, (r + 1) * m)
                want = sum(
                    xs[rows, j * k : (j + 1) * k] @ ws[j * k : (j + 1) * k] for j in range(n_dev)
                )
                # bf16: the ring rounds each rank's running sum to bf16 on its way
                assert rel_err(got[rows], want) < (1e-5 if dtype == jnp.float32 else 2e-2), r
    finally:
        jax_ub.finalize()


def test_ring_is_taken_where_set(mesh1d, rand):
    """The setting reaches the communicator: in bf16 the ring rounds each running sum on its
    way, so its bits differ from the sum pass's (one rounding), both near the product."""
    x = rand(4 * 8, 4 * 64, dtype=jnp.bfloat16)
    w = rand(4 * 64, 32, dtype=jnp.bfloat16)
    outs = {}
    for ring in (False, True):
        jax_ub.finalize()
        try:
            with options.experimental_tuning(reduce_scatter_fold_rows=0, reduce_scatter_ring=ring):
                outs[ring] = np.asarray(op_fn("rs", mesh1d(4), "ub")(x, w))
        finally:
            jax_ub.finalize()
        assert rel_err(outs[ring], to_f32(x) @ to_f32(w)) < tol(jnp.bfloat16), ring
    assert not np.array_equal(outs[False].view(np.uint16), outs[True].view(np.uint16))


def test_ring_repeated_calls_and_gradients(mesh1d, rand):
    """The ring over many calls (flags by epoch, buffers reused, credits) with new data
    each time, and in gradients: gelu_mlp's backward has a reduce-scatter that gathers
    beside it (which takes the sum pass) and one that does not (the ring)."""
    jax_ub.finalize()
    try:
        with options.experimental_tuning(reduce_scatter_fold_rows=0, reduce_scatter_ring=True):
            mesh = mesh1d(4)
            f = op_fn("rs", mesh, "ub")
            for i in range(6):
                x, w = rand(4 * 4, 4 * 6), rand(4 * 6, 8)
                assert rel_err(f(x, w), to_f32(x) @ to_f32(w)) < 1e-5, i
            assert_grads_match_xla(mesh, operands(rand, 4))
    finally:
        jax_ub.finalize()
