"""Which kernel candidates a long GEMM's tuning times in sustained blocks on GPUs
(src/cuda/gemm/choice_internal.h, SustainedCandidates): round 0's fastest four, and cuBLASLt's
own first pick (the kernel cuBLAS runs) wherever round 0 ranked it lower; and which one it
keeps (KeptCandidate): the fastest, unless the first pick is within the hold margin of it or
within the two candidates' round-to-round spread (RoundSpread).
The logic is CUDA-free and read here from the host extension; the GPU tests run the tuning
itself."""

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


def kept(fastest: int, fastest_ms: float, first_ms: float, spread: float = 0.0) -> int:
    return extension._host.kept_candidate(fastest, fastest_ms, first_ms, spread)


def test_the_hold_margin_is_three_percent():
    assert extension._host.hold_margin == pytest.approx(0.03)


@pytest.mark.parametrize("fastest", [1, 5])
def test_a_candidate_that_wins_by_more_than_the_margin_is_kept(fastest):
    assert kept(fastest, 0.95, 1.0) == fastest
    assert kept(fastest, 0.9, 1.0) == fastest


@pytest.mark.parametrize("share", [0.975, 0.99, 0.999])
def test_cublas_first_pick_holds_within_the_margin(share):
    """A candidate faster by less than 3% than the first pick (candidate 0) is no gain over
    the timing's noise: the first pick is kept."""
    assert kept(3, share * 0.2, 0.2) == 0


def test_the_fastest_is_kept_where_the_first_pick_was_not_timed():
    assert kept(2, 0.99, -1.0) == 2


def test_a_fastest_first_pick_is_kept():
    assert kept(0, 1.0, 1.0) == 0


@pytest.mark.parametrize(("lead", "spread", "holds"), [(0.05, 0.06, True), (0.05, 0.04, False)])
def test_a_lead_inside_the_rounds_spread_is_no_lead(lead, spread, holds):
    """Beyond the margin, a candidate leads only by more than the rounds of either candidate
    differ: a 5% lead holds against rounds 6% apart, not against rounds 4% apart."""
    assert kept(4, (1 - lead) * 0.3, 0.3, spread) == (0 if holds else 4)


def test_a_small_spread_leaves_the_margin():
    assert kept(4, 0.98 * 0.3, 0.3, 0.005) == 0
    assert kept(4, 0.96 * 0.3, 0.3, 0.005) == 4


@pytest.mark.parametrize(
    ("ms", "want"),
    [([0.2], 0.0), ([], 0.0), ([0.2, 0.21], 0.01 / 0.205), ([0.3, 0.1, 0.2], 1.0)],
)
def test_round_spread_is_range_over_middle(ms, want):
    assert extension._host.round_spread(ms) == pytest.approx(want, rel=1e-5)
