"""Which kernel candidates a long GEMM's tuning times in sustained blocks on GPUs
(src/cuda/gemm/choice_internal.h, SustainedCandidates): the ranking bursts' fastest four, and
cuBLASLt's own first pick (the kernel cuBLAS runs) wherever they ranked it lower; how the
blocks' rounds score them (RelativeTimes) and how far the first pick trails (RoundLead); and
which one tuning keeps (KeptCandidate): the fastest, unless the first pick is within the hold
margin of it or within the timing's spread (RoundSpread for bursts, RoundLead's for blocks).
The logic is CUDA-free and read here from the host extension; the GPU tests run the tuning
itself."""

import numpy as np
import pytest

from jax_ub._src.runtime import extension

KEPT = 4  # the ranking's fastest, timed in blocks (kSustainKept)


def timed(ranked: list[int], first_pick: int) -> list[int]:
    return list(extension._host.sustained_candidates(ranked, first_pick))


@pytest.mark.parametrize("place", range(8))
def test_cublas_first_pick_is_always_timed(place):
    """Wherever the ranking put candidate 0, the blocks time it, after the ranking's fastest four
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
    the ranking's order."""
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


def steady(ms: list[list[float]]) -> list[list[float]]:
    return [list(m) for m in extension._host.steady_rounds(ms)]


def relative(ms: list[list[float]]) -> list[float]:
    return list(extension._host.relative_times(ms))


def lead(first: list[float], fastest: list[float]) -> tuple[float, float]:
    return tuple(extension._host.round_lead(first, fastest))


def _rounds(rng, speeds: list[float], clock: list[float], noise: float) -> list[list[float]]:
    """ms[c][r]: candidate c's time in round r, at round r's clock, with noise."""
    return [[s * k * (1 + noise * rng.standard_normal()) for k in clock] for s in speeds]


def test_relative_times_are_each_rounds_share():
    """Each candidate's time over its round's geometric mean, the middle over rounds: a clock
    that scales a whole round scales its candidates alike and leaves the score."""
    ms = [[1.0, 2.0, 1.0, 1.1], [2.0, 4.0, 2.0, 2.2]]
    got = relative(ms)
    assert got == pytest.approx([2**-0.5, 2**0.5], rel=1e-6)


def test_relative_times_use_the_rounds_every_candidate_ran():
    """A round the budget cut short (one candidate timed in it, the other not) is left out."""
    got = relative([[1.0, 1.0, 9.0], [1.0, 1.0]])
    assert got == pytest.approx([1.0, 1.0], rel=1e-6)


def test_trial_rounds_take_each_calls_middle_and_the_rounds_all_ran():
    """The in-op trials: a candidate's time a round is the middle of its GEMMs in that call (a
    call may run the shape as chunks); a round where some candidate has no time is left out."""
    ms = [[[1.0, 3.0, 2.0], [1.0], [2.0]], [[4.0, 4.0], [], [5.0, 6.0]]]
    got = [list(r) for r in extension._host.trial_rounds(ms)]
    assert got == [pytest.approx([2.0, 2.0]), pytest.approx([4.0, 5.5])]


@pytest.mark.parametrize("seed", range(4))
def test_a_dip_in_some_trial_rounds_does_not_reorder_candidates(seed):
    """Trials time one candidate an op call, 4 rounds. The clock dips 25% in rounds 1 and 2,
    and in round 3 for the faster candidate's call only, 2% apart: each one's median over all
    its GEMMs puts the slower first (the dip took 3 of the faster one's 4 calls, 2 of the
    other's); ranked round by round, the faster one wins."""
    rng = np.random.default_rng(seed)
    speeds = [1.02, 1.0]  # the tuned pick, a faster one
    clock = [1.0, 1.25, 1.25, 1.0]
    ms = [
        [[s * k * (1 + 0.002 * rng.standard_normal()) for _ in range(4)] for k in clock]
        for s in speeds
    ]
    ms[1][3] = [t * 1.25 for t in ms[1][3]]  # the dip reached the faster one's last call only
    flat = [np.median(np.concatenate(m)) for m in ms]
    assert flat[0] < flat[1], flat  # what ranking by each one's median alone would keep
    scores = relative(extension._host.trial_rounds(ms))
    assert int(np.argmin(scores)) == 1, scores


def _capped_clock(t_ms: np.ndarray, phase_ms: float) -> np.ndarray:
    """How much slower a kernel runs at time t on one H100 at its 700 W cap: ~20% for ~0.3 s
    of every second of load (nvidia-smi: 1590 MHz down to 1245 MHz)."""
    return np.where((t_ms + phase_ms) % 1000 > 700, 1.25, 1.0)


def _blocks(rng, speeds: list[float], phase_ms: float, rounds: int = 8) -> list[list[float]]:
    """Tuning's blocks on that clock: 10 ms untimed then 10 ms timed a candidate, the
    direction alternating each round; a block's time a run is its speed at the mean clock of
    its timed 10 ms, with 0.3% noise."""
    ms = [[] for _ in speeds]
    t = 0.0
    for r in range(rounds):
        visit = range(len(speeds)) if r % 2 == 0 else reversed(range(len(speeds)))
        for c in visit:
            window = np.linspace(t + 10, t + 20, 41)
            factor = _capped_clock(window, phase_ms).mean()
            ms[c].append(speeds[c] * factor * (1 + 0.003 * rng.standard_normal()))
            t += 20
    return ms


@pytest.mark.parametrize("phase_ms", [0, 150, 300, 450, 600, 750, 900])
def test_a_dip_does_not_change_the_ranking(phase_ms):
    """8B's o at tp=8 on one H100: tile 29 ran 0.0518 ms in loops of 200, 8.6% ahead of
    cuBLAS's first pick (0.0566 ms), with tiles at 0.0535, 0.0560 and 0.0571. Whichever part of
    the clock's second the blocks land in, the steady rounds' score ranks tile 29 first and its
    lead holds beyond the margin and the rounds' spread."""
    rng = np.random.default_rng(phase_ms)
    speeds = [0.0566, 0.0518, 0.0535, 0.0560, 0.0571]  # first pick, tile 29, ...
    ms = steady(_blocks(rng, speeds, phase_ms))
    scores = relative(ms)
    assert int(np.argmin(scores)) == 1, scores
    first_lead, spread = lead(ms[0], ms[1])
    assert extension._host.kept_candidate(1, 1.0, first_lead, spread) == 1, (first_lead, spread)


@pytest.mark.parametrize("seed", range(5))
def test_alike_kernels_hold_the_first_pick(seed):
    """Two kernels that run alike, timed in 8 rounds at a drifting clock with 1% noise: the
    first pick holds whichever reads faster."""
    rng = np.random.default_rng(seed)
    clock = list(1 + 0.1 * rng.random(8))
    ms = _rounds(rng, [0.3, 0.3], clock, 0.01)
    fastest = int(np.argmin(relative(ms)))
    first_lead, spread = lead(ms[0], ms[fastest])
    assert extension._host.kept_candidate(fastest, 1.0, first_lead, spread) == 0


@pytest.mark.parametrize(("gain", "holds"), [(0.01, True), (0.08, False)])
def test_a_lead_counts_beyond_the_margin(gain, holds):
    """A kernel 1% faster is inside the 3% margin: the first pick holds; 8% faster is kept."""
    rng = np.random.default_rng(7)
    ms = _rounds(rng, [0.3, 0.3 * (1 - gain)], list(1 + 0.1 * rng.random(8)), 0.003)
    first_lead, spread = lead(ms[0], ms[1])
    assert first_lead == pytest.approx(1 / (1 - gain), rel=0.01)
    kept_one = extension._host.kept_candidate(1, 1.0, first_lead, spread)
    assert kept_one == (0 if holds else 1)


def test_a_lead_that_varies_more_than_it_is_no_lead():
    """A 5% lead from rounds whose ratios are spread wider than 5% (twice their median
    absolute deviation) holds."""
    first = [1.0] * 8
    fastest = [0.90, 0.99, 0.92, 1.0, 0.91, 0.98, 0.93, 1.0]
    first_lead, spread = lead(first, fastest)
    assert first_lead > 1.03 and spread > first_lead - 1
    assert extension._host.kept_candidate(2, 1.0, first_lead, spread) == 0


@pytest.mark.parametrize(
    ("first", "fastest", "want"),
    [([], [], (-1.0, 0.0)), ([1.1], [1.0], (1.1, 0.0)), ([1.2, 1.0], [1.0, 1.0], (1.1, 0.2 / 1.1))],
)
def test_round_lead_small_cases(first, fastest, want):
    assert lead(first, fastest) == pytest.approx(want, rel=1e-6)


def test_rounds_the_clock_dipped_in_are_left_out():
    """A round whose candidates' geometric mean reads over 3% above the middle round's ran at a
    dipped clock: left out, whole; so is a round only some candidates ran in."""
    ms = [[1.0, 1.02, 1.0, 1.2, 1.0], [2.0, 2.04, 2.0, 2.5], [3.0, 3.0, 3.1, 3.6]]
    want = [[1.0, 1.02, 1.0], [2.0, 2.04, 2.0], [3.0, 3.0, 3.1]]
    assert np.allclose(steady(ms), want, rtol=1e-6)


# One H100, 8B's down at tp=8, the input gradient's GEMM (8192 x 4096 x 1792): tuning's blocks,
# ms a run in each of 8 rounds, as JAX_UB_TRACE printed them. The clock dipped from round 6 on
# (and tile 20's block in round 6 before the others'); tile 20 leads the first pick (tile 248)
# by 7-17% in every round before.
H100_DOWN_DX = {
    "tile 20": [0.1725, 0.1691, 0.1701, 0.1657, 0.1717, 0.2109, 0.2160, 0.1743],
    "tile 29": [0.1839, 0.1791, 0.1846, 0.1781, 0.1831, 0.2079, 0.2337, 0.1824],
    "tile 495": [0.1878, 0.1833, 0.2051, 0.1782, 0.2080, 0.1951, 0.2224, 0.1885],
    "tile 31": [0.1875, 0.1849, 0.1987, 0.1914, 0.2060, 0.1978, 0.2182, 0.1903],
    "first pick, tile 248": [0.1845, 0.1845, 0.1979, 0.1944, 0.2010, 0.1962, 0.2060, 0.1923],
}


def test_a_measured_dip_does_not_hold_back_a_lead():
    """With every round, the dip's rounds spread a 9.7% lead 12.7% and the first pick held;
    over the 6 steady rounds tile 20 leads by 13%, more than the margin and the spread (7%)."""
    ms = list(H100_DOWN_DX.values())
    first_lead, spread = lead(ms[4], ms[0])
    assert extension._host.kept_candidate(1, 1.0, first_lead, spread) == 0  # all rounds: held
    kept = steady(ms)
    assert 5 <= len(kept[0]) < 8
    assert int(np.argmin(relative(kept))) == 0
    first_lead, spread = lead(kept[4], kept[0])
    assert first_lead > 1.1 and extension._host.kept_candidate(1, 1.0, first_lead, spread) == 1


def plan(round_ms: list[float], rounds: int, sustained: bool, left_ms: float) -> tuple[int, int]:
    return tuple(extension._host.plan_rounds(round_ms, rounds, sustained, left_ms))


def test_blocks_that_fit_keep_every_candidate_and_round():
    """5 candidates of 20 ms blocks, 8 rounds: 800 ms, within 1.5 s left."""
    assert plan([20.0] * 5, 8, True, 1500.0) == (5, 8)


def test_long_blocks_give_up_rounds_in_pairs_before_candidates():
    """A GEMM of tens of ms runs one warm and one timed run a block: 5 candidates of 60 ms
    rounds fit 4 rounds in 1.3 s, not 8 or 6; past 2 rounds, candidates go from the tail."""
    assert plan([60.0] * 5, 8, True, 1300.0) == (5, 4)
    assert plan([60.0] * 5, 8, True, 500.0) == (4, 2)
    assert plan([60.0, 61.0, 90.0], 8, True, 100.0) == (1, 2)  # at least one


def test_bursts_keep_their_rounds_and_give_up_candidates():
    """A short GEMM's bursts (3 rounds) drop candidates only, the slowest first."""
    assert plan([1.0, 1.0, 1.0, 1.0], 3, False, 10.0) == (3, 3)
    assert plan([1.0, 2.0], 3, False, 0.0) == (1, 3)
    assert plan([], 3, False, 10.0) == (0, 3)
