"""The order in which a CPU device's jax_ub calls reach its communicator.

A slot runs its calls in the order they arrive, and peers pair calls by their count, so
calls must arrive in the same order on every device of a group. XLA's CPU runtime gives
them so: it starts a device's next side-effecting custom call (every jax_ub call) only
once the previous one has finished, in the program's order, even where no data path joins
them, and a program's calls only after the previous program's. These tests hold one
device's call back (``_host.hold_next_call``: any call the device makes meanwhile would
overtake it) and check that nothing overtakes: were a second call started meanwhile, the
held rank would pair the other call's shards with its own (two all-gathers of equal
shapes: equal descriptors, wrong numbers)."""

import time

import jax
import pytest
from conftest import rel_err, smap
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host
from jax_ub._src.runtime import communicator

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter
HOLD_S = 0.5


def _hold_next_call(mesh, rank: int) -> None:
    """Hold the next call of the device of ``rank`` of ``mesh``'s tp group."""
    devices = set(mesh.devices.flat)
    (comm,) = [
        c
        for c in communicator.live_communicators()
        if c.platform == "cpu" and c.axis_name == "tp" and set(c.devices) == devices
    ]
    device = mesh.devices.flat[rank]
    _host.hold_next_call(comm.id, communicator._device_ordinal(device), HOLD_S)


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
def test_independent_calls_of_one_program_arrive_in_program_order(mesh1d, rand, tp, held_rank):
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


def test_calls_of_programs_dispatched_without_a_sync_arrive_in_dispatch_order(mesh1d, rand):
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
