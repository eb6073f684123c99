"""What only all_gather_matmul has: the gathered x it can return (return_gathered), bit for
bit on every rank, its gradient, and what the forward saves for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import bits
from _programs import regathering_calls
from conftest import rel_err, smap, tol
from jax.sharding import PartitionSpec as P

import jax_ub

AG = jax_ub.all_gather_matmul


@pytest.mark.parametrize("n_dev", [1, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_return_gathered(mesh1d, rand, n_dev, dtype):
    m, k, n = 4, 16, 8
    mesh = mesh1d(n_dev)
    x = rand(n_dev * m, 2, k, dtype=dtype)
    w = rand(k, n_dev * n, dtype=dtype)

    def f(impl):
        # Every rank's copy of the gathered x is returned (stacked along a new axis 0) so
        # that each one is checked, not just rank 0's.
        def body(x, w):
            out, g = AG(x, w, "tp", impl=impl, return_gathered=True)
            return out, g[None]

        return smap(
            body,
            mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=(P(None, None, "tp"), P("tp")),
        )(x, w)

    (out, gathered), (ref, _) = f("ub"), f("xla")
    assert gathered.shape == (n_dev, n_dev * m, 2, k)
    assert gathered.dtype == x.dtype
    for r in range(n_dev):
        np.testing.assert_array_equal(np.asarray(gathered[r]), np.asarray(x), err_msg=f"rank {r}")
    assert rel_err(out, ref) < tol(dtype)


# NaN payloads and signs, +-Inf, -0.0 and subnormals.
SPECIAL_BITS = {
    jnp.float32: np.array(
        [
            0x7FC00ABC,
            0xFFC00001,
            0x7F800001,
            0x7F800000,
            0xFF800000,
            0x80000000,
            0x00000001,
            0x807FFFFF,
        ],
        np.uint32,
    ),
    jnp.bfloat16: np.array(
        [0x7FC5, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F], np.uint16
    ),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_input_is_bit_exact(mesh1d, rand, dtype):
    """return_gathered hands back x bit for bit on every rank: NaN payloads and signs, +-Inf,
    -0.0 and subnormals included."""
    tp, m, k = 4, 4, 8
    mesh = mesh1d(tp)
    x = np.asarray(rand(tp * m, k, dtype=dtype))
    specials = SPECIAL_BITS[dtype]
    flat = bits(x).copy().reshape(-1)
    flat[:: (tp * m * k) // len(specials)][: len(specials)] = specials  # spread over ranks
    x = flat.view(x.dtype).reshape(tp * m, k)
    w = np.asarray(rand(k, tp * 4, dtype=dtype))
    f = smap(
        lambda x, w: AG(x, w, "tp", impl="ub", return_gathered=True),
        mesh,
        (P("tp"), P(None, "tp")),
        (P(None, "tp"), P("tp")),  # every rank's gathered copy, stacked
    )
    _, gathered = f(x, w)
    copies = bits(gathered).reshape(tp, tp * m, k)
    for rank in range(tp):
        np.testing.assert_array_equal(copies[rank], bits(x), err_msg=f"rank {rank}")


def test_grad_return_gathered(mesh1d, rand):
    """Both outputs carry cotangents: dx = RS(dy @ w.T) + psum_scatter(d gathered)."""
    mesh = mesh1d(4)
    x = rand(4 * 4, 16)
    w = rand(16, 4 * 8)

    def loss(x, w, impl):
        def body(x, w):
            out, g = AG(x, w, "tp", impl=impl, return_gathered=True)
            return out, g[None]

        out, g = smap(body, mesh, (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp")), jit=False)(
            x, w
        )
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(g) * jnp.arange(g.shape[0])[:, None, None])

    g_ub = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "ub")
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "xla")
    assert rel_err(g_ub[0], g_ref[0]) < 1e-5
    assert rel_err(g_ub[1], g_ref[1]) < 1e-5


@pytest.mark.parametrize("keep", [True, False])
def test_grad_keeps_gathered_x_or_x(mesh1d, rand, keep):
    """The forward saves for the backward only w and what dw needs: the gathered x with
    keep_gathered, else x's shard (the default); besides, x is kept as an empty slice for
    its type."""
    saved_residuals = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals
    jax_ub.configure(keep_gathered=keep)  # conftest's _restore_config undoes it
    mesh = mesh1d(4)
    x, w = rand(4 * 8, 16), rand(16, 4 * 8)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    sizes = sorted(
        int(np.prod(aval.shape)) for aval, _ in saved_residuals(lambda x, w: f(x, w).sum(), x, w)
    )
    # w (16 x 32), the gathered x of each of the 4 devices (4 x 32 x 16) or x (32 x 16),
    # an empty slice.
    assert sizes == sorted([0, 16 * 32, 4 * 32 * 16 if keep else 32 * 16]), sizes


def _ag_then_mlp(impl):
    """A column-parallel GELU projection, then gelu_mlp: both ops that keep x."""

    def body(x, w, b, w_up, w_down):
        h = AG(x, w, "tp", bias=b, activation="gelu", impl=impl)
        h = jax_ub.matmul_reduce_scatter(h, w_up.T, "tp", impl=impl)
        return jax_ub.gelu_mlp(h, w_up, w_down, "tp", impl=impl)

    return body


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grads_whether_or_not_the_gathered_x_is_kept(mesh1d, rand, keep, dtype):
    """With keep_gathered off the backward gathers x again: the same gradients, and one
    reduce-scatter call per all-gathered op in the program that gathers x beside its own
    work (none where x is kept); never an XLA all-gather."""
    mesh, k = mesh1d(4), 16
    args = (rand(32, 2, k), rand(k, 32), rand(32), rand(k, 32), rand(32, k))
    args = tuple(a.astype(dtype) for a in args)
    specs = (P("tp"), P(None, "tp"), P("tp"), P(None, "tp"), P("tp", None))

    def grads(impl):
        f = smap(_ag_then_mlp(impl), mesh, in_specs=specs, out_specs=P("tp"))
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), (0, 1, 3)))

    jax_ub.configure(keep_gathered=keep)  # conftest's _restore_config undoes it
    with jax.default_matmul_precision("highest"):
        got, want = grads("ub")(*args), grads("xla")(*args)
        text = grads("ub").lower(*args).as_text()
    for g, r in zip(got, want):
        assert rel_err(g, r) < tol(dtype), rel_err(g, r)
    assert "stablehlo.all_gather" not in text
    assert regathering_calls(text) == (4, 0 if keep else 2), keep


def test_checkpointed_op_keeps_no_gathered_x(mesh1d, rand):
    """With keep_gathered off, under jax.checkpoint with dots_and_ops_saveable, nothing of
    the gathered size is saved: x's shard is recomputed from the input (here a norm's
    output), as XLA's unfused ops under the dots policy do."""
    saved_residuals = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals
    jax_ub.configure(keep_gathered=False)  # conftest's _restore_config undoes it
    mesh = mesh1d(4)
    x, w = rand(4 * 8, 16), rand(16, 4 * 8)

    def body(x, w):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return AG(x, w, "tp", impl="ub")

    f = jax.checkpoint(
        smap(body, mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")),
        policy=jax_ub.dots_and_ops_saveable,
    )
    shapes = [aval.shape for aval, _ in saved_residuals(lambda x, w: f(x, w).sum(), x, w)]
    assert all(s[:1] != (4 * 4 * 8,) for s in shapes), shapes  # no [devices x 32, 16]
