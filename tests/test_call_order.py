"""The order in which a CPU device's jax_ub calls run on its communicator.

Peers pair calls by their count, so every rank of a group must run them in one order. A
small program runs in sequence (XLA's CPU runtime waits for each call before the next); a
large one runs as a dataflow graph, whose independent calls start in whatever order their
inputs become ready. The ranks run their calls in the order the group's rank 0 runs them,
matched by key (src/host/ordered_runner.h). These tests hold one device's next call back
(``_host.hold_next_call``) and check the numbers: were two calls of equal shapes paired the
wrong way round, each rank would combine one call's shards with the other's."""

import re
import time

import jax
import jax.numpy as jnp
import pytest
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host
from jax_ub._src.runtime import communicator

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter
HOLD_S = 0.5


def _comm_id(mesh) -> int:
    """The id of the CPU communicator of ``mesh``'s tp group."""
    devices = set(mesh.devices.flat)
    (comm,) = [
        c
        for c in communicator.live_communicators()
        if c.platform == "cpu" and c.axis_name == "tp" and set(c.devices) == devices
    ]
    return comm.id


def _hold_next_call(mesh, rank: int) -> None:
    """Hold the next call of the device of ``rank`` of ``mesh``'s tp group."""
    device = mesh.devices.flat[rank]
    _host.hold_next_call(_comm_id(mesh), communicator._device_ordinal(device), HOLD_S)


def _operands(rand, tp):
    m, k, n = 8, 32, 16
    x1, x2 = rand(tp * m, k), rand(tp * m, k)
    w1, w2 = rand(k, tp * n), rand(k, tp * n)
    return x1, x2, w1, w2, rand(tp * m, tp * n), rand(tp * n, k, scale=0.2)


def _check(got, ref, what: str) -> None:
    for name, g, r in zip(("first AG", "second AG", "RS"), got, ref):
        assert rel_err(g, r) < 1e-5, f"{name}, {what}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("held_rank", [0, 1])
def test_independent_calls_of_a_small_program(mesh1d, rand, tp, held_rank):
    """Two all-gathers of equal shapes and an RS, none needing another's result."""
    mesh = mesh1d(tp)
    args = _operands(rand, tp)

    def run(impl):
        def body(x1, x2, w1, w2, h, w3):
            a = AG(x1, w1, "tp", impl=impl)
            return a, AG(x2, w2, "tp", impl=impl), RS(h, w3, "tp", impl=impl)

        specs = (P("tp"), P("tp"), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp"))
        return smap(body, mesh, specs, (P(None, "tp"), P(None, "tp"), P("tp")))(*args)

    ref = run("xla")
    run("ub")  # compiles, and makes the communicator
    for attempt in range(2):
        _hold_next_call(mesh, held_rank)
        start = time.perf_counter()
        got = jax.block_until_ready(run("ub"))
        assert time.perf_counter() - start >= HOLD_S, "the hold did not hold the call"
        _check(got, ref, f"attempt {attempt}")


def test_calls_of_programs_dispatched_without_a_sync(mesh1d, rand):
    """The same with each call in a program of its own, dispatched back to back."""
    mesh = mesh1d(2)
    x1, x2, w1, w2, h, w3 = _operands(rand, 2)
    col, row = (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp"))
    ag = smap(lambda x, w: AG(x, w, "tp", impl="ub"), mesh, col, P(None, "tp"))
    rs = smap(lambda x, w: RS(x, w, "tp", impl="ub"), mesh, row, P("tp"))
    rs_ref = smap(lambda x, w: RS(x, w, "tp", impl="xla"), mesh, row, P("tp"))
    ref = [x1 @ w1, x2 @ w2, rs_ref(h, w3)]
    jax.block_until_ready((ag(x1, w1), rs(h, w3)))
    for held_rank in (0, 1):
        _hold_next_call(mesh, held_rank)
        got = jax.block_until_ready((ag(x1, w1), ag(x2, w2), rs(h, w3)))
        _check(got, ref, f"rank {held_rank} held")


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("held_rank", [0, 1])
def test_calls_the_runtime_starts_out_of_order_pair_by_key(mesh1d, rand, tp, held_rank, copies):
    """Two RSs of equal shapes with nothing between them, in a program large enough for
    XLA's CPU runtime to run it as a dataflow graph: it starts both as soon as their
    inputs are ready. Holding rank 0's first one makes rank 0 run them in the other
    order; the peers follow rank 0's order (by key), so the numbers stay right. With
    `copies`, both are one call site: a jitted function called twice, which JAX lowers
    once and XLA copies into each caller."""
    mesh = mesh1d(tp)
    m, k, n = 8, 32, 16
    h1, h2, e = rand(tp * m, tp * k), rand(tp * m, tp * k), rand(9, 64, 64)
    w1, w2 = rand(tp * k, n), rand(tp * k, n)

    def run(impl):
        def rs(h, w):
            return RS(h, w, "tp", impl=impl)

        rs = jax.jit(rs) if copies else rs

        def body(h1, h2, w1, w2, e):
            # Independent work beside the calls: more thunks than XLA runs in sequence
            # (8), on buffers larger than it runs in sequence (512 bytes).
            rest = [jnp.sin(e[i]) for i in range(len(e))]
            return rs(h1, w1), rs(h2, w2), *rest

        specs = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp"), P())
        return smap(body, mesh, specs, (P("tp"), P("tp"), *[P()] * len(e)))

    args = (h1, h2, w1, w2, e)
    ref, ub = run("xla")(*args), run("ub")
    jax.block_until_ready(ub(*args))
    sites = re.findall(r"site = (\d+)", ub.lower(*args).compile().as_text())
    assert len(sites) == 2 and (sites[0] == sites[1]) == copies, sites
    comm = _comm_id(mesh)
    leader = communicator._device_ordinal(mesh.devices.flat[0])
    for attempt in range(2):
        _hold_next_call(mesh, held_rank)
        got = jax.block_until_ready(ub(*args))
        for name, g, r in zip(("first RS", "second RS"), got, ref):
            assert rel_err(g, r) < 1e-5, f"{name}, rank {held_rank} held, attempt {attempt}"
        order = _host.leader_order(comm, leader)[-2:]
        assert len(set(order)) == 2, order
        if held_rank == 0:
            # Rank 0's runtime started the held call first; it ran second there.
            assert order[-1] == _host.held_key(comm), (order, _host.held_key(comm))


def test_a_peer_slower_than_half_the_timeout_still_pairs(mesh1d, rand):
    """Rank 1's call of the leader's first key is held for 2/3 of the timeout while its other
    call, of another op and shape, waits queued: it is still a valid program, so rank 1 waits
    for the right call and the numbers are right; a rank may lag by up to the timeout."""
    timeout = 3.0
    jax_ub.finalize()  # one communicator on these devices: this test's
    jax_ub.configure(timeout_s=timeout)
    mesh = mesh1d(2)
    m, k, n = 8, 32, 16
    x, w, h, e = rand(2 * m, k), rand(k, 2 * n), rand(2 * m, 2 * k), rand(9, 64, 64)
    w2 = rand(2 * k, n)

    def run(impl):
        def body(x, w, h, w2, e):
            rest = [jnp.sin(e[i]) for i in range(len(e))]  # a dataflow-sized program
            return AG(x, w, "tp", impl=impl), RS(h, w2, "tp", impl=impl), *rest

        specs = (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"), P())
        return smap(body, mesh, specs, (P(None, "tp"), P("tp"), *[P()] * len(e)))

    args = (x, w, h, w2, e)
    ref, ub = run("xla")(*args), run("ub")
    jax.block_until_ready(ub(*args))
    comm, device = _comm_id(mesh), communicator._device_ordinal(mesh.devices.flat[1])
    held_first = 0
    for attempt in range(3):
        _host.hold_next_call(comm, device, timeout * 2 / 3)
        got = jax.block_until_ready(ub(*args))
        for name, g, r in zip(("AG", "RS"), got, ref):
            assert rel_err(g, r) < 1e-5, f"{name}, attempt {attempt}"
        order = _host.leader_order(comm, communicator._device_ordinal(mesh.devices.flat[0]))
        held_first += order[-2] == _host.held_key(comm)
    assert held_first > 0, "rank 0 never ran rank 1's held call first: the test tested nothing"
