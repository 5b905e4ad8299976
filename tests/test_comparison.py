"""zl_study/comparison.py: the paired difference of two arms and its interval, on numbers worked by hand."""

import math

import pytest

from zl_study.comparison import Z95, Scored, paired, summarize


def _arm(seed, correct, nll=None):
    nll = nll or [1.0] * len(correct)
    return Scored(seed, tuple(correct), tuple(nll), (2,) * len(correct))


def test_one_seed_gives_the_row_noise_alone():
    # Rows 0-3: the arm gains row 1 and loses row 3, so d = (0, +1, 0, -1): mean 0, sample variance 2/3.
    ref = [_arm(0, [1, 0, 1, 1])]
    arm = [_arm(0, [1, 1, 1, 0])]
    pair = paired(arm, ref)
    assert pair.accuracy_diff == 0.0
    half = Z95 * math.sqrt((2 / 3) / 4)
    assert pair.accuracy_ci == pytest.approx((-half, half))
    # A single seed's standard error of the accuracy is the binomial one over the rows.
    assert summarize(arm).accuracy_se == pytest.approx(math.sqrt(0.75 * 0.25 / 4))


def test_seeds_add_their_spread_to_the_row_noise():
    # Seed 0: the arm is right on every row where the reference is wrong (+1/2); seed 1: equal (0).
    ref = [_arm(0, [1, 0, 1, 0]), _arm(1, [1, 1, 0, 0])]
    arm = [_arm(0, [1, 1, 1, 1]), _arm(1, [1, 1, 0, 0])]
    pair = paired(arm, ref)
    assert pair.seeds == 2 and pair.accuracy_diff == pytest.approx(0.25)
    # Per row, the mean over seeds of d: (0, 0.5, 0, 0.5) -> variance 1/12, /4 rows; per seed (0.5, 0) -> 1/8, /2.
    var = (1 / 12) / 4 + (1 / 8) / 2
    assert pair.accuracy_ci == pytest.approx((0.25 - Z95 * math.sqrt(var), 0.25 + Z95 * math.sqrt(var)))
    assert summarize(arm).accuracy == pytest.approx(0.75)
    assert summarize(arm).accuracy_se == pytest.approx(math.sqrt(0.125 / 2))


def test_nll_difference_is_per_label_token_and_the_ratio_is_of_the_means():
    ref = [_arm(0, [1, 1], nll=[2.0, 4.0])]
    arm = [_arm(0, [1, 1], nll=[1.0, 2.0])]  # 2 tokens a row: NLL 1.5 and 0.75 nats per token
    pair = paired(arm, ref)
    assert pair.nll_diff == pytest.approx(-0.75)
    assert pair.nll_ratio == pytest.approx(0.5)
    assert pair.nll_ci[0] < -0.75 < pair.nll_ci[1]


def test_an_arm_scored_once_pairs_with_every_seed_and_unpaired_seeds_are_left_out():
    ref = [_arm(0, [1, 1]), _arm(1, [1, 0])]
    base = [_arm(None, [0, 0])]
    assert paired(base, ref).accuracy_diff == pytest.approx(-0.75)
    assert paired([_arm(5, [1, 1])], ref) is None
    with pytest.raises(ValueError, match="same rows"):
        paired([_arm(0, [1, 1, 1])], ref)


def test_rows_that_differ_per_seed_are_averaged_per_token_of_each_seed():
    """Held-out rows: each seed scores its own rows, with their own token counts; the NLL difference of a seed is
    per token of that seed's rows, and the estimate is the mean of the seeds'."""
    ref = [Scored(0, (1, 1), (2.0, 2.0), (1, 1)), Scored(1, (1, 1), (6.0, 6.0), (3, 3))]
    arm = [Scored(0, (1, 1), (1.0, 1.0), (1, 1)), Scored(1, (1, 1), (3.0, 3.0), (3, 3))]
    pair = paired(arm, ref)
    # Seed 0: (2 - 4) / 2 tokens = -1 per token; seed 1: (6 - 12) / 6 tokens = -1 per token.
    assert pair.nll_diff == pytest.approx(-1.0)
    assert pair.nll_ci == pytest.approx((-1.0, -1.0))
