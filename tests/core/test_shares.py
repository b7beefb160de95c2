"""accumulation 'shared': the share rule (a pure function every rank evaluates on the same input)."""
import itertools
import math
import random

import pytest

from ds_acco.core.schedule.phases import SHARE_BAND, SHARE_WINDOW, SharedPhases, share_by_speed, typical_rates

NAN = math.nan


def grid():
    """Ranks 1..5, totals from ranks x 1 to ranks x 6, rates from a coarse grid (every combination
    for up to 3 ranks, a fixed random sample beyond)."""
    rates = (0.5, 1.0, 1.1, 1.5, 2.0, 3.0, 7.0)
    rng = random.Random(0)
    for world in range(1, 6):
        combos = (list(itertools.product(rates, repeat=world)) if world <= 3
                  else [tuple(rng.choice(rates) for _ in range(world)) for _ in range(300)])
        for length in range(1, 7):
            for seconds in combos:
                yield world * length, seconds


def test_sum_minimum_and_order_everywhere():
    n = 0
    for total, seconds in grid():
        shares = share_by_speed(total, seconds)
        n += 1
        assert sum(shares) == total and min(shares) >= 1, (total, seconds, shares)
        for i, j in itertools.combinations(range(len(seconds)), 2):  # faster (or equal, lower rank) never gets less
            if seconds[i] <= seconds[j]:
                assert shares[i] >= shares[j], (total, seconds, shares)
    assert n > 5000


def test_a_larger_minimum_is_kept():
    for total, seconds in grid():
        if total >= 2 * len(seconds):
            shares = share_by_speed(total, seconds, minimum=2)
            assert sum(shares) == total and min(shares) >= 2, (total, seconds, shares)


def random_cases(seed, n, worlds, lengths, seconds_range):
    """``n`` seeded (rng, total, seconds) cases: a world size in ``worlds``, a total of world × a
    length in ``lengths``, every rank's seconds per micro-batch uniform in ``seconds_range``."""
    rng = random.Random(seed)
    for _ in range(n):
        world = rng.randint(*worlds)
        yield rng, world * rng.randint(*lengths), [rng.uniform(*seconds_range) for _ in range(world)]


def test_deterministic_and_pure():
    for _, total, seconds in random_cases(1, 2000, (1, 8), (1, 8), (0.01, 1.0)):
        first = share_by_speed(total, list(seconds))
        assert all(share_by_speed(total, list(seconds)) == first for _ in range(3))
        assert share_by_speed(total, tuple(seconds), current=first) == first  # its own answer is kept


def test_a_slower_rank_never_gets_more():
    for rng, total, seconds in random_cases(2, 20000, (2, 6), (1, 6), (0.1, 5)):
        i = rng.randrange(len(seconds))
        slower = list(seconds)
        slower[i] *= rng.uniform(1.0, 3.0)
        assert share_by_speed(total, slower)[i] <= share_by_speed(total, seconds)[i], (total, seconds, slower, i)


@pytest.mark.parametrize("total,seconds,want", [
    (4, (1.0, 2.0), (3, 1)),  # gas 4 in mode acco, 2 ranks: 2.67 / 1.33
    (16, (1.0, 2.0), (11, 5)),  # the example: 10.7 / 5.3
    (16, (0.0375, 0.075), (11, 5)),
    (16, (1.0, 3.0), (12, 4)),
    (16, (3.0, 1.0), (4, 12)),
    (8, (1.0, 1.0, 1.0, 2.0), (3, 2, 2, 1)),  # quotas 2.29 x 3 / 1.14: the one extra goes to rank 0
    (16, (1.0, 1.0, 1.0, 2.0), (5, 5, 4, 2)),  # 4.57 x 3 / 2.29: the tie goes to the lower rank
    (8, (1.0, 100.0), (7, 1)),  # the minimum
    (8, (1.0, 1.0, 1.0, 100.0), (3, 2, 2, 1)),  # pinned at 1, then 7 shared by 3, tie to rank 0
    (6, (1.0, 1.0, 1.0), (2, 2, 2)),
])
def test_slow_ranks(total, seconds, want):
    assert share_by_speed(total, seconds) == want


def test_unknown_rates_give_equal_shares_or_keep_the_current_ones():
    assert share_by_speed(8, (NAN, NAN)) == (4, 4)
    assert share_by_speed(8, (1.0, NAN)) == (4, 4)
    for bad in (0.0, -1.0, math.inf):
        assert share_by_speed(8, (1.0, bad)) == (4, 4)
    assert share_by_speed(8, (1.0, NAN), current=(6, 2)) == (6, 2)
    assert share_by_speed(12, (NAN,) * 3) == (4, 4, 4)


def test_noise_within_the_band_keeps_equal_shares():
    rng = random.Random(3)
    for _ in range(5000):
        world = rng.randint(2, 8)
        length = rng.randint(1, 16)
        total = world * length
        equal = (length,) * world
        # +-10 % measurement noise around one common speed: the best split shortens the phase by
        # at most about 1 - 1/1.1 < the band's 10 %... unless rounding says equal anyway
        seconds = [0.05 * rng.uniform(0.95, 1.05) for _ in range(world)]
        assert share_by_speed(total, seconds, current=equal) == equal, (total, seconds)


def test_the_band():
    # 2 ranks, 16 micro-batches, rank 1 20 % slower: the best split (9, 7) predicts 9.0 vs 9.6 for
    # (8, 8), 6.3 % shorter: inside the band, so (8, 8) stays; without the band it moves
    assert share_by_speed(16, (1.0, 1.2)) == (9, 7)
    assert share_by_speed(16, (1.0, 1.2), current=(8, 8)) == (8, 8)
    assert share_by_speed(16, (1.0, 1.2), current=(8, 8), band=0.0) == (9, 7)
    # 2x slower: 10.7 vs 16 predicted, far outside the band
    assert share_by_speed(16, (1.0, 2.0), current=(8, 8)) == (11, 5)
    # the slowdown passes: back to equal shares (they predict 8 against 11)
    assert share_by_speed(16, (1.0, 1.0), current=(11, 5)) == (8, 8)
    # the current shares are kept through noise around the slowdown they were made for
    assert share_by_speed(16, (1.0, 1.9), current=(11, 5)) == (11, 5)
    assert SHARE_BAND == 0.1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cannot share 3 micro-batches among 4 ranks"):
        share_by_speed(3, (1.0,) * 4)
    with pytest.raises(ValueError, match="current shares"):
        share_by_speed(8, (1.0, 1.0), current=(4, 3))


def test_the_policy_ends_a_phase_at_this_ranks_share():
    p = SharedPhases(2, window=1).for_rank(1, 2)
    assert p.shares == (2, 2) and p.share == 2
    assert [p.ends(n, lambda: False) for n in (1, 2)] == [None, "shared"]
    slow = p.reshare((0.01, 0.03))
    assert slow.shares == (3, 1) and slow.rank == 1
    assert slow.ends(1, lambda: False) == "shared"
    assert slow.for_rank(0, 2, slow.shares).ends(2, lambda: True) is None  # the round's state plays no part
    assert slow.reshare((0.01, NAN)).shares == (3, 1)  # an unknown rate keeps the shares
    with pytest.raises(ValueError, match="do not share 4 micro-batches"):
        p.for_rank(0, 2, (3, 2))
    with pytest.raises(ValueError, match="window = 0"):
        SharedPhases(2, window=0)


def test_typical_rates_are_the_median_of_a_full_window():
    assert typical_rates([], 3) == ()
    assert typical_rates([(1.0, 2.0)], 1) == (1.0, 2.0)
    assert all(math.isnan(x) for x in typical_rates([(1.0, 2.0), (1.0, 2.0)], 3))  # not yet 3 phases
    assert typical_rates([(1.0, 2.0), (9.0, 2.1), (1.2, 1.9)], 3) == (1.2, 2.0)  # one outlier: no effect
    assert typical_rates([(5.0, 1.0), (1.0, 2.0), (9.0, 2.1), (1.2, 1.9)], 3) == (1.2, 2.0)  # the last 3 only
    got = typical_rates([(1.0, NAN), (1.0, 2.0), (1.0, 2.0)], 3)  # an unknown rate in the window: unknown
    assert got[0] == 1.0 and math.isnan(got[1])
    assert math.isnan(typical_rates([(1.0, 0.0), (1.0, 2.0), (1.0, 2.0)], 3)[1])


def test_one_slow_phase_in_the_window_leaves_equal_shares_a_lasting_one_moves_them():
    """Equal ranks measured with outliers (one phase 3x slower on one rank, a stall) keep fixed mode's
    shares, so they stay aligned; a slowdown in 2 of the last 3 phases moves them (one phase later
    than a window of 1 would)."""
    p = SharedPhases(4).for_rank(0, 2)
    rng = random.Random(4)
    for k in range(200):
        seconds = [0.05 * rng.uniform(0.95, 1.05) for _ in range(2)]
        if k % 3 == 0:
            seconds[rng.randrange(2)] *= 3.0  # one outlier in every window
        p = p.reshare(seconds)
        assert p.shares == (4, 4) and p.aligned, (k, p.measured)
    assert len(p.measured) == 3
    for _ in range(3):
        p = p.reshare((0.05, 0.05))
    p = p.reshare((0.05, 0.15))
    assert p.shares == (4, 4)  # one slow phase: not yet
    p = p.reshare((0.05, 0.15))
    assert p.shares == (6, 2) and not p.aligned  # two of three: moved
    q = SharedPhases(4, window=1).for_rank(0, 2).reshare((0.05, 0.15))
    assert q.shares == (6, 2)  # a window of 1: at once (the rule before the window)


def test_aligned_holds_while_every_phase_had_equal_shares_and_never_comes_back():
    """``aligned`` (the schedule then runs fixed mode's drains, drains.py): equal shares through any
    number of reshares keep it; the first unequal shares drop it; equal shares later do not restore
    it (the ranks' phase ends stay apart by what the unequal phases gave them)."""
    p = SharedPhases(4, window=1).for_rank(0, 2)
    assert p.aligned and p.equal
    for seconds in ((0.05, 0.052), (NAN, NAN), (0.05, NAN), (0.051, 0.05)):  # noise, unknown rates
        p = p.reshare(seconds)
        assert p.shares == (4, 4) and p.aligned, seconds
    slow = p.reshare((0.01, 0.03))
    assert slow.shares == (6, 2) and not slow.aligned and not slow.equal
    back = slow.reshare((0.01, 0.01))
    assert back.shares == (4, 4) and back.equal and not back.aligned
    assert not back.reshare((0.01, 0.01)).aligned


def test_for_rank_restores_aligned_and_never_with_unequal_shares():
    assert SHARE_WINDOW == 3
    p = SharedPhases(2)
    assert p.for_rank(1, 2).aligned
    assert not p.for_rank(1, 2, aligned=False).aligned
    assert p.for_rank(1, 2, (2, 2), aligned=True).aligned
    assert not p.for_rank(1, 2, (3, 1), aligned=True).aligned  # an inconsistent saved flag cannot hold
    assert not p.for_rank(0, 2, aligned=False).for_rank(0, 2).aligned  # kept unless given


def test_for_rank_restores_the_measured_window():
    p = SharedPhases(2).for_rank(0, 2, measured=[(0.01, 0.03)] * 4)
    assert p.measured == ((0.01, 0.03),) * 3  # the window only
    assert p.reshare((0.01, 0.03)).shares == (3, 1)  # a resume goes on from the saved rates
    assert p.for_rank(1, 2).measured == p.measured  # kept unless given
    with pytest.raises(ValueError, match="one rate per rank of 2"):
        SharedPhases(2).for_rank(0, 2, measured=[(0.01,)])
