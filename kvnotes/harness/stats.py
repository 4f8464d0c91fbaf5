"""Statistics that keep the probes honest (``docs/design.md``, "Statistics").

- :func:`cluster_bootstrap_ci`: percentile bootstrap that resamples scenarios (clusters) with
  replacement, then instances within each drawn scenario, keeping all pairs of a drawn instance
  together; seeded ``numpy.random.Generator`` (never ``hash()`` or a fixed permutation).
- :func:`t_interval`: Student-t interval over cluster means, for few clusters.
- :func:`wilson`: Wilson score interval for a proportion (``scipy.stats.binomtest``).
- :func:`summarize`: n, n_scenarios, n_instances, mean, median and an interval whose method fits
  the number of clusters (``ci_method``), in the form every aggregate uses.

Why the method depends on the number of clusters: a cluster bootstrap over ``k`` scenarios draws
from only ``k`` distinct scenario means; with one scenario its interval has zero width from the
scenario level and with three it spans about the range of the three means, which is not a 95%
interval. Below :data:`MIN_BOOTSTRAP_CLUSTERS` scenarios the mean's interval is a t-interval over
scenario means (``k - 1`` degrees of freedom), over instance means when there is one scenario, and
no interval at all when there is a single cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import binomtest
from scipy.stats import t as student_t

#: Fewest scenario clusters for which the two-stage cluster bootstrap is reported as the CI.
MIN_BOOTSTRAP_CLUSTERS = 5
#: ``ci_method`` values.
CLUSTER_BOOTSTRAP = "cluster_bootstrap"
T_SCENARIO_MEANS = "t_over_scenario_means"
T_INSTANCE_MEANS = "t_over_instance_means"
SINGLE_CLUSTER = "none_single_cluster"


def _instance_index(scenarios: Sequence, instances: Sequence) -> tuple[np.ndarray, list[np.ndarray]]:
    """Map rows to a global instance index and list each scenario's instance indices."""
    inst_of: dict = {}
    per_scen: dict = {}
    row_inst = np.empty(len(scenarios), dtype=np.int64)
    for i, (s, inst) in enumerate(zip(scenarios, instances, strict=True)):
        key = (s, inst)
        if key not in inst_of:
            inst_of[key] = len(inst_of)
            per_scen.setdefault(s, []).append(inst_of[key])
        row_inst[i] = inst_of[key]
    return row_inst, [np.asarray(v) for v in per_scen.values()]


def bootstrap_weights(scenarios: Sequence, instances: Sequence, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Row weights of two-stage cluster bootstrap replicates.

    Each replicate draws ``n_scenarios`` scenarios with replacement and, inside each drawn scenario,
    as many instances as it has, with replacement; every row (pair) of a drawn instance enters with
    the number of times its instance was drawn.

    Returns:
        ``[n_boot, n_rows]`` integer weights.
    """
    row_inst, scen = _instance_index(scenarios, instances)
    rng = np.random.default_rng(seed)
    n_inst = np.array([len(v) for v in scen])
    max_inst = int(n_inst.max())
    padded = np.full((len(scen), max_inst), -1)
    for i, v in enumerate(scen):
        padded[i, : len(v)] = v
    drawn_scen = rng.integers(len(scen), size=(n_boot, len(scen)))                  # [B, S]
    u = rng.random((n_boot, len(scen), max_inst))                                   # [B, S, I]
    k = np.floor(u * n_inst[drawn_scen][:, :, None]).astype(np.int64)               # instance slot
    valid = np.arange(max_inst)[None, None, :] < n_inst[drawn_scen][:, :, None]
    chosen = padded[drawn_scen[:, :, None], k]                                      # global instance ids
    counts = np.zeros((n_boot, len(row_inst) and row_inst.max() + 1), dtype=np.int64)
    b_idx = np.broadcast_to(np.arange(n_boot)[:, None, None], chosen.shape)
    np.add.at(counts, (b_idx[valid], chosen[valid]), 1)
    return counts[:, row_inst]


def _weighted_median(vals: np.ndarray, weights: np.ndarray) -> np.ndarray:
    order = np.argsort(vals, kind="stable")
    v, w = vals[order], weights[:, order]
    cum = np.cumsum(w, axis=1)
    half = cum[:, -1:] / 2.0
    lo = np.argmax(cum >= half, axis=1)                       # first index reaching half the weight
    hi = np.argmax(cum > half, axis=1)                        # even-total ties: average the two middles
    return (v[lo] + v[hi]) / 2.0


def cluster_bootstrap(values: Sequence[float], scenarios: Sequence, instances: Sequence, stat: str = "mean",
                      n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Bootstrap distribution of the mean or median under two-stage cluster resampling
    (:func:`bootstrap_weights`).

    Args:
        values: one value per pair.
        scenarios: the pair's scenario id and instance id (cluster labels).
        instances: the pair's scenario id and instance id (cluster labels).
        stat: ``"mean"`` or ``"median"`` of the pooled resampled values.
        n_boot: number of bootstrap replicates.
        seed: seed of the ``numpy.random.Generator``.

    Returns:
        ``[n_boot]`` replicate statistics (empty when there are no values).
    """
    vals = np.asarray(values, dtype=float)
    if len(vals) == 0:
        return np.empty(0)
    w = bootstrap_weights(scenarios, instances, n_boot, seed).astype(float)
    if stat == "mean":
        return (w @ vals) / w.sum(axis=1)
    if stat == "median":
        return _weighted_median(vals, w)
    raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")


def cluster_bootstrap_ci(values, scenarios, instances, stat: str = "mean", n_boot: int = 2000, level: float = 0.95,
                         seed: int = 0) -> tuple[float, float] | None:
    """Percentile CI of ``stat`` from :func:`cluster_bootstrap`; None without values."""
    reps = cluster_bootstrap(values, scenarios, instances, stat, n_boot, seed)
    if len(reps) == 0:
        return None
    alpha = (1 - level) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha])
    return float(lo), float(hi)


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float] | None:
    """Wilson score interval for ``k`` successes out of ``n``; None when ``n == 0``."""
    if n == 0:
        return None
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def proportion(k: int, n: int, level: float = 0.95) -> dict:
    """``{k, n, p, ci}`` for a share, with a Wilson interval."""
    return {"k": int(k), "n": int(n), "p": (k / n) if n else None, "ci": wilson(k, n, level)}


def t_interval(means: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student-t interval for the mean of cluster means: ``m +- t_{k-1} * sd / sqrt(k)``.

    Args:
        means: one mean per cluster (``k`` of them).

    Returns:
        (low, high), or None with fewer than two clusters.
    """
    m = np.asarray(means, dtype=float)
    if len(m) < 2:
        return None
    half = student_t.ppf(0.5 + level / 2, len(m) - 1) * m.std(ddof=1) / np.sqrt(len(m))
    return float(m.mean() - half), float(m.mean() + half)


def cluster_means(values: np.ndarray, labels: Sequence) -> np.ndarray:
    """Mean of ``values`` per distinct label, in order of first appearance."""
    groups: dict = {}
    for v, g in zip(values, labels, strict=True):
        groups.setdefault(g, []).append(v)
    return np.array([np.mean(v) for v in groups.values()])


def summarize(values: Sequence[float], scenarios: Sequence, instances: Sequence, n_boot: int = 2000,
              seed: int = 0, level: float = 0.95) -> dict:
    """The standard aggregate: n, clusters, mean and median with an interval fit for the clusters.

    With at least :data:`MIN_BOOTSTRAP_CLUSTERS` scenarios, ``ci_mean`` and ``ci_median`` are
    two-stage cluster-bootstrap percentile intervals (``ci_method = "cluster_bootstrap"``). With 2-4
    scenarios, ``ci_mean`` is a t-interval over the scenario means (``"t_over_scenario_means"``,
    centred on ``mean_of_clusters``, the mean of scenario means); with one scenario and several
    instances, a t-interval over instance means (``"t_over_instance_means"``); with a single
    instance of a single scenario, no interval (``"none_single_cluster"``). ``ci_median`` is given
    only with the bootstrap. Non-finite values are dropped and counted in ``n_nonfinite``.

    Returns:
        ``{n, n_scenarios, n_instances, n_nonfinite, mean, median, mean_of_clusters, ci_mean,
        ci_median, ci_method, ci_level}``.
    """
    vals = np.asarray(values, dtype=float)
    finite = np.isfinite(vals)
    vals = vals[finite]
    scen = [s for s, f in zip(scenarios, finite) if f]
    inst = [(s, i) for s, i, f in zip(scenarios, instances, finite) if f]
    n_scen, n_inst = len(set(scen)), len(set(inst))
    out = {"n": int(len(vals)), "n_scenarios": n_scen, "n_instances": n_inst,
           "n_nonfinite": int((~finite).sum()), "mean": None, "median": None, "mean_of_clusters": None,
           "ci_mean": None, "ci_median": None, "ci_method": None, "ci_level": level}
    if not len(vals):
        return out
    out.update(mean=float(vals.mean()), median=float(np.median(vals)))
    if n_scen >= MIN_BOOTSTRAP_CLUSTERS:
        out.update(ci_method=CLUSTER_BOOTSTRAP, mean_of_clusters=float(cluster_means(vals, scen).mean()),
                   ci_mean=cluster_bootstrap_ci(vals, scen, inst, "mean", n_boot, level, seed),
                   ci_median=cluster_bootstrap_ci(vals, scen, inst, "median", n_boot, level, seed))
    elif n_scen >= 2:
        means = cluster_means(vals, scen)
        out.update(ci_method=T_SCENARIO_MEANS, mean_of_clusters=float(means.mean()), ci_mean=t_interval(means, level))
    elif n_inst >= 2:
        means = cluster_means(vals, inst)
        out.update(ci_method=T_INSTANCE_MEANS, mean_of_clusters=float(means.mean()), ci_mean=t_interval(means, level))
    else:
        out.update(ci_method=SINGLE_CLUSTER, mean_of_clusters=float(vals.mean()))
    return out


def summarize_rows(rows: Sequence[dict], key: str, group: str | None = "family", n_boot: int = 2000,
                   seed: int = 0) -> dict:
    """:func:`summarize` of ``row[key]`` over all rows (``"all"``) and per value of ``row[group]``.

    Rows need ``scenario`` and ``instance`` columns (the bootstrap clusters).
    """
    def one(rs):
        return summarize([r[key] for r in rs], [r["scenario"] for r in rs], [r["instance"] for r in rs],
                         n_boot, seed)

    out = {"all": one(rows)}
    if group:
        for g in sorted({r[group] for r in rows}):
            out[g] = one([r for r in rows if r[group] == g])
    return out


def matrix_summary(rows: list[dict], key: str, n_boot: int, seed: int, level: float = 0.95) -> dict:
    """Mean of a per-row matrix (e.g. ``[n_layers, n_groups]`` attention masses) over ``rows``, with
    cluster-bootstrap percentile intervals per cell (:func:`bootstrap_weights`: scenarios, then
    instances; rows need ``scenario`` and ``instance`` columns).

    Returns:
        ``n``, ``n_scenarios``, ``mean``, ``ci_low``, ``ci_high`` (nested lists of the matrix's shape;
        None without rows) and ``ci_level``.
    """
    if not rows:
        return {"n": 0, "n_scenarios": 0, "mean": None, "ci_low": None, "ci_high": None}
    X = np.asarray([r[key] for r in rows], dtype=float)             # [n, L, G]
    w = bootstrap_weights([r["scenario"] for r in rows], [r["instance"] for r in rows], n_boot, seed).astype(float)
    reps = np.einsum("bn,nlg->blg", w, X) / w.sum(1)[:, None, None]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha], axis=0)
    return {"n": len(rows), "n_scenarios": len({r["scenario"] for r in rows}), "mean": X.mean(0).tolist(),
            "ci_low": lo.tolist(), "ci_high": hi.tolist(), "ci_level": level}


# ---------------------------------------------------------------------------------------------
# verdicts: does a selected result beat its control (issue #53)

#: ``verdict`` values: the selected result beats its control (the interval of the held-out paired
#: difference lies above 0), loses to it (below 0), or neither can be said.
SUPPORTED, INCONCLUSIVE, CONTRADICTED = "supported", "inconclusive", "contradicted"


def verdict_of(difference: dict) -> str:
    """The verdict a :func:`summarize` of per-pair differences (selected minus control, held-out
    pairs) supports: :data:`SUPPORTED` when its ``ci_mean`` lies above 0, :data:`CONTRADICTED`
    when below, :data:`INCONCLUSIVE` when it straddles 0 or there is no interval (one cluster, no
    pairs): a single instance cannot support a conclusion."""
    ci = difference.get("ci_mean")
    if ci is None:
        return INCONCLUSIVE
    return SUPPORTED if ci[0] > 0 else CONTRADICTED if ci[1] < 0 else INCONCLUSIVE


#: Least gap between two groups' means (in the value's units: recovery, a share) for
#: :func:`disagreeing` to call them different: intervals over a few tight instance means separate
#: 0.97 from 0.90, which is no difference of mechanism.
DISAGREE_MARGIN = 0.1


def disagreeing(summaries: dict[str, dict], margin: float = DISAGREE_MARGIN) -> list[str] | None:
    """The two groups (e.g. a family's scenarios) whose :func:`summarize` intervals do not overlap
    and whose means differ by at least ``margin``, the highest and the lowest, or None (groups
    without an interval are not compared: their disagreement cannot be told apart from noise)."""
    ci = {k: s["ci_mean"] for k, s in summaries.items() if s.get("ci_mean") is not None}
    if len(ci) < 2:
        return None
    hi = max(ci, key=lambda k: ci[k][0])
    lo = min(ci, key=lambda k: ci[k][1])
    apart = ci[hi][0] > ci[lo][1] and summaries[hi]["mean"] - summaries[lo]["mean"] >= margin
    return [hi, lo] if apart else None
