"""The second GEMM lane (src/protocol/schedule.h, kSecondGemmLane): GEMMs that would run back
to back on the compute lane take turns with a second lane, a stream of its own on a GPU. The
step lists themselves (every rank's, read from the host extension): which GEMMs go there, that
each push of a partial waits for the lane of the GEMM that wrote it, and that the compute lane
joins the second lane before anything reads what its GEMMs wrote or frees what they read. The
values on CPU devices, where the host runs these very lists, are in the ops' own tests."""

import jax.numpy as jnp
import pytest
from _op_cases import op_fn
from conftest import comm_options, rel_err, to_f32, tol, use_tuning

import jax_ub
from jax_ub._src.runtime import extension

COMPUTE, SECOND_GEMM = -1, -2  # the compute lane and the second GEMM lane (schedule.h)
SIZES = [2, 3, 4, 5, 8]
LONG_K = 2560  # from here a partial's GEMM outlasts its transfer (Schedule::kEarlySumMaxK)


def rs_steps(rank: int, size: int, k: int = LONG_K, gathered: bool = False) -> list:
    options = comm_options(reduce_scatter_fold_rows=-1)
    return extension._host.call_steps(
        "matmul_reduce_scatter", rank, size, 2, k, 5, gathered, options
    )


def gemm_lanes(step_list: list) -> list[int]:
    return [st[1] for st in step_list if st[0] == "Gemm"]


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_gemms_take_turns_on_two_lanes(size, gathered):
    """Above two ranks, without folding, where a partial's GEMM outlasts its transfer
    (k >= 2560), the partials' GEMMs alternate between the compute lane and the second, the
    compute lane's first (the first peer's partial); each push of a partial joins the lane
    whose GEMM wrote it, after that GEMM; the compute lane joins the second after the last
    GEMM and before the sum that reads our own partial. Below, or at two ranks, one lane."""
    for r in range(size):
        assert gemm_lanes(rs_steps(r, size, k=LONG_K - 1, gathered=gathered)) == [COMPUTE] * size
        s = rs_steps(r, size, gathered=gathered)
        lanes = gemm_lanes(s)
        assert len(lanes) == size, r
        if size == 2:
            assert lanes == [COMPUTE, COMPUTE], r
            continue
        assert lanes == [(COMPUTE, SECOND_GEMM)[i % 2] for i in range(size)], r
        gemm = None
        for i, st in enumerate(s):
            if st[0] == "Gemm":
                gemm = st
            elif st[0] == "Copy" and st[5] == "Buffer" and st[1] != r:  # a partial pushed
                (join,) = [j for j in s[:i] if j[0] == "Join" and j[1] == st[1]]
                assert gemm is not None and join[3] == gemm[1], (r, i, join, gemm)
                assert s.index(join) > s.index(gemm), (r, i)
        last_gemm = max(i for i, st in enumerate(s) if st[0] == "Gemm")
        joins = [i for i, st in enumerate(s) if st[0] == "Join" and st[3] == SECOND_GEMM]
        summed = next(i for i, st in enumerate(s) if st[0] == "Sum" and st[1] == COMPUTE)
        assert any(last_gemm < j < summed and s[j][1] == COMPUTE for j in joins), r


@pytest.mark.parametrize("size", SIZES)
def test_a_folding_reduce_scatter_keeps_one_lane(size):
    """Where it folds (two ranks; above them the ring), each GEMM adds the partial sum the
    one before passed on: a chain, nothing to take turns with."""
    for r in range(size):
        options = comm_options(reduce_scatter_fold_rows=0, reduce_scatter_ring=True)
        s = extension._host.call_steps("matmul_reduce_scatter", r, size, 2, 3, 5, False, options)
        assert all(st[1] != SECOND_GEMM for st in s), r


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("size", SIZES)
def test_the_second_lane_is_joined_before_the_check_and_the_credits(op, size):
    """A call ends on the caller's stream, which Finish joins to the copy lanes only: the
    list itself must join the second lane into the compute lane, after its last step and
    before the check (it reads the output) and the credits (they free the buffer)."""
    n = 7168  # wide: the all-gather in turn takes two lanes
    for r in range(size):
        options = comm_options(
            all_gather_in_turn=True, all_gather_flag_gemm=False, reduce_scatter_fold_rows=-1
        )
        s = extension._host.call_steps(op, r, size, 2048, 4096, n, False, options)
        on_second = [i for i, st in enumerate(s) if st[1] == SECOND_GEMM]
        assert bool(on_second) == (size > 2), r
        if not on_second:
            continue
        joins = [i for i, st in enumerate(s) if st[0] == "Join" and st[3] == SECOND_GEMM]
        (join,) = [i for i in joins if s[i][1] == COMPUTE]
        verify = next(i for i, st in enumerate(s) if st[0] == "Verify")
        credits = [i for i, st in enumerate(s) if st[0] == "Signal" and st[1] == COMPUTE]
        assert max(on_second) < join < verify < min(credits), r


@pytest.mark.parametrize("size", [3, 4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_values_on_two_lanes(mesh1d, rand, op, size):
    """The ops whose GEMMs take two lanes by shape (the all-gather in turn with w's local
    columns n >= 2560, its flag GEMM off, the reduce-scatter with x's local columns k >= 2560)
    equal the unsharded product, over calls with new data."""
    jax_ub.finalize()  # communicators take the setting when they are created
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=False)
    try:
        f = op_fn(op, mesh1d(size), "ub")
        k, n = (16, size * LONG_K) if op == "ag" else (size * LONG_K, 8)
        for call in range(2):
            x, w = rand(size * 2, k, dtype=jnp.float32), rand(k, n, dtype=jnp.float32)
            assert rel_err(f(x, w), to_f32(x) @ to_f32(w)) < tol(jnp.float32), call
    finally:
        jax_ub.finalize()
