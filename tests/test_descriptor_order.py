"""Every peer's descriptor reaches a rank before that rank's check. A call ends with one
check (Verify) that compares the descriptors its peers published into its slots with its own;
on a GPU it reads them once, so a peer's publish that is not ordered before the check, through
a chain of lanes, joins, and a peer's signal that a wait of ours (or of a third rank's, whose
signal we wait for) awaited, can be read stale: a call that agrees fails as disagreeing, and
its output is NaN.

This replays every rank's step list of one call together, as a graph over the ranks: a step
follows the one before it on its lane, a join follows what its lane joined, a data wait (and a
GEMM that waits for its blocks itself) follows the awaited peer's signal, a wait for our own
GEMM's block follows that GEMM. Credits are the previous call's and add no edge. For both ops
over sizes, options and shapes, each rank's check must follow every peer's publish to it."""

import functools
import itertools

import pytest
from conftest import comm_options
from test_step_order import AG_OPTIONS, RS_OPTIONS, SHAPES

from jax_ub._src.runtime import extension


def graph(lists: list[list]) -> dict:
    """Each step's (rank, index) -> its direct predecessors, over every rank's list."""
    size = len(lists)
    # (receiver, flag, slot) -> the sender's signalling steps, in list order.
    signals: dict[tuple, list] = {}
    for q, steps in enumerate(lists):
        for i, st in enumerate(steps):
            if st[0] == "Signal":
                slot = st[14] if st[14] >= 0 else q
                signals.setdefault((st[2], st[13], slot), []).append((q, i))
    preds: dict[tuple, list] = {}
    for r, steps in enumerate(lists):
        last: dict[int, tuple] = {}  # lane -> its latest step
        signalling_gemm = None
        for i, st in enumerate(steps):
            kind, lane, peer, on_lane = st[:4]
            node, p = (r, i), []
            if lane in last:
                p.append(last[lane])
            if kind == "Join" and on_lane in last:
                p.append(last[on_lane])
            if kind == "Wait" and st[13] == "Block":
                assert signalling_gemm is not None, (r, i, st)
                p.append(signalling_gemm)
            elif kind == "Wait" and st[13] != "Credit":
                slot = st[14] if st[14] >= 0 else peer
                sent = [s for s in signals.get((r, st[13], slot), []) if s[0] == peer]
                assert sent, ("a wait no peer signals", r, i, st)
                p.append(sent[0])  # the first raises the flag to this call's epoch
            if kind == "Gemm" and st[7] and not st[15]:  # waits for each peer's block itself
                for j in range(size):
                    if st[7] >> j & 1 and j != r:
                        p.append(signals[(r, "Data", j)][0])
            if kind == "Gemm" and st[15]:
                signalling_gemm = node
            preds[node] = p
            last[lane] = node
    return preds


def publishes_before(lists: list[list]) -> dict[tuple, frozenset]:
    """Each rank's check -> the (sender, receiver) publishes ordered before it."""
    preds = graph(lists)

    @functools.cache
    def seen(node: tuple) -> frozenset:
        r, i = node
        st = lists[r][i]
        own = {(r, st[2])} if st[0] == "Publish" else set()
        return frozenset(own.union(*(seen(p) for p in preds[node])))

    out = {}
    for r, steps in enumerate(lists):
        # Deep chains: walk each rank's list in order so the cache fills from the front.
        for i in range(len(steps)):
            seen((r, i))
        checks = [i for i, st in enumerate(steps) if st[0] == "Verify"]
        assert len(checks) == 1, (r, steps)
        out[r] = seen((r, checks[0]))
    return out


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_every_peers_descriptor_precedes_the_check(op, size, gathered):
    for (m, k, n), options in itertools.product(
        SHAPES, AG_OPTIONS if op == "all_gather_matmul" else RS_OPTIONS
    ):
        opts = comm_options(**options)
        lists = [
            extension._host.call_steps(op, r, size, m, k, n, gathered, opts) for r in range(size)
        ]
        before = publishes_before(lists)
        for r in range(size):
            missing = [q for q in range(size) if q != r and (q, r) not in before[r]]
            assert not missing, (op, (m, k, n), options, r, missing)
