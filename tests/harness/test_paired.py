"""Paired statistics (kvnotes.harness.paired): TOST against hand-computed one-sided t-tests over
cluster means, exact McNemar against the binomial test, Benjamini-Hochberg against hand-worked
examples, and one-line errors for bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest, ttest_1samp

from kvnotes.errors import KvnotesError
from kvnotes.harness.paired import bh, mcnemar_exact, tost

#: p-values and statistics computed two ways (statsmodels vs scipy / by hand) agree to this.
P_TOL = 1e-10


def _pairs(mean_diff: float, n: int = 12, spread: float = 0.01, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = rng.normal(1.0, 0.3, n)
    return b + mean_diff + rng.normal(0, spread, n), b


def test_tost_inside_margin_is_equivalent():
    a, b = _pairs(0.01)
    r = tost(a, b, margin=0.05)
    assert r["equivalent"] and r["p"] < 1e-6
    assert r["n"] == r["n_clusters"] == 12
    lo, hi = r["ci"]
    assert -0.05 < lo < r["mean_diff"] < hi < 0.05 and r["ci_level"] == pytest.approx(0.9)


def test_tost_outside_margin_is_not_equivalent():
    a, b = _pairs(0.10)
    r = tost(a, b, margin=0.05)
    assert not r["equivalent"] and r["p"] > 0.99
    assert r["mean_diff"] == pytest.approx(0.10, abs=0.02)


def test_tost_equals_two_one_sided_t_tests():
    a, b = _pairs(0.02, spread=0.03, seed=3)
    r = tost(a, b, margin=0.04)
    d = a - b
    p_lo = ttest_1samp(d, -0.04, alternative="greater").pvalue
    p_hi = ttest_1samp(d, 0.04, alternative="less").pvalue
    assert r["p_lower"] == pytest.approx(p_lo, abs=P_TOL) and r["p_upper"] == pytest.approx(p_hi, abs=P_TOL)
    assert r["p"] == pytest.approx(max(p_lo, p_hi), abs=P_TOL)


def test_tost_clusters_reduce_n():
    """Rows are averaged within clusters first: 3 clusters of 10 rows test like 3 values (2 df)."""
    rng = np.random.default_rng(1)
    clusters = np.repeat(["s0", "s1", "s2"], 10)
    shift = {"s0": 0.0, "s1": 0.03, "s2": -0.02}
    b = rng.normal(0, 1, 30)
    a = b + np.array([shift[c] for c in clusters]) + rng.normal(0, 0.005, 30)
    clustered = tost(a, b, margin=0.06, clusters=clusters)
    assert clustered["n"] == 30 and clustered["n_clusters"] == 3
    means = np.array([(a - b)[clusters == c].mean() for c in ("s0", "s1", "s2")])
    p = max(ttest_1samp(means, -0.06, alternative="greater").pvalue,
            ttest_1samp(means, 0.06, alternative="less").pvalue)
    assert clustered["p"] == pytest.approx(p, abs=P_TOL)
    rows = tost(a, b, margin=0.06)            # the same rows taken as independent: a much smaller p
    assert rows["n_clusters"] == 30 and rows["p"] < clustered["p"] / 100


def test_tost_identical_arms():
    """Zero spread (the transplant reproduces the recompute exactly) is equivalent with p = 0."""
    x = [0.1, 0.2, 0.3, 0.4]
    r = tost(x, x, margin=0.01)
    assert r["equivalent"] and r["p"] == 0.0 and r["mean_diff"] == 0.0 and r["zero_spread"]


def test_tost_constant_nonzero_difference_claims_nothing():
    """Every cluster differing by the same 0.05 (inside a 0.1 margin): the t statistic is infinite, and
    a test that assumes a spread cannot support the claim, so none is made."""
    x = [0.1, 0.2, 0.3, 0.4]
    r = tost([v + 0.05 for v in x], x, margin=0.1)
    assert r["zero_spread"] and not r["equivalent"] and r["p"] == 1.0


@pytest.mark.parametrize("kwargs, words", [
    (dict(a=[1.0, 2.0], b=[1.0], margin=0.1), "2 values of a against 1 of b"),
    (dict(a=[1.0, 2.0], b=[1.0, 2.0], margin=0.1, clusters=["s", "s"]), "1 cluster(s)"),
    (dict(a=[1.0, 2.0], b=[1.0, 2.0], margin=0.1, clusters=["s"]), "1 cluster labels for 2 pairs"),
    (dict(a=[1.0, 2.0], b=[1.0, 2.0], margin=0.0), "margin must be > 0"),
    (dict(a=[1.0, float("nan")], b=[1.0, 2.0], margin=0.1), "non-finite"),
])
def test_tost_bad_input_one_line(kwargs, words):
    with pytest.raises(KvnotesError) as err:
        tost(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_mcnemar_matches_exact_binomial():
    # 5 both right, 7 A-only, 2 B-only, 3 both wrong
    a = [1] * 5 + [1] * 7 + [0] * 2 + [0] * 3
    b = [1] * 5 + [0] * 7 + [1] * 2 + [0] * 3
    r = mcnemar_exact(a, b)
    assert (r["n"], r["both"], r["b"], r["c"], r["neither"]) == (17, 5, 7, 2, 3)
    assert r["statistic"] == 2
    assert r["p"] == pytest.approx(binomtest(2, 9, 0.5).pvalue, abs=P_TOL)
    assert r["p"] == pytest.approx(2 * sum(math.comb(9, k) for k in range(3)) / 2 ** 9, abs=P_TOL)


def test_mcnemar_no_discordant_pairs():
    r = mcnemar_exact([True, False, True], [True, False, True])
    assert r["b"] == r["c"] == 0 and r["p"] == 1.0


@pytest.mark.parametrize("a, b, words", [([1, 0], [1], "2 decisions of a against 1 of b"),
                                         ([], [], "no paired decisions"),
                                         ([1, 2], [1, 0], "bool or 0/1")])
def test_mcnemar_bad_input_one_line(a, b, words):
    with pytest.raises(KvnotesError) as err:
        mcnemar_exact(a, b)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bh_hand_worked_step_up():
    """m = 4, alpha = 0.05, thresholds k alpha / m = .0125 .025 .0375 .05. Sorted p .02 .03 .035 .5:
    the largest k with p_(k) <= k alpha / m is 3 (.035 <= .0375), so the first three are rejected
    although .02 > .0125 and .03 > .025 (step-up). q_(4) = .5, q_(3) = .035 * 4/3 = .046667,
    q_(2) = min(.03 * 2, q_(3)), q_(1) = min(.02 * 4, q_(2))."""
    r = bh([0.03, 0.5, 0.02, 0.035], alpha=0.05)
    assert r["reject"] == [True, False, True, True] and r["n_reject"] == 3
    assert r["q"] == pytest.approx([0.035 * 4 / 3, 0.5, 0.035 * 4 / 3, 0.035 * 4 / 3], abs=P_TOL)


def test_bh_none_rejected():
    """Sorted .02 .04 .3 .8 against .0125 .025 .0375 .05: none passes."""
    r = bh([0.8, 0.02, 0.3, 0.04])
    assert r["reject"] == [False] * 4
    assert r["q"] == pytest.approx([0.8, 0.08, 0.4, 0.08], abs=P_TOL)


@pytest.mark.parametrize("p, words", [([], "no p-values"), ([0.1, 1.5], "outside [0, 1]"),
                                      ([0.1, float("nan")], "non-finite")])
def test_bh_bad_input_one_line(p, words):
    with pytest.raises(KvnotesError) as err:
        bh(p)
    assert words in str(err.value) and "\n" not in str(err.value)
