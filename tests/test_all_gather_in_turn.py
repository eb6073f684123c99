"""all_gather_matmul with Tuning.all_gather_in_turn: each rank pushes its chunk to one peer at
a time and multiplies each chunk as it lands. The step lists themselves (every rank's, read
from the host extension): at each step every rank receives exactly one chunk, and each
rank multiplies its chunks in the order they land, each GEMM taking every chunk landed by its
start where w is wide; off, every push at once; by default, in turn where w's local columns are
few. Then the op's values, epilogues, the gathered copy and
gradients on CPU devices, where the host runs those very lists."""

import math

import jax.numpy as jnp
import pytest
from _op_cases import op_fn
from conftest import comm_options, rel_err, to_f32, tol, use_tuning
from test_epilogue import ag_epilogue_fn, ag_reference
from test_gelu_mlp import assert_grads_match_xla, operands
from test_gemm_lanes import COMPUTE, SECOND_GEMM

import jax_ub
from jax_ub._src.runtime import extension

SIZES = [2, 3, 4, 8]


def steps(
    rank: int,
    size: int,
    in_turn: bool | None,
    m: int = 2,
    gathered: bool = False,
    n: int = 5,
    k: int = 3,
    flag_gemm: bool | None = False,
) -> list:
    """Rank `rank`'s step list for an all-gather GEMM of a rank's x[m, k] @ w[k, n] (the GEMMs
    of spans: the flag GEMM, test_flag_gemm.py's, off unless asked for)."""
    options = comm_options(all_gather_in_turn=in_turn, all_gather_flag_gemm=flag_gemm)
    return extension._host.call_steps("all_gather_matmul", rank, size, m, k, n, gathered, options)


def pushes(step_list: list, rank: int) -> list[int]:
    """The peers `rank` copies its chunk to, in list order (a peer's copy lane is its rank;
    our own lane's copies fill the gathered output)."""
    return [lane for kind, lane, *_ in step_list if kind == "Copy" and lane not in (-1, rank)]


def remote_gemm_chunks(step_list: list, rank: int, m: int = 2, k: int = 3) -> list[list[int]]:
    """The chunks each GEMM after the local one multiplies, in list order, by the peers
    that the waits on its lane named since that lane's GEMM before (a chunk: m rows of k
    float32)."""
    chunk_bytes = m * k * 4
    chunks, waited = [], {COMPUTE: [], SECOND_GEMM: []}
    for kind, lane, peer, _, rows, region, offset, *_ in step_list:
        if lane not in waited:
            continue
        if kind == "Wait":
            waited[lane].append(peer)
        elif kind == "Gemm" and region == "Buffer":
            first = offset // chunk_bytes
            chunks.append(list(range(first, first + rows // m)))
            assert sorted(waited[lane]) == chunks[-1], (rank, lane, waited, chunks[-1])
            waited[lane] = []
    return chunks


@pytest.mark.parametrize("size", SIZES)
def test_each_gpu_receives_one_chunk_a_step_and_multiplies_it_as_it_lands(size):
    """In turn: rank r's s-th copy goes to r + s and waits (a join) for its copy before, so
    at step s the senders map onto the receivers one to one; and each rank's GEMMs after
    its own chunk take one chunk each, in the order those steps deliver them."""
    lists = [steps(r, size, True) for r in range(size)]
    order = [pushes(s, r) for r, s in enumerate(lists)]
    for r, s in enumerate(lists):
        assert order[r] == [(r + i) % size for i in range(1, size)], r
        for prev, peer in zip(order[r], order[r][1:]):
            joins = [st for st in s if st[0] == "Join" and st[1] == peer]
            assert [st[3] for st in joins] == [prev], (r, peer, joins)
            # the join comes before the lane's copy
            lane = [st[0] for st in s if st[1] == peer]
            assert lane.index("Join") < lane.index("Copy"), (r, peer, lane)
    for step in range(size - 1):
        receivers = [order[r][step] for r in range(size)]
        assert sorted(receivers) == list(range(size)), (step, receivers)
    for r, s in enumerate(lists):
        landed = [next(q for q in range(size) if order[q][i] == r) for i in range(size - 1)]
        assert remote_gemm_chunks(s, r) == [[q] for q in landed], r


def landed_runs(rank: int, size: int, n: int) -> list[list[int]]:
    """The model's GEMMs after the local one (Schedule::InTurnSpans): chunk (rank - s) % size
    lands at time s, a chunk's GEMM takes n / 2560 of that; a GEMM starts once the one before
    has ended and its first chunk has landed, and takes every chunk landed by then, up to
    chunk 0 (rows stay contiguous)."""
    gemm, free, s, runs = n / 2560, n / 2560, 1, []
    while s < size:
        start = max(free, s)
        run = [(rank - t) % size for t in range(s, min(size - 1, math.floor(start)) + 1)]
        run = run[: run.index(0) + 1] if 0 in run else run
        runs.append(sorted(run))
        free, s = start + len(run) * gemm, s + len(run)
    return runs


@pytest.mark.parametrize("size", SIZES)
def test_in_turn_a_gemm_takes_every_chunk_landed_by_its_start(size):
    """Where a chunk's GEMM outlasts its landing (n >= 2560), chunks pile up and one GEMM
    takes each run of them: fewer, larger GEMMs, in landing order, each chunk once."""
    for n in (1280, 2559, 2560, 3584, 7168, 20000):
        for r in range(size):
            runs = remote_gemm_chunks(steps(r, size, True, n=n), r)
            assert runs == landed_runs(r, size, n), (n, r, runs)
            order = [(r - s) % size for s in range(1, size)]
            assert [q for run in runs for q in sorted(run, reverse=True)] == order, (n, r)
            assert all(run == list(range(run[0], run[-1] + 1)) for run in runs), (n, r)
            if n < 2560 or size == 2:
                assert all(len(run) == 1 for run in runs), (n, r)
    # Llama 3 70B's gate/up at tp=8 (n = 7168): 3 or 4 GEMMs, not 8.
    assert remote_gemm_chunks(steps(0, 8, True, n=7168), 0) == [[6, 7], [1, 2, 3, 4, 5]]
    assert remote_gemm_chunks(steps(4, 8, True, n=7168), 4) == [[2, 3], [0, 1], [5, 6, 7]]


@pytest.mark.parametrize("size", SIZES)
def test_in_turn_long_gemms_take_turns_on_two_lanes(size):
    """Where a chunk's GEMM outlasts its landing (n >= 2560) above two ranks, the remote
    GEMMs in turn alternate between the second GEMM lane and the compute lane, the second
    first, each after its own chunks' waits on its lane; the compute lane joins the second
    after the last GEMM, before the check and the credits that free the buffer. Elsewhere
    nothing runs on the second lane."""
    two_lane_lists = 0
    for n in (1280, 2559, 2560, 7168):
        for in_turn in (True, False, None):
            for r in range(size):
                s = steps(r, size, in_turn, n=n, m=2048, k=4096)
                gemms = [st for st in s if st[0] == "Gemm"]
                two = size > 2 and n >= 2560 and s == steps(r, size, True, n=n, m=2048, k=4096)
                if not two:
                    assert all(st[1] != SECOND_GEMM for st in s), (n, in_turn, r)
                    continue
                assert gemms[0][1] == COMPUTE and gemms[0][5] == "X", (n, r)
                lanes = [st[1] for st in gemms[1:]]
                assert lanes == [(SECOND_GEMM, COMPUTE)[i % 2] for i in range(len(lanes))], r
                (join,) = [i for i, st in enumerate(s) if st[0] == "Join" and st[3] == SECOND_GEMM]
                assert s[join][1] == COMPUTE, (n, r)
                last_gemm = max(i for i, st in enumerate(s) if st[0] == "Gemm")
                verify = next(i for i, st in enumerate(s) if st[0] == "Verify")
                credits = [i for i, st in enumerate(s) if st[0] == "Signal" and st[1] == COMPUTE]
                assert last_gemm < join < verify < min(credits), (n, r)
                assert remote_gemm_chunks(s, r, m=2048, k=4096), (n, r)  # waits on each lane
                two_lane_lists += 1
    # forced in turn at n >= 2560, and by shape (None) where n < 1280 (size - 1) too
    by_shape = sum(n < 1280 * (size - 1) for n in (2560, 7168))
    assert two_lane_lists == (0 if size == 2 else (2 + by_shape) * size)


def all_at_once(step_list: list, rank: int, size: int, m: int = 2, k: int = 3) -> bool:
    """No copy lane waits for another, and the remote chunks are multiplied as at most two
    runs of contiguous rows, after and before our own."""
    joins = [st for st in step_list if st[0] == "Join" and st[1] >= 0 and st[3] >= 0]
    runs = remote_gemm_chunks(step_list, rank, m, k)
    return not joins and runs == [c for c in (list(range(rank + 1, size)), list(range(rank))) if c]


@pytest.mark.parametrize("size", SIZES)
def test_off_every_push_starts_at_once(size):
    for r in range(size):
        assert all_at_once(steps(r, size, False), r, size), r


@pytest.mark.parametrize("size", SIZES)
def test_by_default_in_turn_where_w_has_few_local_columns_and_the_gemm_is_long(size):
    """By default (None) a call goes in turn where w's local columns n < 1280 (size - 1) and
    m k n > 1.75e9 (size - 1) / (size - 2) (Schedule::AllGatherInTurnPays: the transfer
    outlasts twice the local chunk's GEMM, which repays in turn's serial copies), else every
    push at once; on two ranks both are one list. (The flag GEMM, off here, also sends wide
    calls in turn by shape: test_flag_gemm.py.)"""
    limit = 1280 * (size - 1)
    k = 4096
    for r in range(size):
        for m, n in ((2048, 5), (2048, limit - 8), (2048, limit), (2048, 4 * limit), (2, 5)):
            pays = size > 2 and n < limit and m * k * n * (size - 2) > 1.75e9 * (size - 1)
            want = steps(r, size, pays, m=m, n=n, k=k)
            assert steps(r, size, None, m=m, n=n, k=k) == want, (r, m, n)
            assert pays == (size > 2 and m == 2048 and n < limit and n > 5), (r, m, n)
        assert all_at_once(steps(r, size, None, m=2048, n=limit, k=k), r, size, 2048, k), r
    assert steps(0, 2, True) == steps(0, 2, False)


def test_a_gathered_copy_follows_each_chunk():
    """With the gathered output asked for, our own lane copies each chunk out of the buffer
    after waiting for it, one chunk at a time in turn."""
    size, chunk = 4, 2 * 3 * 4
    s = steps(1, size, True, gathered=True)
    copies = [st for st in s if st[0] == "Copy" and st[1] == 1 and st[5] == "Buffer"]
    assert [st[6] // chunk for st in copies] == [0, 3, 2]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("flag_gemm", [None, True], ids=["spans", "flag_gemm"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_values(mesh1d, rand, size, m, dtype, flag_gemm):
    """The op in turn equals the gathered product, over several calls with new data (flags by
    epoch, the buffer reused, credits): with GEMMs of spans, and (above 2 ranks) with the flag
    GEMM forced on (test_flag_gemm.py), which the host runs block by block in its order."""
    if flag_gemm and size == 2:
        pytest.skip("two ranks never take the flag GEMM")
    jax_ub.finalize()  # communicators take the setting when they are created
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=flag_gemm)
    try:
        f = op_fn("ag", mesh1d(size), "ub")
        for call in range(3):
            x = rand(size * m, 16, dtype=dtype)
            w = rand(16, size * 6, dtype=dtype)
            out = f(x, w)
            assert out.shape == (size * m, size * 6) and out.dtype == dtype
            assert rel_err(out, to_f32(x) @ to_f32(w)) < tol(dtype), call
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("size", [4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_values_with_gemms_over_runs_of_chunks(mesh1d, rand, size, dtype):
    """Wide w (7168 local columns), the flag GEMM off: the GEMMs in turn take runs of chunks
    (see above); the product is still the gathered one, over calls with new data."""
    jax_ub.finalize()
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=False)
    try:
        f = op_fn("ag", mesh1d(size), "ub")
        for call in range(2):
            x = rand(size * 2, 16, dtype=dtype)
            w = rand(16, size * 7168, dtype=dtype)
            assert rel_err(f(x, w), to_f32(x) @ to_f32(w)) < tol(dtype), call
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("flag_gemm", [None, True], ids=["spans", "flag_gemm"])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_epilogue_in_each_chunks_gemm(mesh1d, rand, activation, flag_gemm):
    """Bias and GELU in every chunk's GEMM (or every block of the flag GEMM, on the host: GPUs
    keep their library GEMMs for epilogues), each chunk's rows in their own place."""
    jax_ub.finalize()
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=flag_gemm)
    try:
        x, w, b = rand(4 * 3, 16), rand(16, 4 * 6, scale=0.5), rand(4 * 6)
        out = ag_epilogue_fn(mesh1d(4), activation=activation)(x, w, b)
        assert rel_err(out, ag_reference(x, w, b, activation)) < 1e-5
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("flag_gemm", [None, True], ids=["spans", "flag_gemm"])
@pytest.mark.parametrize("keep_gathered", [False, True])
def test_gradients(mesh1d, rand, keep_gathered, flag_gemm):
    """gelu_mlp's gradients in turn against impl="xla"'s: its forward all-gather keeps GELU's
    input (aux) and, with keep_gathered, all_gather(x) for the backward (the gathered copy,
    which with the flag GEMM waits for each chunk on our own lane)."""
    jax_ub.finalize()
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=flag_gemm)
    jax_ub.configure(keep_gathered=keep_gathered)
    try:
        assert_grads_match_xla(mesh1d(4), operands(rand, 4))
    finally:
        jax_ub.finalize()


def test_call_steps_names_bad_arguments():
    with pytest.raises(ValueError, match=r"got rank 4, size 4, m 2, k 3, n 5"):
        extension._host.call_steps("all_gather_matmul", 4, 4, 2, 3, 5, False, comm_options())
    with pytest.raises(ValueError, match=r"unknown op gemm"):
        extension._host.call_steps("gemm", 0, 4, 2, 3, 5, False, comm_options())
