"""Where a settings change reaches: every setting is part of the key of JAX's trace caches,
so a function traced before ``configure`` is traced again and lowered on a communicator of
the new settings; a ``Config`` made aside moves nothing; assignments are checked as
``configure`` checks them; an explicit buffer size is honoured; ``explain_impl`` says what
the all-reduce's route runs."""

import re

import jax
import numpy as np
import pytest
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.runtime import communicator


def _ag(mesh):
    return smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
        mesh,
        (P("tp"), P(None, "tp")),
        P(None, "tp"),
        jit=False,
    )


def _comm_ids(f, *args) -> set[str]:
    return set(re.findall(r"comm_id = (\d+)", jax.jit(f).lower(*args).as_text()))


def test_a_function_traced_before_gets_the_new_timeout(mesh1d, rand):
    """configure(timeout_s=...) after a first call: a new jit of the same function (whose
    trace JAX caches) lowers on a communicator with the new timeout, and runs right."""
    jax_ub.finalize()
    mesh = mesh1d(4)
    x, w = rand(16, 8), rand(8, 16)
    f = _ag(mesh)
    jax.block_until_ready(jax.jit(f)(x, w))
    (before,) = _comm_ids(f, x, w)
    jax_ub.configure(timeout_s=7.5)
    (after,) = _comm_ids(f, x, w)
    assert after != before
    (comm,) = [c for c in communicator.live_communicators() if str(c.id) == after]
    assert comm.timeout_s == 7.5
    assert rel_err(jax.jit(f)(x, w), x @ w) < 1e-5


def test_a_config_made_aside_changes_nothing(mesh1d, rand):
    """A Config object of its own (or dataclasses.replace of jax_ub.config) leaves the trace
    key alone: a later configure() to its values still reaches functions traced before."""
    mesh = mesh1d(2)
    x, w = rand(8, 8), rand(8, 8)
    f = jax.jit(
        smap(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="none"),
            mesh,
            (P("tp"), P(None, "tp")),
            P(None, "tp"),
            jit=False,
        )
    )
    assert "jax_ub" not in f.lower(x, w).as_text().replace("jax_ub/", "")
    jax_ub.Config(bound_gemms="ub")
    assert jax_ub.config.bound_gemms == "xla"
    jax_ub.configure(bound_gemms="ub")
    assert "custom_call @jax_ub_all_gather_matmul" in f.lower(x, w).as_text()


@pytest.mark.parametrize(
    "name,value",
    [("timeout_s", "5"), ("allow_tf32", 1), ("bound_gemms", "UB"), ("buffer_bytes", 1 << 64)],
)
def test_assignments_are_checked_as_configure_checks_them(name, value):
    before = getattr(jax_ub.config, name)
    with pytest.raises(ValueError, match=f"{name}.*jax_ub.config.{name}"):
        setattr(jax_ub.config, name, value)
    assert getattr(jax_ub.config, name) == before


@pytest.mark.parametrize("value", [True, 1000.5, "64MiB", 1 << 64, 0])
def test_initialize_checks_buffer_bytes(mesh1d, value):
    with pytest.raises(ValueError, match="buffer_bytes"):
        jax_ub.initialize(mesh1d(2), "tp", buffer_bytes=value)


def test_initialize_with_a_larger_buffer_replaces_the_live_one(mesh1d, rand):
    """initialize(buffer_bytes=) after the axis already has a smaller communicator gives
    one of that size, and an op needing it runs there without growing (allow_grow off)."""
    jax_ub.finalize()
    mesh = mesh1d(4)
    x, w = rand(16, 8), rand(8, 16)
    jax.block_until_ready(jax.jit(_ag(mesh))(x, w))
    jax_ub.configure(allow_grow=False)
    comm = jax_ub.initialize(mesh, "tp", buffer_bytes=64 << 20)
    assert comm.capacity_bytes == 64 << 20
    big_x, big_w = rand(4 * 2048, 256), rand(256, 64)  # 2 MiB a rank: over the first's 1 MiB
    assert rel_err(jax.jit(_ag(mesh))(big_x, big_w), big_x @ big_w) < 1e-4
    assert jax_ub.initialize(mesh, "tp", buffer_bytes=1 << 20) is comm  # a smaller one keeps it


def test_initializes_size_stands_beside_the_configs(mesh1d, rand):
    """initialize(buffer_bytes=1 MiB) under configure(buffer_bytes=8 MiB): the ops that fit
    run on that communicator (no second buffer); a later configure() of another size asks
    again."""
    jax_ub.finalize()
    mesh = mesh1d(2)
    jax_ub.configure(buffer_bytes=8 << 20)
    comm = jax_ub.initialize(mesh, "tp", buffer_bytes=1 << 20)
    x, w = rand(16, 8), rand(8, 16)
    assert rel_err(jax.jit(_ag(mesh))(x, w), x @ w) < 1e-5
    assert communicator.all_communicators() == [comm] and comm.capacity_bytes == 1 << 20
    jax_ub.configure(buffer_bytes=4 << 20)
    assert rel_err(jax.jit(_ag(mesh))(x, w), x @ w) < 1e-5
    (live,) = communicator.live_communicators()
    assert live.capacity_bytes == 4 << 20


@pytest.mark.parametrize("impl", ["ub", "auto", "none"])
def test_explain_impl_follows_the_all_reduces_route(impl, mesh1d, rand):
    """A group of one, or no rows: XLA's dot whatever the impl, as the op runs it (checked in
    its HLO); the bound on jax_ub's GEMMs is reported as "none"."""
    jax_ub.configure(bound_gemms="ub")
    for tp, rows in [(1, 8), (4, 0)]:
        choice = jax_ub.explain_impl("matmul_all_reduce", (rows, 16), (16, 8), "float32", tp)
        assert choice.impl == "xla", (tp, rows, choice)
        mesh = mesh1d(tp)
        x, w = rand(rows, tp * 16), rand(tp * 16, 8)
        f = smap(
            lambda x, w: jax_ub.matmul_all_reduce(x, w, "tp", impl=impl),  # noqa: B023
            mesh,
            (P(None, "tp"), P("tp")),
            P(),
        )
        assert "custom_call @jax_ub" not in f.lower(x, w).as_text()
    for op in ("all_gather_matmul", "matmul_all_reduce"):
        choice = jax_ub.explain_impl(op, (8, 16), (16, 8), "float32", np.int64(4), impl="none")
        assert choice.impl == "none" and "bound_gemms='ub'" in choice.reason, choice
