"""Paired statistics on constructed correctness vectors with known answers."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eval.stats import (
    bootstrap_mean_ci,
    decide,
    hoeffding_half_width,
    mcnemar_exact_p,
    paired_compare,
    wilson_interval,
)

Z95 = 1.959963984540054  # Phi^{-1}(0.975)


def _exact_mcnemar(b: int, c: int) -> float:
    """Independent reference: exact binomial tail with integer binomial coefficients."""
    m = b + c
    if m == 0:
        return 1.0
    tail = Fraction(sum(math.comb(m, k) for k in range(min(b, c) + 1)), 2 ** m)
    return float(min(Fraction(1), 2 * tail))


def _vectors(n: int, k_t: int, k_b: int, n_both: int) -> tuple[np.ndarray, np.ndarray]:
    """Treatment right on k_t items, baseline on k_b, both right on n_both of them."""
    t = np.zeros(n, dtype=bool)
    b = np.zeros(n, dtype=bool)
    t[:k_t] = True
    b[:n_both] = True
    b[k_t:k_t + (k_b - n_both)] = True
    assert t.sum() == k_t and b.sum() == k_b and (t & b).sum() == n_both
    return t, b


def test_all_ties_gives_zero_diff_inconclusive_and_p_one():
    rng = np.random.default_rng(1)
    correct = rng.random(500) < 0.4
    r = paired_compare(correct, correct.copy(), n_bootstrap=200)
    assert r["diff"] == 0.0
    assert r["b"] == 0 and r["c"] == 0
    assert r["mcnemar_p"] == 1.0
    assert r["verdict"] == "inconclusive"
    assert r["bootstrap_low"] == 0.0 and r["bootstrap_high"] == 0.0
    assert r["acc_treatment"] == r["acc_baseline"] == pytest.approx(correct.mean())


def test_hoeffding_half_width_at_gsm8k_size():
    n, alpha = 1319, 0.05
    expected = math.sqrt(2 * math.log(2 / alpha) / n)
    assert hoeffding_half_width(n, alpha) == pytest.approx(expected, rel=1e-12)
    assert hoeffding_half_width(n, alpha) == pytest.approx(0.0748, abs=5e-5)
    # also the CI reported by paired_compare
    t, b = _vectors(n, 700, 650, 600)
    r = paired_compare(t, b, alpha=alpha, n_bootstrap=0)
    assert r["half_width"] == pytest.approx(expected, rel=1e-12)
    assert r["ci_low"] == pytest.approx(r["diff"] - expected, rel=1e-12)
    assert r["ci_high"] == pytest.approx(r["diff"] + expected, rel=1e-12)
    assert r["bootstrap_low"] is None
    # halving alpha widens the interval
    assert hoeffding_half_width(n, 0.01) > hoeffding_half_width(n, 0.05)


@pytest.mark.parametrize("b,c", [(0, 0), (5, 0), (0, 5), (1, 1), (3, 7), (10, 10), (12, 30), (29, 13),
                                 (100, 140), (600, 700), (0, 40)])
def test_mcnemar_matches_exact_binomial(b, c):
    assert mcnemar_exact_p(b, c) == pytest.approx(_exact_mcnemar(b, c), rel=1e-9, abs=1e-300)


def test_mcnemar_known_small_values_and_counts_from_vectors():
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(1, 4) == pytest.approx(2 * 6 / 32)
    # b = items T right and B wrong, c = the reverse
    t, bl = _vectors(200, 90, 70, 60)
    r = paired_compare(t, bl, n_bootstrap=0)
    assert (r["b"], r["c"]) == (30, 10)
    assert r["mcnemar_p"] == pytest.approx(_exact_mcnemar(30, 10), rel=1e-9)
    assert r["diff"] == pytest.approx((90 - 70) / 200)


def test_clearly_better_treatment_is_validated():
    t, b = _vectors(1319, 900, 650, 620)  # +19 points
    r = paired_compare(t, b, n_bootstrap=500)
    assert r["diff"] == pytest.approx(250 / 1319)
    assert r["ci_low"] > 0 and r["verdict"] == "validated"
    assert r["mcnemar_p"] < 1e-20
    assert 0 < r["bootstrap_low"] < r["diff"] < r["bootstrap_high"]


def test_small_positive_or_negative_diff_is_inconclusive_and_a_clear_loss_worse():
    t, b = _vectors(1319, 680, 660, 600)  # +1.5 points
    r = paired_compare(t, b, n_bootstrap=0)
    assert 0 < r["diff"] < r["half_width"]
    assert r["ci_low"] < 0 and r["verdict"] == "inconclusive"
    r = paired_compare(b, t, n_bootstrap=0)
    assert r["diff"] < 0 and r["ci_high"] > 0 and r["verdict"] == "inconclusive"
    t, b = _vectors(1319, 500, 660, 450)  # -12.1 points
    r = paired_compare(t, b, n_bootstrap=0)
    assert r["ci_high"] < 0 and r["verdict"] == "worse"


def test_decision_rule_boundaries():
    assert decide(0.0, 0.2) == "inconclusive"  # the bound must be strictly above 0
    assert decide(1e-9, 0.2) == "validated"
    assert decide(-0.07, 0.0) == "inconclusive"  # and strictly below 0 for `worse`
    assert decide(-0.07, -1e-9) == "worse"


def test_wilson_interval_known_values():
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.23659, abs=1e-4) and high == pytest.approx(0.76341, abs=1e-4)
    # closed forms at the edges: k = 0 -> [0, z^2/(n+z^2)], k = n -> [n/(n+z^2), 1]
    assert wilson_interval(0, 10) == pytest.approx((0.0, Z95 ** 2 / (10 + Z95 ** 2)), rel=1e-9)
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + Z95 ** 2), 1.0), rel=1e-9)
    # both bounds are the roots of (k/n - p)^2 = z^2 p (1 - p) / n
    k, n = 81, 263
    for p in wilson_interval(k, n):
        assert (k / n - p) ** 2 == pytest.approx(Z95 ** 2 * p * (1 - p) / n, rel=1e-9)
    with pytest.raises(ValueError, match="n must be"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="k must be"):
        wilson_interval(11, 10)


def test_bootstrap_is_seeded_and_close_to_normal_interval():
    rng = np.random.default_rng(0)
    d = rng.choice([-1.0, 0.0, 1.0], p=[0.15, 0.6, 0.25], size=2000)
    a = bootstrap_mean_ci(d, n_resamples=4000, seed=7)
    assert a == bootstrap_mean_ci(d, n_resamples=4000, seed=7)
    assert a != bootstrap_mean_ci(d, n_resamples=4000, seed=8)
    se = d.std() / math.sqrt(d.size)
    assert a[0] == pytest.approx(d.mean() - Z95 * se, abs=0.25 * se)
    assert a[1] == pytest.approx(d.mean() + Z95 * se, abs=0.25 * se)


def test_several_seeds_count_items_not_seed_item_pairs():
    t0, b0 = _vectors(300, 150, 120, 100)
    t1, b1 = _vectors(300, 140, 150, 110)
    r = paired_compare(np.stack([t0, t1]), np.stack([b0, b1]), n_bootstrap=300)
    assert r["n"] == 600 and r["n_seeds"] == 2 and r["n_items"] == 300
    assert r["diff"] == pytest.approx((150 + 140 - 120 - 150) / 600)
    assert (r["b"], r["c"]) == (50 + 30, 20 + 40)  # discordant (seed, item) pairs, descriptive
    # the item is the independent unit: n = 300 items in the half-width, not 600 pairs
    assert r["half_width"] == pytest.approx(math.sqrt(2 * math.log(40) / 300))
    d = (t0.astype(int) - b0) + (t1.astype(int) - b1)
    assert (r["b_items"], r["c_items"]) == (int((d > 0).sum()), int((d < 0).sum()))
    assert r["mcnemar_p"] == pytest.approx(_exact_mcnemar(r["b_items"], r["c_items"]), rel=1e-9)


def test_repeating_one_seed_does_not_shrink_the_interval():
    """S identical seeds carry no more evidence than one: same CI, verdict and McNemar p (pooling the
    S*n (seed, item) pairs as independent would narrow the CI by sqrt(S) and validate this case)."""
    t, b = _vectors(1319, 600, 534, 534)  # +5.0 pts, b = 66, c = 0: inconclusive at n = 1319
    one = paired_compare(t, b, n_bootstrap=0)
    three = paired_compare(np.stack([t] * 3), np.stack([b] * 3), n_bootstrap=0)
    assert one["verdict"] == "inconclusive" and one["ci_low"] < 0
    for key in ("diff", "half_width", "ci_low", "ci_high", "verdict", "mcnemar_p", "b_items", "c_items"):
        assert three[key] == one[key], key
    assert (three["b"], three["c"], three["n"]) == (3 * 66, 0, 3 * 1319)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="shapes differ"):
        paired_compare(np.ones(3, bool), np.ones(4, bool))
    with pytest.raises(ValueError, match="0/1"):
        paired_compare(np.array([0, 2]), np.array([0, 1]))
    with pytest.raises(ValueError, match="alpha"):
        hoeffding_half_width(10, 1.5)
    with pytest.raises(ValueError, match="no items"):
        paired_compare(np.zeros(0, bool), np.zeros(0, bool))


def test_monte_carlo_sign_flip_p_counts_the_observed_pattern():
    """Above SIGN_FLIP_EXACT_MAX seeds the p is (1 + hits) / (1 + draws): the observed pattern is one of the
    equally likely ones, so p >= 1 / (draws + 1) even when no drawn pattern is as extreme (17 equal gaps:
    only the 2 all-equal sign patterns of 2^17 reach the observed mean)."""
    from eval.stats import SIGN_FLIP_EXACT_MAX, sign_flip_p

    assert 17 > SIGN_FLIP_EXACT_MAX
    assert sign_flip_p(np.ones(17), n_draws=10) == pytest.approx(1 / 11)
