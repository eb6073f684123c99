"""Wrong calls of the ops fail early, at trace time, with a clear message: shapes and ranks,
axis names, impl spellings, dtypes, calls outside shard_map, an empty contraction. The
table of cases also checks that no communicator is left behind."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, op_call
from conftest import ag_fn as _ag
from conftest import make_mesh, smap
from conftest import rs_fn as _rs
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host


@pytest.mark.parametrize("impl", ["ub", "xla", "auto"])
def test_rows_not_divisible(mesh1d, rand, impl):
    x, w = rand(6, 2 * 8), rand(2 * 8, 4)  # 6 rows over 4 ranks
    with pytest.raises(ValueError, match=r"rows of x \(6\) are not divisible .*'tp' \(4\)"):
        _rs(mesh1d(4), impl)(x, w)


@pytest.mark.parametrize("op", OPS)
def test_mismatched_k(mesh1d, rand, op):
    mesh = mesh1d(2)
    if op == "ag":
        f, x, w = _ag(mesh), rand(2 * 4, 16), rand(12, 2 * 4)
    else:
        f, x, w = _rs(mesh), rand(2 * 4, 2 * 8), rand(2 * 6, 4)
    with pytest.raises(ValueError, match=r"contracting dims differ"):
        f(x, w)


@pytest.mark.parametrize("op", OPS)
def test_bad_ranks(mesh1d, rand, op):
    mesh = mesh1d(2)
    f = smap(lambda x, w: op_call(op)(x, w, "tp", impl="ub"), mesh, (P("tp"), P()), P("tp"))
    with pytest.raises(ValueError, match=r"x must have at least 2 dims"):
        f(rand(16), rand(8, 4))
    with pytest.raises(ValueError, match=r"w must be 2-D"):
        f(rand(4, 8), rand(8, 4, 1))


@pytest.mark.parametrize("impl", ["ub", "xla", "auto"])
@pytest.mark.parametrize("op", OPS)
def test_unknown_axis_inside_shard_map(mesh1d, rand, impl, op):
    mesh = mesh1d(2)
    f = _ag(mesh, impl, axis="dp") if op == "ag" else _rs(mesh, impl, axis="dp")
    with pytest.raises(ValueError, match=r"axis 'dp' is not in the mesh"):
        f(rand(2 * 4, 2 * 4), rand(2 * 4, 2 * 4))


@pytest.mark.parametrize("axis", [0, ("tp",), None])
def test_axis_name_not_a_string(mesh1d, rand, axis):
    with pytest.raises(ValueError, match=r"axis_name must be one mesh axis name \(str\)"):
        _ag(mesh1d(2), axis=axis)(rand(2 * 4, 8), rand(8, 2 * 4))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_outside_shard_map(rand, jit, op):
    fn = op_call(op)
    f = lambda x, w: fn(x, w, "tp", impl="ub")  # noqa: E731
    if jit:
        f = jax.jit(f)
    with pytest.raises(ValueError, match=r"axis 'tp' is not bound; call .* inside jax.shard_map"):
        f(rand(8, 8), rand(8, 8))


@pytest.mark.parametrize("op", OPS)
def test_unsupported_dtype_with_ub(mesh1d, op):
    x = jnp.asarray(np.arange(2 * 4 * 8, dtype=np.int32).reshape(2 * 4, 8) + 1)
    w = jnp.asarray(np.arange(8 * 8, dtype=np.int32).reshape(8, 8) + 1)
    f = _ag(mesh1d(2)) if op == "ag" else _rs(mesh1d(2))
    with pytest.raises(ValueError, match=r"impl='ub' cannot run this call: dtype int32 is not"):
        f(x, w)


@pytest.mark.parametrize("op", OPS)
def test_mixed_dtypes_with_ub(mesh1d, rand, op):
    x, w = rand(2 * 4, 8), rand(8, 8, dtype=jnp.bfloat16)
    f = _ag(mesh1d(2)) if op == "ag" else _rs(mesh1d(2))
    with pytest.raises(ValueError, match=r"impl='ub' cannot run this call: x and w have different"):
        f(x, w)


@pytest.mark.parametrize("impl", ["UB", "cuda", "", None])
@pytest.mark.parametrize("op", OPS)
def test_bad_impl(mesh1d, rand, impl, op):
    f = _ag(mesh1d(2), impl) if op == "ag" else _rs(mesh1d(2), impl)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'ub', 'xla', 'none'\)"):
        f(rand(2 * 4, 8), rand(8, 8))


# --------------------------------------------------------------------------- a table of cases
# More of the same kinds, each with its exact message: batch dims, impl="xla"/"auto", other
# spellings, float64 and complex64. x and w are replicated, so the shapes in the messages are
# the global ones.


def _np(*shape, dtype=np.float32):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 7 - 3).astype(dtype)


def _call(op, x, w, *, impl="ub", axis="tp", tp=2):
    """A zero-argument callable running `op` under shard_map over a tp-device mesh."""

    def run():
        mesh = make_mesh((tp, "tp"))
        fn = op_call(op)
        f = smap(lambda x, w: fn(x, w, axis, impl=impl), mesh, (P(), P()), P("tp"))
        return jax.block_until_ready(f(x, w))

    return run


def _x64(make):
    """Run `make()` (which builds its float64 arrays) and its call with jax_enable_x64 on."""

    def run():
        with jax.enable_x64(True):
            return make()()

    return run


def _f64(op):
    return _x64(lambda: _call(op, jnp.ones((8, 4), jnp.float64), jnp.ones((4, 4), jnp.float64)))


BAD_CALLS = [
    # (description, callable, regex); every one raises ValueError
    (
        "ag 1-D w, impl=xla",
        _call("ag", _np(8, 4), _np(4), impl="xla"),
        r"all_gather_matmul: w must be 2-D \[k, n\], got w.shape=\(4,\)",
    ),
    (
        "rs 1-D x, impl=auto",
        _call("rs", _np(8), _np(8, 4), impl="auto"),
        r"matmul_reduce_scatter: x must have at least 2 dims \[rows, ..., k\], got x.shape=\(8,\)",
    ),
    (
        "rs 3-D w, impl=xla",
        _call("rs", _np(8, 4), _np(4, 4, 2), impl="xla"),
        r"matmul_reduce_scatter: w must be 2-D",
    ),
    (
        "ag k mismatch with batch dims",
        _call("ag", _np(8, 3, 16), _np(12, 4)),
        r"all_gather_matmul: contracting dims differ: x.shape\[-1\]=16 but w.shape\[0\]=12; "
        r"x.shape=\(8, 3, 16\) w.shape=\(12, 4\)",
    ),
    (
        "rs k mismatch with batch dims, impl=xla",
        _call("rs", _np(8, 2, 16), _np(8, 4), impl="xla"),
        r"matmul_reduce_scatter: contracting dims differ: x.shape\[-1\]=16 but w.shape\[0\]=8",
    ),
    (
        "rs rows not divisible with batch dims",
        _call("rs", _np(6, 2, 8), _np(8, 4), tp=4),
        r"rows of x \(6\) are not divisible by the size of axis 'tp' \(4\); x.shape=\(6, 2, 8\)",
    ),
    (
        "ag impl 'ub ' (trailing space)",
        _call("ag", _np(8, 4), _np(4, 4), impl="ub "),
        r"all_gather_matmul: impl must be one of \('auto', 'ub', 'xla', 'none'\), got impl='ub '",
    ),
    (
        "rs impl 'XLA'",
        _call("rs", _np(8, 4), _np(4, 4), impl="XLA"),
        r"matmul_reduce_scatter: impl must be one of .*got impl='XLA'",
    ),
    (
        "rs axis_name tuple",
        _call("rs", _np(8, 4), _np(4, 4), axis=("tp",)),
        r"matmul_reduce_scatter: axis_name must be one mesh axis name \(str\), got "
        r"axis_name=\('tp',\)",
    ),
    (
        "ag axis_name list",
        _call("ag", _np(8, 4), _np(4, 4), axis=["tp"]),
        r"all_gather_matmul: axis_name must be one mesh axis name \(str\)",
    ),
    (
        "ag float64 with impl=ub (x64 on)",
        _f64("ag"),
        r"all_gather_matmul: impl='ub' cannot run this call: dtype float64 is not "
        r"supported \(supported: float32, bfloat16, float16\)",
    ),
    (
        "rs float64 with impl=ub (x64 on)",
        _f64("rs"),
        r"matmul_reduce_scatter: impl='ub' cannot run this call: dtype float64",
    ),
    (
        "ag complex64 with impl=ub",
        _call("ag", _np(8, 4, dtype=np.complex64), _np(4, 4, dtype=np.complex64)),
        r"impl='ub' cannot run this call: dtype complex64 is not supported",
    ),
    (
        "rs float16 x, float32 w, impl=ub",
        _call("rs", _np(8, 4, dtype=np.float16), _np(4, 4)),
        r"matmul_reduce_scatter: impl='ub' cannot run this call: x and w have different dtypes",
    ),
]


@pytest.mark.parametrize("description,call,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input(description, call, match):
    before = _host.num_communicators()
    with pytest.raises(ValueError, match=match):
        call()
    assert _host.num_communicators() == before, f"{description}: a communicator was left behind"


@pytest.mark.parametrize("op", OPS)
def test_empty_contraction(op):
    """k = 0: either a clear error naming k, or the product of an empty sum (zeros)."""
    x, w = np.ones((8, 0), np.float32), np.ones((0, 4), np.float32)
    try:
        out = _call(op, x, w)()
    except ValueError as e:
        assert re.search(r"\bk\b", str(e)), str(e)
        return
    np.testing.assert_array_equal(np.asarray(out), 0)


def test_operands_that_are_not_arrays(rand):
    """A Python list as x, w or bias: a TypeError naming the operand and its type."""
    x, w = rand(8, 4), rand(4, 6)
    with pytest.raises(TypeError, match=r"all_gather_matmul: x must be an array .*got list"):
        jax_ub.all_gather_matmul(x.tolist(), w, "tp")
    with pytest.raises(TypeError, match=r"matmul_reduce_scatter: w must be an array .*got list"):
        jax_ub.matmul_reduce_scatter(x, w.tolist(), "tp")
    with pytest.raises(
        TypeError, match=r"all_gather_matmul: bias must be an array \[n\], got list"
    ):
        jax_ub.all_gather_matmul(x, w, "tp", bias=[0.5] * 6)
