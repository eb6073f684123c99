"""impl="auto"'s rule (jax_ub._src.settings.auto_rule): on GPUs the userbuffer op only where its
collective moves at least auto_min_bytes per rank and the group has two or more devices,
XLA's op elsewhere; on CPU devices the host protocol wherever it can run. The GPU branch
runs here on a simulated GPU platform (the backend's name patched, the CPU extension
standing in for the CUDA one)."""

from __future__ import annotations

import doctest
import logging

import jax
import jax.numpy as jnp
import pytest
from _op_cases import OPS, op_fn, op_operands
from conftest import rel_err
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.ops import impl_choice
from jax_ub._src.ops.path import Path
from jax_ub._src.runtime import extension
from jax_ub._src.settings import auto_rule

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
NAME = {"ag": AG, "rs": RS}
TARGET = {"ag": "jax_ub_all_gather_matmul", "rs": "jax_ub_matmul_reduce_scatter"}
BF16 = jnp.bfloat16
MiB = 1 << 20


def gpu_choice(op, x_shape, w_shape, axis_size, dtype=BF16, **kw):
    return auto_rule.auto_choice(op, x_shape, w_shape, dtype, axis_size, platform="gpu", **kw)


@pytest.fixture
def simulated_gpu(monkeypatch):
    """jax.default_backend() says "gpu" and a userbuffer op exists for it (the CPU one)."""
    real_supported = extension.supported
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(extension, "supported", lambda p: p == "gpu" or real_supported(p))


# ------------------------------------------------------------------ the rule, on GPUs


def test_default_is_the_calibrated_8_mib():
    assert jax_ub.config.auto_min_bytes == 8 * MiB == jax_ub.Config().auto_min_bytes


@pytest.mark.parametrize(
    "rows, moved, impl",
    [  # the measured down projection (tp=2, bf16, n=4096): ub 3% faster at 8192 rows,
        # even at 4096, 11% slower at 2048 and 30-45% slower at decode sizes
        (8192, 64 * MiB, "ub"),
        (4096, 32 * MiB, "xla"),
        (2048, 16 * MiB, "xla"),
        (8, 64 * 1024, "xla"),
    ],
)
def test_all_reduce_needs_six_times_the_bytes(rows, moved, impl):
    choice = gpu_choice("matmul_all_reduce", (rows, 7168), (7168, 4096), 2)
    assert (choice.comm_bytes, choice.impl) == (moved, impl)
    jax_ub.configure(auto_min_bytes=0)  # 0: ub for every call, this one too
    assert gpu_choice("matmul_all_reduce", (rows, 7168), (7168, 4096), 2).impl == "ub"


@pytest.mark.parametrize(
    "op,x_shape,w_shape,moved,impl",
    [
        # The measured shapes: tp=2, bf16, the bench's local operands. M=256 global rows
        # (both ops slower than XLA's) and M=512 (the RS still slower)...
        (AG, (128, 8192), (8192, 14336), 2 * MiB, "xla"),
        (RS, (256, 14336), (14336, 8192), 2 * MiB, "xla"),
        (AG, (256, 8192), (8192, 14336), 4 * MiB, "xla"),
        (RS, (512, 14336), (14336, 8192), 4 * MiB, "xla"),
        # ... and M=1024 (both tied or won, as at M=2048).
        (AG, (512, 8192), (8192, 14336), 8 * MiB, "ub"),
        (RS, (1024, 14336), (14336, 8192), 8 * MiB, "ub"),
        # The boundary: exactly auto_min_bytes takes ub, one row received less does not.
        (AG, (512, 8192), (8192, 64), 8 * MiB, "ub"),
        (AG, (511, 8192), (8192, 64), 8 * MiB - 8192 * 2, "xla"),
        (RS, (1024, 64), (64, 8192), 8 * MiB, "ub"),
        (RS, (1022, 64), (64, 8192), 8 * MiB - 8192 * 2, "xla"),
        # Batch dims count as rows.
        (AG, (128, 4, 8192), (8192, 64), 8 * MiB, "ub"),
        (AG, (127, 4, 8192), (8192, 64), 8 * MiB - 4 * 8192 * 2, "xla"),
    ],
)
def test_gpu_rule_at_the_boundary(op, x_shape, w_shape, moved, impl):
    choice = gpu_choice(op, x_shape, w_shape, 2)
    assert (choice.impl, choice.comm_bytes) == (impl, moved), choice
    assert ("below auto_min_bytes" in choice.reason) == (impl == "xla"), choice.reason


def test_gpu_rule_counts_every_peer():
    """At tp=4 a rank receives 3 shards of x (AG), 3 blocks of M/4 rows (RS)."""
    assert gpu_choice(AG, (100, 1000), (1000, 8), 4, dtype=jnp.float32).comm_bytes == (
        3 * 100 * 1000 * 4
    )
    assert gpu_choice(RS, (400, 8), (8, 1000), 4, dtype=jnp.float32).comm_bytes == (
        3 * 100 * 1000 * 4
    )


@pytest.mark.parametrize("min_bytes", [0, 8 * MiB])
def test_gpu_groups_of_one_take_xla(min_bytes):
    for op in (AG, RS):
        choice = gpu_choice(op, (8192, 8192), (8192, 8192), 1, min_bytes=min_bytes)
        assert choice.impl == "xla" and "group of one device" in choice.reason, choice


def test_fp8_all_gather_counts_one_byte_elements():
    """fp8's all-gather moves float8_e4m3fn: half of bf16's bytes, so the same shape falls
    below the threshold; RS moves x.dtype partial sums either way."""
    bf16 = gpu_choice(AG, (512, 8192), (8192, 64), 2)
    fp8 = gpu_choice(AG, (512, 8192), (8192, 64), 2, fp8=True)
    assert (bf16.impl, fp8.impl, fp8.comm_bytes) == ("ub", "xla", 4 * MiB)
    rs = gpu_choice(RS, (1024, 64), (64, 8192), 2, fp8=True)
    assert (rs.impl, rs.comm_bytes) == ("ub", 8 * MiB)


def test_auto_min_bytes_overrides_the_threshold():
    small = (AG, (8, 16), (16, 8), 2)
    assert gpu_choice(*small).impl == "xla"
    jax_ub.configure(auto_min_bytes=0)
    assert gpu_choice(*small).impl == "ub"
    jax_ub.configure(auto_min_bytes=16 * MiB)
    assert gpu_choice(AG, (512, 8192), (8192, 64), 2).impl == "xla"  # 8 MiB, now below
    assert gpu_choice(AG, (1024, 8192), (8192, 64), 2).impl == "ub"


def test_cpu_devices_keep_the_host_protocol():
    """On CPU devices the rule takes ub for every call it can run: groups of one, tiny."""
    for axis_size in (1, 2, 8):
        choice = auto_rule.auto_choice(AG, (1, 2), (2, 1), jnp.float32, axis_size, platform="cpu")
        assert choice.impl == "ub" and "CPU devices" in choice.reason


@pytest.mark.parametrize(
    "value,match",
    [
        (-1, r"auto_min_bytes must be an integer number of bytes >= 0, got -1 \(jax_ub.configure"),
        (1.5, r"auto_min_bytes must be an integer number of bytes >= 0, got 1.5"),
        (True, r"got True"),
        ("4MiB", r"got '4MiB'"),
    ],
)
def test_auto_min_bytes_rejects_bad_values(value, match):
    with pytest.raises(ValueError, match=match):
        jax_ub.configure(auto_min_bytes=value)
    assert jax_ub.config.auto_min_bytes == 8 * MiB


def test_auto_min_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_UB_AUTO_MIN_BYTES", "1048576")
    assert jax_ub.Config().auto_min_bytes == MiB
    monkeypatch.setenv("JAX_UB_AUTO_MIN_BYTES", "-5")
    with pytest.raises(ValueError, match=r"got -5 \(environment variable JAX_UB_AUTO_MIN_BYTES"):
        jax_ub.Config().check()  # raised at first use, not when the config is built
    monkeypatch.setenv("JAX_UB_AUTO_MIN_BYTES", "4M")
    with pytest.raises(ValueError, match=r"JAX_UB_AUTO_MIN_BYTES='4M' is not a valid value"):
        jax_ub.Config().check()


# ------------------------------------------------------------------ choose_path on a simulated GPU


@pytest.mark.usefixtures("simulated_gpu")
def test_choose_path_on_gpus_follows_the_rule(rand):
    x_small, w = rand(8, 16, dtype=BF16), rand(16, 8, dtype=BF16)
    assert impl_choice.choose_path(AG, "auto", x_small, w, axis_size=2) is Path.XLA
    assert impl_choice.choose_path(AG, "auto", x_small, w, axis_size=1) is Path.XLA
    # ub always means ub
    assert impl_choice.choose_path(AG, "ub", x_small, w, axis_size=1) is Path.UB
    jax_ub.configure(auto_min_bytes=8 * 16 * 2)  # exactly this call's bytes at tp=2
    assert impl_choice.choose_path(AG, "auto", x_small, w, axis_size=2) is Path.UB
    assert impl_choice.choose_path(AG, "auto", x_small, w, axis_size=1) is Path.XLA


def _with_axis_size(monkeypatch):
    """Pass the axis size to choose_path as the ops will (impl_choice.choose_path(...,
    axis_size=size))."""
    real = impl_choice.choose_path

    def choose_path(op, impl, x, w, fp8=False, axis_size=None):
        axis_size = lax.axis_size("tp") if axis_size is None else axis_size
        return real(op, impl, x, w, fp8=fp8, axis_size=axis_size)

    monkeypatch.setattr(impl_choice, "choose_path", choose_path)


@pytest.mark.usefixtures("simulated_gpu")
@pytest.mark.parametrize("op", OPS)
def test_auto_on_gpus_lowers_small_calls_to_xla_collectives(mesh1d, rand, monkeypatch, op):
    """A small call under impl="auto" on a (simulated) GPU is XLA's collective and dot; over
    the threshold it is the custom call; impl="ub" is the custom call at any size."""
    _with_axis_size(monkeypatch)
    mesh = mesh1d(2)
    x, w = op_operands(rand, op, 2, 8, 16, 8)
    text = op_fn(op, mesh, "auto").lower(x, w).as_text()
    assert "jax_ub_" not in text
    assert ("all-gather" in text or "all_gather" in text) if op == "ag" else "reduce" in text
    assert TARGET[op] in op_fn(op, mesh, "ub").lower(x, w).as_text()
    jax_ub.configure(auto_min_bytes=0)
    assert TARGET[op] in op_fn(op, mesh, "auto").lower(x, w).as_text()


@pytest.mark.usefixtures("simulated_gpu")
def test_the_ops_give_the_rule_their_group_size(mesh1d, rand, caplog):
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 16, 8)
    with caplog.at_level(logging.DEBUG, logger="jax_ub"):
        text = op_fn("ag", mesh, "auto").lower(x, w).as_text()
    assert "group of 2" in caplog.text, caplog.text
    assert "jax_ub_" not in text


# ------------------------------------------------------------------ on CPU devices, end to end


@pytest.mark.parametrize("op", OPS)
def test_auto_on_cpu_is_the_host_protocol_and_logs_why(mesh1d, rand, caplog, op):
    """Even below auto_min_bytes: CI runs the host protocol under impl="auto"."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, op, 2, 4, 8, 4)
    f = op_fn(op, mesh, "auto")
    with caplog.at_level(logging.DEBUG, logger="jax_ub"):
        text = f.lower(x, w).as_text()
    assert TARGET[op] in text
    lines = [r.getMessage() for r in caplog.records if r.name == "jax_ub"]
    assert any(f"{NAME[op]} impl='auto' -> 'ub'" in m and "CPU devices" in m for m in lines), lines
    assert rel_err(f(x, w), op_fn(op, mesh, "xla")(x, w)) < 1e-5


@pytest.mark.usefixtures("simulated_gpu")
def test_auto_logs_a_gpu_decision_for_xla(rand, caplog):
    x, w = rand(8, 16, dtype=BF16), rand(16, 8, dtype=BF16)
    with caplog.at_level(logging.DEBUG, logger="jax_ub"):
        impl_choice.choose_path(RS, "auto", x, w, axis_size=2)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "jax_ub"]
    assert "matmul_reduce_scatter impl='auto' -> 'xla'" in message
    assert "(x (8, 16), w (16, 8), bfloat16, group of 2)" in message
    assert "moves 64 bytes per rank, below auto_min_bytes=8388608 bytes (8 MiB)" in message


def test_auto_logs_why_it_cannot_take_ub(rand, caplog):
    x, w = rand(8, 16), rand(16, 8, dtype=BF16)
    with caplog.at_level(logging.DEBUG, logger="jax_ub"):
        assert impl_choice.choose_path(AG, "auto", x, w, axis_size=2) is Path.XLA
    assert "-> 'xla'" in caplog.text and "different dtypes" in caplog.text


# ------------------------------------------------------------------ explain_impl


def test_explain_impl_on_cpu():
    choice = jax_ub.explain_impl(AG, (256, 1024), (1024, 4096), BF16, 4)
    assert isinstance(choice, jax_ub.ImplChoice)
    assert (choice.impl, choice.comm_bytes) == ("ub", 3 * 256 * 1024 * 2)
    assert "CPU devices" in choice.reason
    assert jax_ub.explain_impl(RS, (8, 4), (4, 2), BF16, 2, impl="xla").impl == "xla"
    assert jax_ub.explain_impl(RS, (8, 4), (4, 2), BF16, 2, impl="ub").impl == "ub"
    ints = jax_ub.explain_impl(AG, (8, 4), (4, 2), jnp.int32, 2)
    assert ints.impl == "xla" and "int32 is not supported" in ints.reason
    with pytest.raises(ValueError, match=r"impl='ub' cannot run this call: dtype int32"):
        jax_ub.explain_impl(AG, (8, 4), (4, 2), jnp.int32, 2, impl="ub")


@pytest.mark.parametrize(
    "op,w_shape,impl,match",
    [
        ("all_gather", (4, 2), "auto", r"op must be one of .* got 'all_gather'"),
        (AG, (4, 2), "fast", r"impl must be one of"),
        (AG, (5, 2), "auto", r"contracting dims differ"),
    ],
)
def test_explain_impl_rejects_bad_arguments(op, w_shape, impl, match):
    with pytest.raises(ValueError, match=match):
        jax_ub.explain_impl(op, (8, 4), w_shape, BF16, 2, impl=impl)


@pytest.mark.parametrize("impl", ["auto", "ub", "xla"])
def test_explain_impl_refuses_what_the_op_refuses(mesh1d, impl):
    """A reduce-scatter whose rows the axis does not divide: explain_impl raises what the op
    raises, with any impl; an axis size below 1 is refused, never counted as bytes."""
    with pytest.raises(ValueError, match=r"rows of x \(7\) are not divisible by the size of"):
        jax_ub.explain_impl(RS, (7, 16), (16, 8), jnp.float32, 2, impl=impl)
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.matmul_reduce_scatter(x, w, "tp", impl=impl),
            mesh=mesh1d(2),
            in_specs=(P(None, "tp"), P("tp")),
            out_specs=P("tp"),
        )
    )
    with pytest.raises(ValueError, match=r"rows of x \(7\) are not divisible by the size of"):
        f(jnp.ones((7, 32)), jnp.ones((32, 8)))
    for size in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match=r"axis_size must be an integer >= 1"):
            jax_ub.explain_impl(AG, (8, 16), (16, 8), jnp.float32, size, impl=impl)


@pytest.mark.usefixtures("simulated_gpu")
def test_explain_impl_says_what_the_op_does_on_gpus(rand):
    for m, impl in ((511, "xla"), (512, "ub")):
        choice = jax_ub.explain_impl(AG, (m, 8192), (8192, 64), BF16, 2)
        assert choice.impl == impl, choice
        x, w = rand(m, 8192, dtype=BF16), rand(8192, 64, dtype=BF16)
        assert impl_choice.choose_path(AG, "auto", x, w, axis_size=2) is Path(impl)
    solo = jax_ub.explain_impl(RS, (4096, 8192), (8192, 8192), BF16, 1)
    assert solo.impl == "xla" and "group of one device" in solo.reason


def test_explain_impl_docstring_example_runs():
    globs = dict(jax_ub=jax_ub, jnp=jnp)
    tests = doctest.DocTestFinder().find(impl_choice.explain_impl, "explain_impl", globs=globs)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 2 and result.failed == 0, result
