"""``read_location``: where the decision query reads, and what a knockout of that read does
(docs/design.md §3, §5).

**Attention masses.** For each token-aligned pair and each run (old, new), the decision token is
fed at position ``d`` on the run's prefix cache ``[0, d)``. Inside :func:`kvnotes.kv.capture.attention_hook`
the decision row's attention probabilities are computed with the model's own eager attention
function (its scaling, logit soft-capping and GQA grouping; the mask the model built, which carries
the sliding window), called with keyword arguments, in fp32. Mean over heads, per layer, the
probability mass is summed over five disjoint key groups that cover every visible key:

- ``sinks``: positions ``[0, n_sinks)`` (the first token(s), e.g. BOS; clipped at the field start);
- ``prefix``: the rest of the prefix before the field, ``[n_sinks, a)``;
- ``field``: ``[a, b)``;  ``downstream``: ``[b, d)``;  ``decision``: the decision token itself.

Masses sum to 1 per layer (keys outside a sliding window carry no mass). As a check, the eager
output is compared with the output of the implementation the model actually ran (``recon_err``).

**Knockout.** For a key group (or a union of groups) and a layer band, the attention mask that the
decision query (row ``d`` only) sees is changed inside the hook so that it cannot attend to those
keys in the band's layers (sdpa and eager implementations); every other row and layer is untouched
(with ``readout=full`` the teacher-forced continuation tokens read the cache unmodified). All
variants of a run go through one batched forward on its one prefix cache, no variant cache built
(:func:`kvnotes.kv.knockout.decision_forward`). Reported per run: the score change ``delta = s_knock - s_clean`` (nats) and
``delta_toward_other`` (the same, signed so that positive moves towards the other run's clean
score). A knockout can change the decision merely by destroying the readout, so each
(pair, run, variant) is classified:

- ``collapsed`` (readout destroyed): both candidates' first-token log-probs fall by at least
  ``collapse.drop_nats`` below their clean values, OR neither candidate is in the knocked
  distribution's top-``collapse.top_k`` while at least one was in the clean top-k;
- ``decision_changed``: the sign of the score differs from the clean run's;
- ``flip_intact``: decision changed and not collapsed — the only case that counts as a flip.

Aggregates are per family (and ``all``), over flipping pairs and over all aligned pairs, with
cluster-bootstrap CIs (scenarios, then instances; docs/design.md §8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvnotes.records.schema import TypedDict

from collections import Counter

import numpy as np
import torch

from kvnotes.records.schema import BaseResult, PairRow
from kvnotes.harness.kit import ProbeConfig
from kvnotes.kv import cache as kvcache
from kvnotes.harness import kit as K
from kvnotes.kv.knockout import DecisionRead, decision_forward, knockout_masks
from kvnotes.harness.readout import candidate_scores
from kvnotes.harness.stats import bootstrap_weights, proportion

GROUPS = ("sinks", "prefix", "field", "downstream", "decision")
RUNS = ("old", "new")


# --------------------------------------------------------------------------------------------
# key groups


@dataclass
class Collapse:
    """Readout-destroyed criterion (see the module docstring)."""

    drop_nats: float = 2.3
    top_k: int = 10


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/read_location.yaml`` (defaults there; see the module docstring)."""

    n_sinks: int = 1
    band_units: str = "fraction"
    bands: Any = field(default_factory=lambda: [[0.0, 1.0]])
    knockout_groups: Any = field(default_factory=lambda: [["field"]])
    collapse: Collapse = field(default_factory=Collapse)


def key_groups(field: tuple[int, int], decision: int, n_sinks: int) -> dict[str, tuple[int, int]]:
    """Disjoint position ranges ``[start, end)`` of the key groups, covering ``[0, d]``.

    Args:
        field: token span ``(a, b)`` of the field.
        decision: decision position ``d``.
        n_sinks: number of leading positions counted as attention sinks (clipped at ``a``).

    Raises:
        ValueError: ``n_sinks < 0`` or a span outside ``[0, d)``.
    """
    a, b = field
    if n_sinks < 0:
        raise ValueError(f"n_sinks must be >= 0, got {n_sinks}")
    if not 0 <= a <= b <= decision:
        raise ValueError(f"field {field} is not inside [0, {decision})")
    s = min(n_sinks, a)
    return {"sinks": (0, s), "prefix": (s, a), "field": (a, b), "downstream": (b, decision),
            "decision": (decision, decision + 1)}


def group_masses(probs: torch.Tensor, groups: dict[str, tuple[int, int]]) -> torch.Tensor:
    """Sum probabilities over each key group.

    Args:
        probs: ``[..., d + 1]`` probabilities by position.

    Returns:
        ``[..., len(GROUPS)]`` in :data:`GROUPS` order.
    """
    return torch.stack([probs[..., s:e].sum(-1) for s, e in (groups[g] for g in GROUPS)], dim=-1)


def _scores(model, pair, cache, knock, mode: str, capture: bool,
            budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> tuple[torch.Tensor, DecisionRead]:
    """Scores ``[V]`` of knockout variants (:func:`kvnotes.harness.readout.candidate_scores`) and the first
    forward's :class:`kvnotes.kv.knockout.DecisionRead`."""
    def forward(tokens, first):
        read = decision_forward(model, cache, tokens, knock, capture and first, budget_bytes)
        return read.logprobs, read

    return candidate_scores(forward, pair, mode)


def collapse_flags(lp: torch.Tensor, cands: tuple[int, int], drop_nats: float, top_k: int) -> dict[str, torch.Tensor]:
    """Readout-destroyed criterion per variant against variant 0 (the clean, nothing-knocked run).

    Args:
        lp: fp32 ``[V, vocab]`` first-token log-probs at the decision position; row 0 is clean.
        cands: first tokens of the two candidates.
        drop_nats: both candidates must fall by at least this much (nats) for ``drop``.
        top_k: ``topk_lost`` when neither candidate is in the top-k but one was in the clean top-k.

    Returns:
        bool ``[V]`` tensors ``drop``, ``topk_lost``, ``collapsed`` (either).
    """
    c = torch.tensor(cands, device=lp.device)
    cl = lp[:, c]                                                  # [V, 2]
    drop = ((cl[0:1] - cl) >= drop_nats).all(dim=1)
    kth = lp.topk(min(top_k, lp.shape[1]), dim=1).values[:, -1:]   # [V, 1]
    in_top = (cl >= kth).any(dim=1)
    lost = in_top[0] & ~in_top
    return {"drop": drop, "topk_lost": lost, "collapsed": drop | lost}


# --------------------------------------------------------------------------------------------
# the probe


def _mass_matrix_summary(rows: list[dict], key: str, n_boot: int, seed: int, level: float = 0.95) -> dict:
    """Mean ``[L, G]`` mass matrix over rows with cluster-bootstrap percentile CIs per cell."""
    if not rows:
        return {"n": 0, "n_scenarios": 0, "mean": None, "ci_low": None, "ci_high": None}
    X = np.asarray([r[key] for r in rows], dtype=float)             # [n, L, G]
    w = bootstrap_weights([r["scenario"] for r in rows], [r["instance"] for r in rows], n_boot, seed).astype(float)
    reps = np.einsum("bn,nlg->blg", w, X) / w.sum(1)[:, None, None]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha], axis=0)
    return {"n": len(rows), "n_scenarios": len({r["scenario"] for r in rows}), "mean": X.mean(0).tolist(),
            "ci_low": lo.tolist(), "ci_high": hi.tolist(), "ci_level": level}


def _attention_aggregates(rows, bands, n_boot, seed) -> dict:
    """Per family and subset (flipping / all) and run: the layer x group mass matrix with CIs and
    the band-mean mass per group (summarize)."""
    out = {}
    for subset, sel in (("flipping", [r for r in rows if r["flips"]]), ("all", rows)):
        out[subset] = {}
        for fam, rs in K.by_family(sel).items():
            entry = {}
            for run in RUNS:
                key = f"mass_{run}"
                band_stats = {}
                for band in bands:
                    l0, l1 = band["layers"]
                    band_stats[band["name"]] = {
                        g: K.summary(rs, lambda r, gi=gi: float(np.mean([m[gi] for m in r[key][l0:l1]])), n_boot, seed)
                        for gi, g in enumerate(GROUPS)}
                entry[run] = {"layers": _mass_matrix_summary(rs, key, n_boot, seed), "bands": band_stats}
            out[subset][fam] = entry
    return out


def _knockout_aggregates(ko_rows, variants, n_boot, seed) -> dict:
    """Per subset, family, run and variant: score change with CIs and the collapse / flip counts."""
    out = {}
    for subset, sel in (("flipping", [r for r in ko_rows if r["flips"]]), ("all", ko_rows)):
        out[subset] = {}
        for fam, rs in K.by_family(sel).items():
            out[subset][fam] = {}
            for run in RUNS:
                cells = {}
                for v in variants:
                    cell = [r for r in rs if r["run"] == run and r["variant"] == v["name"]]
                    n = len(cell)
                    changed = sum(r["decision_changed"] for r in cell)
                    collapsed = sum(r["collapsed"] for r in cell)
                    intact = sum(r["flip_intact"] for r in cell)
                    cells[v["name"]] = {
                        "group": v["group"], "band": v["band"], "layers": v["layers"],
                        "delta": K.summary(cell, "delta", n_boot, seed),
                        "delta_toward_other": K.summary(cell, "delta_toward_other", n_boot, seed),
                        "n": n, "n_decision_changed": changed, "n_collapsed": collapsed,
                        "n_collapsed_drop": sum(r["collapse_drop"] for r in cell),
                        "n_collapsed_topk": sum(r["collapse_topk"] for r in cell),
                        "n_changed_but_collapsed": changed - intact,
                        "flip_intact": proportion(intact, n), "collapse_rate": proportion(collapsed, n),
                    }
                out[subset][fam][run] = cells
    return out


def _variants(cfg, n_layers: int) -> tuple[list[dict], list[dict]]:
    bands = K.layer_bands(n_layers, [list(b) for b in cfg.bands], cfg.get("band_units", "fraction"))
    variants = []
    for names in cfg.knockout_groups:
        names = [str(g) for g in (names if not isinstance(names, str) else [names])]
        for band in bands:
            variants.append({"name": f"{'+'.join(names)}@{band['name']}", "group": "+".join(names),
                             "groups": names, "band": band["name"], "layers": band["layers"]})
    return bands, variants


class LocationRow(PairRow):
    """A pair: per run the ``[n_layers, n_groups]`` decision-row attention masses."""

    mass_old: list[list[float]]
    mass_new: list[list[float]]
    null_knockout_err: float


class KnockoutRow(TypedDict):
    """One knockout of one run of one pair."""

    pair: str
    run: str
    variant: str
    delta: float
    collapsed: bool
    decision_changed: bool
    flip_intact: bool


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[LocationRow]
    knockout_rows: list[KnockoutRow]
    groups: list[str]
    n_sinks: int
    bands: list[dict[str, Any]]
    variants: list[dict[str, Any]]
    collapse: dict[str, Any]
    examples: dict[str, dict[str, Any]]


def _knockout_pair(ctx, pr, row: dict, variants: list[dict], n_sinks: int, drop_nats: float, top_k: int) -> list[dict]:
    """One pair, both runs: the clean attention masses per key group (written into ``row``) and one
    knockout row per run and variant (score change, knocked candidate log-probs, collapse flags)."""
    model, n_layers = ctx.bundle.model, ctx.bundle.adapter.n_layers
    pair = pr.pair
    groups = key_groups(pair.field, pair.decision, n_sinks)
    masks = torch.cat([torch.zeros(1, n_layers, pair.decision, dtype=torch.bool)] +
                      [knockout_masks(n_layers, pair.decision, groups, [(v["groups"], v["layers"])])
                       for v in variants])
    row |= {"groups": {g: list(s) for g, s in groups.items()}}
    base = {k: row[k] for k in ("pair", "scenario", "family", "instance", "flips")}
    null_err = 0.0
    ko_rows = []
    for run_name, cache, s_clean, s_other in (("old", pr.old_cache, pr.s_old, pr.s_new),
                                              ("new", pr.new_cache, pr.s_new, pr.s_old)):
        with ctx.timer("knockout"):
            scores, read = _scores(model, pair, cache, masks, ctx.readout, True, ctx.budget_bytes)
        mass = group_masses(read.probs[0], groups)                       # [L, G] clean variant
        row[f"mass_{run_name}"] = mass.tolist()
        row[f"recon_err_{run_name}"] = read.recon_err
        row[f"knocked_mass_max_{run_name}"] = max(
            float(group_masses(read.probs[i + 1], groups)[l0:l1][:, [GROUPS.index(g) for g in v["groups"]]].sum(-1).max())
            for i, v in enumerate(variants) for l0, l1 in [v["layers"]])
        null_err = max(null_err, abs(float(scores[0]) - s_clean))
        flags = collapse_flags(read.logprobs[:, 0], (pair.cand_old[0], pair.cand_new[0]), drop_nats, top_k)
        lp_c = read.logprobs[:, 0][:, [pair.cand_old[0], pair.cand_new[0]]]
        row[f"lp_cand_{run_name}"] = lp_c[0].tolist()                  # clean [cand_old, cand_new]
        toward = 1.0 if s_other > s_clean else -1.0
        for i, v in enumerate(variants, start=1):
            s_k = float(scores[i])
            changed = (s_k > 0) != (float(scores[0]) > 0)
            ko_rows.append(base | {
                "run": run_name, "variant": v["name"], "group": v["group"], "band": v["band"],
                "s_clean": float(scores[0]), "s_knock": s_k, "delta": s_k - float(scores[0]),
                "delta_toward_other": toward * (s_k - float(scores[0])),
                "lp_cand_knock": lp_c[i].tolist(),
                "collapse_drop": bool(flags["drop"][i]), "collapse_topk": bool(flags["topk_lost"][i]),
                "collapsed": bool(flags["collapsed"][i]), "decision_changed": changed,
                "flip_intact": changed and not bool(flags["collapsed"][i]),
            })
    row["null_knockout_err"] = null_err
    return ko_rows


def run(ctx) -> dict:
    """Attention masses and knockouts of every aligned pair; see the module docstring.

    Returns:
        ``rows`` (one per pair: clean status, per-run ``[L, G]`` masses ``mass_old``/``mass_new``,
        clean first-token candidate log-probs ``lp_cand_old``/``lp_cand_new``, the reconstruction
        check), ``knockout_rows`` (one per pair x run x variant: score change, knocked candidate
        log-probs, collapse flags),
        ``aggregates`` (``attention``, ``knockout``, checks), ``exclusions``/``excluded``
        (tokenisation exclusions and pairs that do not flip, which are left out of the ``flipping``
        aggregates), ``groups``, ``bands``, ``variants``, ``collapse``.
    """
    cfg = ctx.cfg
    n_layers = ctx.bundle.adapter.n_layers
    n_sinks = int(cfg.n_sinks)
    drop_nats, top_k = float(cfg.collapse.drop_nats), int(cfg.collapse.top_k)
    n_boot = int(cfg.get("n_boot", 2000))
    bands, variants = _variants(cfg, n_layers)
    rows, ko_rows, examples = [], [], {}
    for pr, row in K.each_pair(ctx, desc="read_location"):
        pair = pr.pair
        ko_rows += _knockout_pair(ctx, pr, row, variants, n_sinks, drop_nats, top_k)
        rows.append(row)
        fam = row["family"]
        if fam not in examples or (row["flips"] and not examples[fam]["flips"]):
            examples[fam] = {"pair": row["pair"], "flips": row["flips"], "field": list(pair.field),
                             "decision": pair.decision, "mass_new": row["mass_new"]}
    excluded = K.excluded_rows(ctx.pairs.excluded, rows)
    with ctx.timer("statistics"):
        aggregates = {
            "n_pairs": len(rows), "n_flip": sum(r["flips"] for r in rows),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in rows if r["flips"])),
            "checks": {
                "max_mass_sum_err": max((abs(sum(m) - 1) for r in rows for run in RUNS for m in r[f"mass_{run}"]),
                                        default=None),
                "max_recon_err": max((r[f"recon_err_{run}"] for r in rows for run in RUNS), default=None),
                "max_null_knockout_err": max((r["null_knockout_err"] for r in rows), default=None),
                "max_knocked_mass": max((r[f"knocked_mass_max_{run}"] for r in rows for run in RUNS), default=None),
            },
            "attention": _attention_aggregates(rows, bands, n_boot, ctx.seed),
            "knockout": _knockout_aggregates(ko_rows, variants, n_boot, ctx.seed),
        }
    return {"rows": rows, "knockout_rows": ko_rows, "aggregates": aggregates,
            "exclusions": K.exclusion_counts(excluded), "excluded": excluded,
            "groups": list(GROUPS), "n_sinks": n_sinks, "bands": bands,
            "variants": [{k: v[k] for k in ("name", "group", "band", "layers")} for v in variants],
            "collapse": {"drop_nats": drop_nats, "top_k": top_k,
                         "rule": "collapsed = both candidates' first-token log-probs fall by >= drop_nats, "
                                 "or neither candidate stays in the top_k that held one of them"},
            "examples": examples}
