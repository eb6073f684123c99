"""The all-gather's flag GEMM (Schedule::AllGatherFlagGemm, Tuning.all_gather_flag_gemm): in
turn, one GEMM multiplies every chunk (ours first, read from x where it lies), waiting
for each other chunk's data flag itself (on Hopper GPUs inside one persistent kernel, FlagGemm). The
step lists themselves (every rank's, read from the host extension): where it runs, what it reads
and waits for, and that nothing else waits for its chunks on its lane. The values on CPU devices,
where the host runs these very lists (taking the chunks in the kernel's order and waiting for
each), epilogues and the gathered copy: test_all_gather_in_turn.py; gradients in every way to
call: test_grad_matrix.py; on GPUs, the kernel: test_gpu_schedules.py."""

import pytest
from conftest import comm_options
from test_gemm_lanes import COMPUTE

from jax_ub._src.runtime import extension

WIDE = 2560  # from here a chunk's GEMM outlasts its landing (2 Schedule::kInTurnColumnsPerPeer)
FLAG_N = 3072  # the flag GEMM's least n by shape (Schedule::kFlagGemmMinColumns)


def steps(
    rank: int, size: int, n: int, flag: bool | None = None, in_turn: bool | None = True, m=2, k=3
) -> list:
    """Rank `rank`'s step list (in turn unless told) for x[m, k] @ w[k, n] a rank (float32)."""
    opts = comm_options(all_gather_in_turn=in_turn, all_gather_flag_gemm=flag)
    return extension._host.call_steps("all_gather_matmul", rank, size, m, k, n, False, opts)


def flag_gemms(step_list: list) -> list:
    return [st for st in step_list if st[0] == "Gemm" and st[7]]


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16, 17])
def test_where_the_flag_gemm_runs(size):
    """In turn, by shape where a chunk's GEMM clearly outlasts its landing (n >= 3072; Llama 3
    8B's gate/up at tp=8 has n = 3584, 70B's qkv at tp=4, where it lost, 2560), from 3
    ranks to 16 (the kernel's order holds 16 blocks); forced on, at any n; off, never; never at
    two ranks, where in turn has one remote chunk, nor beside a second GEMM lane."""
    expect = 2 < size <= 16
    for r in (0, size - 1):
        s = steps(r, size, FLAG_N)
        assert bool(flag_gemms(s)) == expect, r
        assert not flag_gemms(steps(r, size, FLAG_N - 1)), r
        assert bool(flag_gemms(steps(r, size, 5, flag=True))) == expect, r
        assert not flag_gemms(steps(r, size, FLAG_N, flag=False)), r
        if expect:
            assert all(st[1] == COMPUTE for st in s if st[0] == "Gemm"), r


def pushes_in_turn(step_list: list) -> bool:
    """Whether each push after the first waits (a join) for the push before."""
    return any(st[0] == "Join" and st[1] >= 0 and st[3] >= 0 for st in step_list)


@pytest.mark.parametrize("size", [3, 4, 8])
def test_by_shape_the_flag_gemm_sends_the_call_in_turn(size):
    """With in turn left to shape, the flag GEMM's shapes go in turn even where in turn alone
    would push all at once (Llama 3 8B's gate/up at tp=4: 2048 x 4096 x 7168 a rank, 1.069x
    the floor all at once, 1.001x in the kernel, modelled): where n >= 3072 and the op repays
    in turn's serial copies (m k n > 1.75e9 (size - 1) / (size - 2)). A short op, or one
    whose flag GEMM is off, keeps in turn's own rule; in turn forced off stays off."""
    m, k = 2048, 4096
    for n in (FLAG_N, 3584, 7168):
        s = steps(0, size, n, in_turn=None, m=m, k=k)
        assert flag_gemms(s) and pushes_in_turn(s), n
        alone = steps(0, size, n, flag=False, in_turn=None, m=m, k=k)  # in turn's own rule
        assert pushes_in_turn(alone) == (n < 1280 * (size - 1)), n
        assert not flag_gemms(steps(0, size, n, in_turn=False, m=m, k=k)), n
        assert not pushes_in_turn(steps(0, size, n, in_turn=None, m=2, k=3)), n
    assert not flag_gemms(steps(0, size, FLAG_N - 8, in_turn=None, m=m, k=k))


@pytest.mark.parametrize("size", [3, 4, 8])
def test_the_flag_gemm_takes_every_chunk_ours_first(size):
    """One GEMM over the buffer and the whole output, its parts every rank's chunk, ours
    included and read from x where it lies (nothing copies x into the buffer: a copy before
    the kernel cost 1-3% of the op); no other GEMM, and no wait for data on the compute lane
    (the GEMM's own waits replace them); the credits after it."""
    m, n = 2, WIDE
    for r in range(size):
        s = steps(r, size, n, flag=True)
        assert not [st for st in s if st[0] == "Copy" and st[10] == "Buffer"], r
        assert not [st for st in s if st[0] == "Signal" and st[2] == r], r
        (gemm,) = [st for st in s if st[0] == "Gemm"]
        assert next(st for st in s if st[1] == COMPUTE) == gemm, r
        assert (gemm[1], gemm[4], gemm[5], gemm[6], gemm[10], gemm[11], gemm[16], gemm[17]) == (
            COMPUTE,
            size * m,
            "Buffer",
            0,
            "Out",
            0,
            "X",
            0,
        ), r
        assert gemm[7] == (1 << size) - 1, r
        assert not [st for st in s if st[0] == "Wait" and st[1] == COMPUTE], r
        credits = [i for i, st in enumerate(s) if st[0] == "Signal" and st[1] == COMPUTE]
        assert len(credits) == size - 1 and min(credits) > s.index(gemm), r


@pytest.mark.parametrize("size", [3, 4, 8])
def test_the_gathered_copies_wait_on_our_own_lane(size):
    """Where the caller keeps all_gather(x), each remote chunk's copy into it waits for that
    chunk on our own lane, which the compute lane joins before the check."""
    opts = comm_options(all_gather_in_turn=True, all_gather_flag_gemm=True)
    for r in range(size):
        s = extension._host.call_steps("all_gather_matmul", r, size, 2, 3, WIDE, True, opts)
        assert flag_gemms(s), r
        waited = [st[2] for st in s if st[0] == "Wait" and st[1] == r]
        assert sorted(waited) == [j for j in range(size) if j != r], r
        verify = next(i for i, st in enumerate(s) if st[0] == "Verify")
        assert any(st[0] == "Join" and st[1] == COMPUTE and st[3] == r for st in s[:verify]), r
