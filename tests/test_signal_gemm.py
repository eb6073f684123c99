"""The reduce-scatter's signal GEMM (Schedule::ReduceScatterSignalGemm,
Tuning.reduce_scatter_signal_gemm): one GEMM computes every partial, the blocks in push order and
ours last (into the staging area), and raises this rank's flag of each peer's block once it is
written; each push waits on its lane for its block's flag, not for a GEMM's end (on Hopper GPUs
the flags rise inside one persistent kernel, SignalGemm). The step lists themselves (every
rank's, read from the host extension); test_step_order.py replays them as lanes, each block of
the GEMM on a lane of its own. Then the op's values on CPU devices, where the host runs these
very lists (raising each block's flag as it writes the block), and gradients in every way to
call: test_grad_matrix.py."""

import jax.numpy as jnp
import pytest
from _op_cases import op_fn
from conftest import comm_options, rel_err, to_f32, tol, use_tuning
from test_gemm_lanes import COMPUTE

import jax_ub
from jax_ub._src.runtime import extension

M, K, N = 2, 3, 5  # a rank's output rows, x's local columns, w's columns: float32 partials
PARTIAL = M * N * 4


def steps(rank: int, size: int, signal: bool | None, gathered: bool = False, **options) -> list:
    opts = comm_options(reduce_scatter_signal_gemm=signal, **options)
    return extension._host.call_steps("matmul_reduce_scatter", rank, size, M, K, N, gathered, opts)


def gemms(step_list: list) -> list:
    return [st for st in step_list if st[0] == "Gemm"]


def bits(mask: int) -> list[int]:
    return [j for j in range(64) if mask >> j & 1]


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16, 17])
def test_where_the_signal_gemm_runs(size):
    """Forced on, from 3 ranks to 16 (the kernel's order holds 16 blocks; at two the GPUs agree
    on kernels by the GEMMs they plan) wherever the call does not fold; by shape (None) and off,
    never: timed in the library's schedule on one H200 (a modelled link), it won nowhere beyond
    the runs' spread."""
    for signal in (True, None, False):
        for fold_rows in (-1, 0):  # a fold (a ring) has no sum pass to read our partial
            for ring in (False, True):
                s = steps(
                    size - 1,
                    size,
                    signal,
                    reduce_scatter_fold_rows=fold_rows,
                    reduce_scatter_ring=ring,
                )
                folds = fold_rows == 0 and (size == 2 or ring)
                want = signal is True and 2 < size <= 16 and not folds
                assert any(st[15] for st in gemms(s)) == want, (size, signal, fold_rows, ring)


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("size", [3, 4, 8])
def test_one_gemm_signals_every_block_and_each_push_waits_for_its_own(size, early, gathered):
    """The call's only GEMM: on the compute lane, every block of x (size m rows) into the staging
    area, signalling. Each peer's lane then waits for that peer's block flag on this rank, after
    the GEMM in the list, and copies exactly that block of the staging area to the peer's slot for
    us before raising the peer's data flag. The sum (or the sums, early) reads our own partial as
    bit size + rank of the received partials' stride: our slot of the staging area."""
    for rank in range(size):
        s = steps(rank, size, True, gathered, reduce_scatter_early_sum=early)
        (gemm,) = gemms(s)
        _, lane, _, _, rows, src, src_off, parts, _, _, dst, dst_off = gemm[:12]
        assert (lane, rows, src, src_off, bits(parts)) == (
            COMPUTE,
            size * M,
            "X",
            0,
            list(range(size)),
        )
        assert (dst, dst_off) == ("Buffer", size * PARTIAL)  # the staging area's start
        at_gemm = s.index(gemm)
        for d in [(rank + i) % size for i in range(1, size)]:
            on_lane = [(i, st) for i, st in enumerate(s) if st[1] == d]
            block_waits = [i for i, st in on_lane if st[0] == "Wait" and st[13] == "Block"]
            assert len(block_waits) == 1, (rank, d)
            (wait,) = block_waits
            assert wait > at_gemm and s[wait][14] == d and s[wait][2] == rank, (rank, d, s[wait])
            pushes = [st for i, st in on_lane if st[0] == "Copy" and st[10] == "PeerBuffer"]
            push = pushes[-1]  # the partial (a gathered chunk goes first where the call gathers)
            assert s.index(push) > wait
            assert (push[5], push[6], push[11], push[12]) == (
                "Buffer",
                (size + d) * PARTIAL,
                rank * PARTIAL,
                PARTIAL,
            ), (rank, d)
        sums = [st for st in s if st[0] == "Sum"]
        assert sorted(sum((bits(st[7]) for st in sums), [])) == sorted(
            [j for j in range(size) if j != rank] + [size + rank]
        ), rank
        assert all((st[5], st[6], st[12]) == ("Buffer", 0, PARTIAL) for st in sums)
        assert not [st for st in s if st[0] == "Join" and st[3] == -2]  # one lane of GEMMs


@pytest.mark.parametrize("n_dev", [3, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_values(mesh1d, rand, n_dev, dtype):
    """Each rank's block is the sum over ranks of that block's partials, with the signal GEMM
    forced on (the fold off), against float32 math over three calls with new data, the early sum
    on and off (from four ranks)."""
    for early in (True, False):
        jax_ub.finalize()  # communicators take the setting when they are created
        try:
            use_tuning(
                reduce_scatter_signal_gemm=True,
                reduce_scatter_fold_rows=-1,
                reduce_scatter_early_sum=early,
            )
            f = op_fn("rs", mesh1d(n_dev), "ub")
            for call in range(3):
                x = rand(n_dev * 4, n_dev * 6, dtype=dtype, scale=1.0 + call)
                w = rand(n_dev * 6, 10, dtype=dtype)
                out = f(x, w)
                want = to_f32(x) @ to_f32(w)
                assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else tol(dtype)), call
        finally:
            jax_ub.finalize()
