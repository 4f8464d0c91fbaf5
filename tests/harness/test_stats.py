"""Statistics: the cluster bootstrap covers the truth at about the nominal rate on clustered data,
is seeded and non-degenerate; Wilson intervals match known values."""

from __future__ import annotations

import numpy as np
import pytest

from kvnotes.harness.stats import bootstrap_weights, cluster_bootstrap, cluster_bootstrap_ci, summarize, wilson


def clustered(rng, n_scen=20, n_inst=4, n_pair=2, mu=0.3):
    scen_eff = rng.normal(0, 0.5, n_scen)
    vals, scen, inst = [], [], []
    for s in range(n_scen):
        for i in range(n_inst):
            ie = rng.normal(0, 0.3)
            for _ in range(n_pair):
                vals.append(mu + scen_eff[s] + ie + rng.normal(0, 0.2))
                scen.append(f"s{s}")
                inst.append(f"s{s}/{i}")
    return np.array(vals), scen, inst


def test_cluster_bootstrap_coverage_near_nominal():
    rng = np.random.default_rng(12345)
    hits, n = 0, 200
    for rep in range(n):
        vals, scen, inst = clustered(rng)
        lo, hi = cluster_bootstrap_ci(vals, scen, inst, "mean", n_boot=400, seed=rep)
        hits += lo <= 0.3 <= hi
    # nominal 95%; with 20 clusters percentile intervals run slightly narrow
    assert 0.86 <= hits / n <= 0.99, hits / n


def test_naive_iid_bootstrap_would_undercover():
    """Treating pairs as independent ignores the scenario effect: its intervals are much narrower.
    (The check that the cluster bootstrap is doing real work.)"""
    rng = np.random.default_rng(7)
    vals, scen, inst = clustered(rng)
    lo, hi = cluster_bootstrap_ci(vals, scen, inst, "mean", seed=0)
    lo_iid, hi_iid = cluster_bootstrap_ci(vals, list(range(len(vals))), list(range(len(vals))), "mean", seed=0)
    assert (hi - lo) > 1.8 * (hi_iid - lo_iid)


def test_bootstrap_is_seeded_and_not_degenerate():
    rng = np.random.default_rng(0)
    vals, scen, inst = clustered(rng)
    a = cluster_bootstrap(vals, scen, inst, "mean", 300, seed=1)
    b = cluster_bootstrap(vals, scen, inst, "mean", 300, seed=1)
    c = cluster_bootstrap(vals, scen, inst, "mean", 300, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.std() > 0.01


def test_weights_resample_whole_instances_within_scenarios():
    scen = ["a"] * 4 + ["b"] * 2
    inst = ["a0", "a0", "a1", "a1", "b0", "b0"]
    w = bootstrap_weights(scen, inst, n_boot=500, seed=0)
    assert (w[:, 0] == w[:, 1]).all() and (w[:, 4] == w[:, 5]).all()   # pairs of an instance move together
    # each replicate draws 2 scenarios, each contributing as many instances as it has
    per_rep_instances = w[:, [0, 2, 4]].sum(1)
    assert set(np.unique(per_rep_instances)) <= {2, 3, 4}


def test_median_replicates_are_medians_of_the_resampled_rows():
    vals = np.array([1.0, 2.0, 3.0, 10.0, 4.0])
    scen, inst = ["s", "s", "s", "t", "t"], ["i0", "i1", "i2", "j0", "j1"]
    reps = cluster_bootstrap(vals, scen, inst, "median", 200, seed=0)
    w = bootstrap_weights(scen, inst, 200, seed=0)
    expected = [np.median(np.repeat(vals, wi)) for wi in w]
    assert np.allclose(reps, expected)


def test_wilson_known_values():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson(0, 0) is None


def test_summarize_counts():
    out = summarize([1.0, float("nan"), 3.0], ["a", "a", "b"], ["a0", "a1", "b0"], n_boot=100)
    assert out["n"] == 2 and out["n_scenarios"] == 2 and out["n_nonfinite"] == 1 and out["mean"] == 2.0


def _rows(n_scen, n_inst, per_inst=2, seed=0):
    rng = np.random.default_rng(seed)
    vals, scen, inst = [], [], []
    for s in range(n_scen):
        mu = rng.normal()
        for i in range(n_inst):
            for _ in range(per_inst):
                vals.append(mu + 0.3 * rng.normal())
                scen.append(f"s{s}")
                inst.append(f"s{s}/{i}")
    return vals, scen, inst


def test_few_clusters_get_a_t_interval_over_scenario_means_not_a_bootstrap():
    from scipy.stats import t as student_t

    vals, scen, inst = _rows(3, 4)
    out = summarize(vals, scen, inst, n_boot=500)
    assert out["ci_method"] == "t_over_scenario_means" and out["n_scenarios"] == 3 and out["n_instances"] == 12
    means = np.array([np.mean([v for v, s in zip(vals, scen) if s == k]) for k in ("s0", "s1", "s2")])
    half = student_t.ppf(0.975, 2) * means.std(ddof=1) / np.sqrt(3)
    assert out["ci_mean"] == pytest.approx((means.mean() - half, means.mean() + half), rel=1e-9)
    assert out["mean_of_clusters"] == pytest.approx(means.mean())
    assert out["ci_median"] is None                      # no bootstrap median with few clusters
    # the cluster bootstrap on the same data is about the range of the three means: much narrower
    boot = cluster_bootstrap_ci(vals, scen, inst, n_boot=500)
    assert (boot[1] - boot[0]) < 0.5 * (out["ci_mean"][1] - out["ci_mean"][0])


def test_one_scenario_uses_instance_means_and_one_cluster_gets_no_interval():
    vals, scen, inst = _rows(1, 4)
    out = summarize(vals, scen, inst, n_boot=200)
    assert out["ci_method"] == "t_over_instance_means" and out["ci_mean"] is not None
    assert out["ci_mean"][0] < out["mean"] < out["ci_mean"][1]
    one = summarize([0.2, 0.4], ["s", "s"], ["s/0", "s/0"], n_boot=200)
    assert one["ci_method"] == "none_single_cluster" and one["ci_mean"] is None and one["mean"] == pytest.approx(0.3)


def test_five_or_more_scenarios_use_the_cluster_bootstrap():
    vals, scen, inst = _rows(5, 2)
    out = summarize(vals, scen, inst, n_boot=300, seed=1)
    assert out["ci_method"] == "cluster_bootstrap"
    assert out["ci_mean"] == pytest.approx(cluster_bootstrap_ci(vals, scen, [(s, i) for s, i in zip(scen, inst)],
                                                                n_boot=300, seed=1))
    assert out["ci_median"] is not None
