"""Which kernel candidates a long GEMM's tuning times in sustained blocks on GPUs
(src/cuda/gemm/choice_internal.h, SustainedCandidates): round 0's fastest four, and cuBLASLt's
own first pick (the kernel cuBLAS runs) wherever round 0 ranked it lower. The logic is
CUDA-free and read here from the host extension; the GPU tests run the tuning itself."""

import pytest

from jax_ub._src.runtime import extension

KEPT = 4  # round 0's fastest, timed in blocks (kSustainKept)


def timed(ranked: list[int], first_pick: int) -> list[int]:
    return list(extension._host.sustained_candidates(ranked, first_pick))


@pytest.mark.parametrize("place", range(8))
def test_cublas_first_pick_is_always_timed(place):
    """Wherever round 0 ranked candidate 0, the blocks time it, after round 0's fastest four
    (kept in their order); nothing else is added."""
    others = [5, 3, 7, 1, 6, 2, 4]
    ranked = others[:place] + [0] + others[place:]
    got = timed(ranked, 0)
    if place < KEPT:
        assert got == ranked[:KEPT]
    else:
        assert got == others[:KEPT] + [0]


def test_no_first_pick_among_the_ranked():
    """A first pick that did not run in round 0 (cuBLASLt refused it, or its heuristic served
    no #0: the caller passes a place past every candidate) adds nothing."""
    ranked = [4, 2, 6, 1, 3, 5]
    assert timed(ranked, 0) == ranked[:KEPT]
    assert timed(ranked, len(ranked)) == ranked[:KEPT]


@pytest.mark.parametrize("count", [1, 2, 4, 5])
def test_few_candidates_are_all_timed(count):
    """Up to four candidates, or five with cuBLASLt's pick ranked last: all of them, in
    round 0's order."""
    ranked = list(range(count))[::-1]  # candidate 0 last
    assert timed(ranked, 0) == ranked
