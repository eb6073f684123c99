"""Every step list keeps its data in order across lanes. On a GPU each lane is a stream, and
a step on one lane is ordered after a step on another only through a join (directly or
through a chain of them); the host runs the list in list order, so CPU runs cannot see a
missing join. This check replays the lists as lanes with vector clocks and asserts, for
every rank of both ops over sizes, options and shapes:

- two steps of different lanes that touch overlapping bytes of this rank's memory (x, the
  output, the gathered output, the userbuffer), one of them writing, are ordered as listed;
- a read of the userbuffer where a peer writes (a chunk or partial it pushes) comes after a
  wait for that peer's data on the reading lane, or on one it joined;
- the credits (signals on the compute lane), which let peers write the buffer again, come
  after every read of it;
- a GEMM that waits for its blocks itself (Step::parts) counts as a wait for each, and
  reads our own block where the step says (x);
- a GEMM that signals its blocks (Step::signals) is a GEMM a block, side by side, and a
  lane's wait for a block's flag orders it after that block's GEMM alone;
- the second GEMM lane's last step is joined into the compute lane (a call ends on the
  compute lane; Finish joins only the copy lanes).

Steps come from the host extension (call_steps: float32 operands throughout)."""

import itertools

import pytest
from conftest import comm_options
from test_gemm_lanes import COMPUTE, SECOND_GEMM

from jax_ub._src.runtime import extension

ES = 4  # call_steps' calls are float32
END = float("inf")
LOCAL = ("X", "Out", "Gathered", "Aux", "Buffer")  # this rank's memory; PeerBuffer is another's
FIELDS = 20  # call_steps' fields a step; expand appends a signalled GEMM's block
BLOCK_LANE = 1000  # expand's lane of a signalled GEMM's block j: BLOCK_LANE + j


def effects(st: tuple, rank: int, m: int, k: int, n: int) -> tuple[list, list]:
    """(reads, writes) of one step of `rank`'s as (region, first byte, end)."""
    kind, _, _, _, rows, src, src_off, parts, add, add_off, dst, dst_off, nbytes = st[:13]
    own, own_off, aux, aux_off = st[16:20]
    reads, writes = [], []
    if kind == "Gemm" and parts:  # the blocks it waits for itself, each of m rows
        for j in range(64):
            if parts >> j & 1:
                if j == rank:  # our own block, read where `own` says
                    assert own != "None", st
                    reads.append((own, own_off, own_off + m * k * ES))
                else:
                    reads.append((src, src_off + j * m * k * ES, src_off + (j + 1) * m * k * ES))
                writes.append((dst, dst_off + j * m * n * ES, dst_off + (j + 1) * m * n * ES))
                if aux != "None":  # the pre-GELU product, laid out as dst
                    writes.append((aux, aux_off + j * m * n * ES, aux_off + (j + 1) * m * n * ES))
    elif kind == "Gemm":
        reads.append((src, src_off, src_off + rows * k * ES))
        if add != "None":
            reads.append((add, add_off, add_off + rows * n * ES))
        writes.append((dst, dst_off, dst_off + rows * n * ES))
        if aux != "None":
            writes.append((aux, aux_off, aux_off + rows * n * ES))
    elif kind == "Copy":
        reads.append((src, src_off, src_off + nbytes))
        writes.append((dst, dst_off, dst_off + nbytes))
    elif kind == "Sum":
        size = rows * n * ES
        reads += [
            (src, src_off + j * nbytes, src_off + j * nbytes + size)
            for j in range(64)
            if parts >> j & 1
        ]
        if add != "None":
            reads.append((add, add_off, add_off + size))
        writes.append((dst, dst_off, dst_off + size))
    elif kind == "Verify":
        reads += [("Out", 0, END), ("Gathered", 0, END), ("Aux", 0, END)]
    return [r for r in reads if r[0] in LOCAL], [w for w in writes if w[0] in LOCAL]


def overlap(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def expand(step_list: list, rank: int, size: int, m: int, k: int, n: int) -> list:
    """The list with each GEMM that signals its blocks as a GEMM of m rows a block, each on a
    lane of its own (BLOCK_LANE + j) that starts after the GEMM's lane so far and that lane
    joins after all of them: one kernel's blocks end in no set order. Each block's tuple ends
    in its block."""
    out = []
    for st in step_list:
        if not (st[0] == "Gemm" and st[15]):
            out.append(st)
            continue
        blocks = [j for j in range(size) if st[7] >> j & 1]
        for j in blocks:
            block = list(st)
            block[1], block[4], block[7] = BLOCK_LANE + j, m, 0
            block[6], block[11] = st[6] + j * m * k * ES, st[11] + j * m * n * ES
            out.append(("Join", BLOCK_LANE + j, -1, st[1], *st[4:]))
            out.append((*block, j))
        out += [("Join", st[1], -1, BLOCK_LANE + j, *st[4:]) for j in blocks]
    return out


def replay(step_list: list) -> list[dict]:
    """Each step's lane, place on it, and vector clock (steps of each lane ordered before it,
    itself included) and the peers whose data waits are ordered before it; a list `expand`ed."""
    clock: dict[int, dict[int, int]] = {}
    landed: dict[int, set] = {}
    count: dict[int, int] = {}
    block_clock: dict[int, dict[int, int]] = {}  # a signalled block's GEMM's clock
    out = []
    for st in step_list:
        kind, lane, peer, on_lane = st[:4]
        mine, seen = clock.setdefault(lane, {}), landed.setdefault(lane, set())
        if kind == "Join":  # everything enqueued on on_lane so far, and what it had seen
            for other, c in clock.get(on_lane, {}).items():
                mine[other] = max(mine.get(other, 0), c)
            mine[on_lane] = max(mine.get(on_lane, 0), count.get(on_lane, 0))
            seen |= landed.get(on_lane, set())
        if kind == "Wait" and st[13] == "Block":  # our own GEMM's block, enqueued before it
            assert st[14] in block_clock, ("a wait for a block no GEMM before it signals", st)
            for other, c in block_clock[st[14]].items():
                mine[other] = max(mine.get(other, 0), c)
        elif kind == "Wait" and peer != lane:  # a data wait (a credit's waits on the peer's lane)
            seen.add(peer)
        if kind == "Gemm" and st[7]:  # a GEMM that waits for its blocks' data itself
            seen |= {j for j in range(64) if st[7] >> j & 1}
        count[lane] = count.get(lane, 0) + 1
        mine[lane] = count[lane]
        if len(st) > FIELDS:  # one block of a GEMM that signals them (expand)
            block_clock[st[FIELDS]] = dict(mine)
        out.append({"lane": lane, "place": count[lane], "clock": dict(mine), "landed": set(seen)})
    return out


def before(a: dict, b: dict) -> bool:
    return b["clock"].get(a["lane"], 0) >= a["place"]


def check(step_list: list, rank: int, size: int, m: int, k: int, n: int, peer_slots: str):
    """The module's checks for one rank's list; `peer_slots` (the op, or "" for none) checks
    that reads of a peer's slot of the buffer follow a wait for that peer."""
    step_list = expand(step_list, rank, size, m, k, n)
    order = replay(step_list)
    eff = [effects(st, rank, m, k, n) for st in step_list]
    local_writes = [w for _, ws in eff for w in ws if w[0] == "Buffer"]
    chunk_of = {"all_gather_matmul": m * k * ES, "matmul_reduce_scatter": m * n * ES}
    for j, (reads_j, writes_j) in enumerate(eff):
        for i in range(j):
            if order[i]["lane"] == order[j]["lane"]:
                continue
            reads_i, writes_i = eff[i]
            clash = any(overlap(a, b) for a in writes_i for b in reads_j + writes_j) or any(
                overlap(a, b) for a in reads_i for b in writes_j
            )
            assert not clash or before(order[i], order[j]), (rank, i, j, step_list[i], step_list[j])
        if peer_slots:  # a peer's chunk or partial, at its rank's slot of the buffer
            chunk = chunk_of[peer_slots]
            for region, lo, hi in reads_j:
                if region != "Buffer" or lo >= size * chunk:
                    continue
                if any(lo < w[2] and w[1] < hi for w in local_writes):
                    continue  # our own (a staged partial, our partial)
                for p in range(lo // chunk, (hi - 1) // chunk + 1):
                    assert p in order[j]["landed"], (rank, j, step_list[j], p)
    credits = [i for i, st in enumerate(step_list) if st[0] == "Signal" and st[1] == COMPUTE]
    for i, (reads_i, _) in enumerate(eff):
        if any(r[0] == "Buffer" for r in reads_i):
            assert all(before(order[i], order[c]) for c in credits), (rank, i, step_list[i])
    on_second = [i for i, o in enumerate(order) if o["lane"] == SECOND_GEMM]
    if on_second:
        last_compute = max(i for i, o in enumerate(order) if o["lane"] == COMPUTE)
        assert before(order[on_second[-1]], order[last_compute]), rank


SHAPES = [(2, 3, 5), (1, 4096, 7168), (2048, 4096, 1280), (3, 2560, 2560)]
CHOICES = (True, False, None)
AG_OPTIONS = [
    {"all_gather_in_turn": t, "two_gemm_lanes": g, "all_gather_flag_gemm": f}
    for t, g, f in itertools.product(CHOICES, CHOICES, CHOICES)
]
RS_OPTIONS = [
    {
        "reduce_scatter_fold_rows": f,
        "reduce_scatter_early_sum": e,
        "reduce_scatter_ring": r,
        "two_gemm_lanes": g,
        "reduce_scatter_signal_gemm": sg,
    }
    for f, e, r, g, sg in itertools.product((-1, 0, 2048), CHOICES, (False, True), CHOICES, CHOICES)
]


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_every_list_keeps_its_data_in_order_across_lanes(op, size, gathered):
    for (m, k, n), options in itertools.product(
        SHAPES, AG_OPTIONS if op == "all_gather_matmul" else RS_OPTIONS
    ):
        opts = comm_options(**options)
        for r in range(size):
            s = extension._host.call_steps(op, r, size, m, k, n, gathered, opts)
            # Where a reduce-scatter folds (its GEMMs add the partial sum passed on), a peer's
            # sum lands at a slot of its own, piece by piece: the peer-slot check covers the rest.
            folds = any(st[0] == "Gemm" and st[8] != "None" for st in s)
            check(s, r, size, m, k, n, op if not folds else "")


@pytest.mark.parametrize("size", [2, 3, 8])
@pytest.mark.parametrize("schedule", ["at_once", "in_turn", "flag_gemm"])
@pytest.mark.parametrize("gathered", [False, True])
def test_a_failed_check_poisons_every_output_the_call_writes(size, schedule, gathered):
    """An all-gather's list ends with one check (Verify) that, failed, fills with NaN the whole
    output, the gathered copy where asked and the pre-GELU product where its GEMMs keep it (as
    many bytes as the output): a failed call hands back no plausible number. DGELU's aux is
    its input: the check leaves it alone."""
    m, k, n = 2, 3, 3072  # n wide enough for the flag GEMM
    opts = comm_options(
        all_gather_in_turn=schedule != "at_once",  # the flag GEMM's call goes in turn
        all_gather_flag_gemm=schedule == "flag_gemm",
    )
    out_bytes = size * m * n * ES
    for epilogue, aux in [("", "None"), ("gelu_aux", "Aux"), ("dgelu", "None")]:
        for r in range(size):
            s = extension._host.call_steps(
                "all_gather_matmul", r, size, m, k, n, gathered, opts, epilogue
            )
            flag = any(st[0] == "Gemm" and st[7] for st in s)
            assert flag == (schedule == "flag_gemm" and size >= 3), (schedule, size, epilogue)
            checks = [st for st in s if st[0] == "Verify"]
            assert len(checks) == 1 and s.index(checks[0]) > max(
                i for i, st in enumerate(s) if st[0] == "Gemm"
            )
            v = checks[0]
            assert (v[10], v[11], v[12]) == ("Out", 0, out_bytes), (epilogue, v)
            assert (v[5], v[6]) == (("Gathered", 0) if gathered else ("None", 0)), v
            assert (v[18], v[19]) == (aux, 0), (epilogue, r, v)
            check(s, r, size, m, k, n, "all_gather_matmul")  # the check after every GEMM's aux
