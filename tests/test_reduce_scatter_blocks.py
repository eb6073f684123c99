"""What only matmul_reduce_scatter has: each rank's output block is the sum over ranks of
that block's partial products, and at 2 devices a block goes in row pieces folded into the
own product or summed in one pass (reduce_scatter_fold_rows)."""

import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import op_fn
from conftest import rel_err, to_f32, tol

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
