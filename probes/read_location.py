"""``read_location``: where the decision query reads, and what a knockout of that read does
(docs/design.md §3, §5).

Specification: ``docs/probes/read_location.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import BandList, Count, NonNegative, NonNegativeFloat, one_of
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.protocol import Check, GeneratedReadout, Measure, pair_loop, readout_aggregates
from kvnotes.harness.screened import mass_groups
from kvnotes.harness.readout import collapse_flags
from kvnotes.harness.stats import matrix_summary, proportion
from kvnotes.harness.registry import Conformance
from kvnotes.kv.knockout import CHAIN_GROUPS, GROUPS, key_groups, knockout_masks
from kvnotes.records.figures import Bars, Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, NotRequired, PairRow, TypedDict

RUNS = ("old", "new")
#: With ``scenario.variant=cot`` the knockouts hold while the chain is generated and the decision is
#: read after it (see "Chain of thought" in the specification).
SUPPORTS_COT = True


def _knockout_groups(groups: Any) -> Any:
    """A non-empty list of knockout variants, each a group name of :data:`kvnotes.kv.knockout.GROUPS`
    or a non-empty list of them (knocked out together)."""
    if not isinstance(groups, list) or not groups:
        raise ValueError("must be a non-empty list of groups (each a name or a list of names)")
    for g in groups:
        names = [g] if isinstance(g, str) else g
        if not isinstance(names, list) or not names or any(n not in GROUPS for n in names):
            raise ValueError(f"each entry must be one of {', '.join(map(repr, GROUPS))} or a non-empty list of them, "
                             f"got {g!r}")
    return groups


@dataclass
class Collapse:
    """Readout-destroyed criterion (see the specification)."""

    drop_nats: NonNegativeFloat = 2.3
    top_k: Count = 10


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/read_location.yaml``
    (the defaults are here; the YAML sets what differs; see the specification); with
    ``scenario.variant=cot`` the generated readout's keys (:class:`kvnotes.harness.protocol.GeneratedReadout`)."""

    n_sinks: NonNegative = 1
    #: Layer bands for knockouts, as [lo, hi] fractions of depth (band_units: fraction) or layer indices [lo,
    #: hi) (band_units: layer). The last band is every layer.
    band_units: Annotated[str, one_of("fraction", "layer")] = "fraction"
    bands: BandList = field(
        default_factory=lambda: [[0.0, 0.25], [0.25, 0.5], [0.5, 0.75], [0.75, 1.0], [0.0, 1.0]])
    #: Key groups hidden from the decision row, one knockout per entry and band (a list = their union).
    knockout_groups: Annotated[Any, AfterValidator(_knockout_groups)] = field(
        default_factory=lambda: [["field"], ["downstream"], ["sinks"], ["field", "downstream"]])
    #: Readout destroyed ("collapsed"): both candidates' first-token log-probs fall by >= drop_nats (2.3 nats
    #: ~ both lose 90% of their probability), or neither candidate stays in the top_k that held one of them in
    #: the clean run. Decision changes of collapsed readouts are not flips.
    collapse: Collapse = field(default_factory=Collapse)


# --------------------------------------------------------------------------------------------
# the probe


def _attention_aggregates(rows, bands, n_boot, seed, groups=GROUPS) -> dict:
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
                        for gi, g in enumerate(groups)}
                entry[run] = {"layers": matrix_summary(rs, key, n_boot, seed), "bands": band_stats}
            out[subset][fam] = entry
    return out


def _knockout_aggregates(ko_rows, variants, n_boot, seed, unreached: list[dict] | None = None) -> dict:
    """Per subset, family, run and variant: score change with CIs and the collapse / flip counts;
    with ``unreached`` (knocked chains that missed their marker) also their count, ``n_unreached``."""
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
                    if unreached is not None:
                        cells[v["name"]]["n_unreached"] = sum(
                            u["variant"] == v["name"] and u["run"] == run and (fam == "all" or u["family"] == fam)
                            and (subset == "all" or u["flips"]) for u in unreached)
                out[subset][fam][run] = cells
    return out


def _variants(cfg, n_layers: int) -> tuple[list[dict], list[dict]]:
    bands = K.layer_bands(n_layers, [list(b) for b in cfg.bands], cfg.band_units)
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
    #: ``scenario.variant=cot``: knocked chains that did not reach their marker (excluded, counted)
    knockout_unreached: NotRequired[list[dict[str, Any]]]
    groups: list[str]
    n_sinks: int
    bands: list[dict[str, Any]]
    variants: list[dict[str, Any]]
    collapse: dict[str, Any]
    examples: dict[str, dict[str, Any]]


def _knockout_rows(base: dict, run_name: str, variants: list[dict], sp, kn, toward: float, drop_nats: float,
                   top_k: int) -> tuple[list, list, list]:
    """One run's knockout rows: variant ``i`` of ``kn`` (:class:`kvnotes.harness.screened.Knocked`:
    its log-probs and score read at the decision position, or after its chain's marker) against
    variant 0, the clean one; ``toward`` signs ``delta_toward_other``. Rows keep what only a chain
    has (its record, the candidate it names: :meth:`kvnotes.harness.screened.ScreenedPair.chain_columns`);
    a chain that missed its marker goes to the unreached list with its reason.

    Returns:
        (the clean ``[lp(cand_old), lp(cand_new)]``, knockout rows, unreached rows).
    """
    pair = sp.pair
    lp = kn.logprobs
    flags = collapse_flags(lp, (pair.cand_old[0], pair.cand_new[0]), drop_nats, top_k)
    lp_c = lp[:, [pair.cand_old[0], pair.cand_new[0]]]
    s_clean = kn.s[0]
    rows, unreached = [], []
    for i, v in enumerate(variants, start=1):
        cols = base | {"run": run_name, "variant": v["name"], "group": v["group"], "band": v["band"]}
        cols |= sp.chain_columns(kn, i, chain="chain")
        if not kn.reached[i]:
            unreached.append(cols | {"reason": kn.unreached[i]})
            continue
        cols |= sp.chain_columns(kn, i, side="side_knock")
        s_k = kn.s[i]
        changed = (s_k > 0) != (s_clean > 0)
        rows.append(cols | {
            "s_clean": s_clean, "s_knock": s_k, "delta": s_k - s_clean, "delta_toward_other": toward * (s_k - s_clean),
            "lp_cand_knock": lp_c[i].tolist(), "collapse_drop": bool(flags["drop"][i]),
            "collapse_topk": bool(flags["topk_lost"][i]), "collapsed": bool(flags["collapsed"][i]),
            "decision_changed": changed, "flip_intact": changed and not bool(flags["collapsed"][i])})
    return lp_c[0].tolist(), rows, unreached


def _knockout_pair(ctx, sp, row: dict, variants: list[dict], n_sinks: int, drop_nats: float,
                   top_k: int) -> tuple[list[dict], list[dict]]:
    """One pair, both runs, under the run's readout
    (:meth:`kvnotes.harness.screened.ScreenedPair.knockout`): per run the attention masses of the
    queries that read the decision per key group and one knockout row per variant (score change,
    knocked candidate log-probs, collapse flags); the pair's columns are written into ``row``.

    Returns:
        (knockout rows, knockout rows whose chain missed its marker (``reason``, the chain)).
    """
    n_layers = ctx.bundle.adapter.n_layers
    pair = sp.pair
    groups = key_groups(pair.field, pair.decision, n_sinks)
    masks = knockout_masks(n_layers, pair.decision, groups,           # variant 0: nothing knocked out
                           [([], [0, n_layers])] + [(v["groups"], v["layers"]) for v in variants])
    row |= {"groups": {g: list(s) for g, s in groups.items()}}
    base = {k: row[k] for k in ("pair", "scenario", "family", "instance", "flips")}
    null_err = 0.0
    ko_rows, unreached = [], []
    knocked = sp.knockout(masks, groups)
    for run_name, kn in knocked.items():
        other = "new" if run_name == "old" else "old"
        idx = [[kn.groups.index(g) for g in v["groups"]] for v in variants]
        row[f"mass_{run_name}"] = kn.reading_masses(0).tolist()
        row[f"recon_err_{run_name}"] = kn.recon_err
        row[f"knocked_mass_max_{run_name}"] = max(
            (float(kn.masses[i + 1][:, l0:l1][..., idx[i]].sum(-1).max())
             for i, v in enumerate(variants) for l0, l1 in [v["layers"]]), default=0.0)
        if not kn.reached[0]:                                  # the screen's chain did, this batch's did not
            unreached += [base | {"run": run_name, "variant": v["name"], "reason": "clean_no_marker"}
                          | sp.chain_columns(kn, i, chain="chain") for i, v in enumerate(variants, start=1)]
            continue
        s_clean, s_other = row[f"s_{run_name}"], row[f"s_{other}"]
        null_err = max(null_err, abs(kn.s[0] - s_clean))
        toward = 1.0 if s_other > s_clean else -1.0
        row[f"lp_cand_{run_name}"], got, missed = _knockout_rows(base, run_name, variants, sp, kn, toward, drop_nats,
                                                                 top_k)
        ko_rows += got
        unreached += missed
    row["null_knockout_err"] = null_err
    row |= CHAINS.of(sp, knocked, groups)
    return ko_rows, unreached


# --------------------------------------------------------------------------------------------
# chain of thought (scenario.variant=cot): what only a chain has


def _per_key(mass: list[list[float]], group: str, size: int, visible: float) -> float | None:
    """Layer-mean mass of ``group`` per key, relative to uniform attention over the ``visible``
    keys: ``(mass / size) * visible`` (1 = as much as an average key, > 1 = read above it; None for
    an empty group)."""
    return float(np.mean([m[CHAIN_GROUPS.index(group)] for m in mass])) / size * visible if size else None


def _chain_columns(sp, knocked: dict, groups: dict) -> dict:
    """Per run, of the clean chain: the decision query's masses (``mass_decision_<run>``, as the
    direct readout reads them), the query of the marker's last token (``mass_marker_<run>``, the
    one the decision is read after) and the field's and the downstream's mass per key
    (:func:`_per_key`, over the keys a chain query sees on average); ``clean_chain_matches``: both
    clean chains decoded the screen's chains token for token."""
    d = sp.pair.decision
    sizes = {g: e - s for g, (s, e) in groups.items()}
    out: dict = {"clean_chain_matches": True}
    for run_name, kn in knocked.items():
        assert kn.masses is not None and kn.lengths is not None
        masses, n = kn.masses[0], kn.lengths[0]
        chain = kn.reading_masses(0).tolist()
        visible = d + 1 + (n + 1) / 2 if n else d + 1                    # mean keys a chain query sees
        out |= {f"mass_decision_{run_name}": masses[0].tolist(), f"mass_marker_{run_name}": masses[min(n, len(masses) - 1)].tolist(),
                f"field_per_key_{run_name}": _per_key(chain, "field", sizes["field"], visible),
                f"downstream_per_key_{run_name}": _per_key(chain, "downstream", sizes["downstream"], visible)}
        out["clean_chain_matches"] &= sp.chain_columns(kn, 0, reproduces=("same", run_name))["same"]
    return out


#: What only a chain has, measured under the generated readout.
CHAINS = Measure("chains", _chain_columns, readouts=("generated",))

#: The record's checks: every captured mass matrix sums to 1 per layer, the capture reproduces the
#: executed attention, knocking nothing out re-reads the clean score, knocked keys get no mass; and
#: the chains re-decoded for the knockouts are the screen's.
CHECKS = (
    Check("max_mass_sum_err", lambda rows: max((abs(sum(m) - 1) for r in rows for k in r if k.startswith("mass_")
                                                for m in r[k]), default=None)),
    Check("max_recon_err", lambda rows: max((r[f"recon_err_{run}"] for r in rows for run in RUNS), default=None)),
    Check("max_null_knockout_err", lambda rows: max((r["null_knockout_err"] for r in rows), default=None)),
    Check("max_knocked_mass", lambda rows: max((r[f"knocked_mass_max_{run}"] for r in rows for run in RUNS),
                                               default=None)),
    Check("n_clean_chain_mismatch", lambda rows: sum(not r["clean_chain_matches"] for r in rows),
          readouts=("generated",)))


def _chain_attention(rows: list[dict], n_boot: int, seed: int) -> dict:
    """Per subset (flipping / all), family and run: the generated tokens' layer-mean attention mass
    on the field, the downstream notes and the rest, the same per key relative to uniform attention
    over the visible keys (:func:`_per_key`; 1 = an average key), and
    the decision query's field mass for comparison (does the reasoning re-read the field?)."""
    fi, di = CHAIN_GROUPS.index("field"), CHAIN_GROUPS.index("downstream")

    def layer_mean(key: str, gi: int | None = None):
        def get(r):
            m = np.asarray(r[key])
            return float(m[:, gi].mean()) if gi is not None else float(1 - m[:, [fi, di]].sum(-1).mean())
        return get

    out: dict = {}
    for subset, sel in (("flipping", [r for r in rows if r["flips"]]), ("all", rows)):
        out[subset] = {}
        for fam, rs in K.by_family(sel).items():
            out[subset][fam] = {run: {
                "field": K.summary(rs, layer_mean(f"mass_{run}", fi), n_boot, seed),
                "downstream": K.summary(rs, layer_mean(f"mass_{run}", di), n_boot, seed),
                "rest": K.summary(rs, layer_mean(f"mass_{run}"), n_boot, seed),
                "field_per_key": K.summary([r for r in rs if r[f"field_per_key_{run}"] is not None],
                                           f"field_per_key_{run}", n_boot, seed),
                "downstream_per_key": K.summary([r for r in rs if r[f"downstream_per_key_{run}"] is not None],
                                                f"downstream_per_key_{run}", n_boot, seed),
                "decision_query_field": K.summary(rs, layer_mean(f"mass_decision_{run}", fi), n_boot, seed),
                "chain_length": K.summary(rs, lambda r, run=run: float(r[f"chain_{run}"]["length"]), n_boot, seed),
            } for run in RUNS}
    return out


def run(ctx) -> dict:
    """Attention masses and knockouts of every screened pair under the run's readout
    (:func:`kvnotes.harness.protocol.pair_loop`, every pair measured); see the specification.

    Returns:
        ``rows`` (one per pair: clean status, per-run ``[L, G]`` masses ``mass_old``/``mass_new``,
        clean first-token candidate log-probs ``lp_cand_old``/``lp_cand_new``, the reconstruction
        check), ``knockout_rows`` (one per pair x run x variant: score change, knocked candidate
        log-probs, collapse flags),
        ``aggregates`` (``attention``, ``knockout``, checks), ``exclusions``/``excluded``
        (tokenisation exclusions and pairs that do not flip, which are left out of the ``flipping``
        aggregates), ``groups``, ``bands``, ``variants``, ``collapse``. Under the generated readout
        (the specification) rows also keep the chains (``chain_old``/``chain_new``), the generated
        tokens' masses ``mass_<run>`` (``[L, 6]``, :data:`kvnotes.kv.knockout.CHAIN_GROUPS`), the decision query's
        ``mass_decision_<run>`` and the marker query's ``mass_marker_<run>``; knockout rows carry
        their chain; ``knockout_unreached`` lists knocked chains without a marker;
        ``aggregates.readout = "generated"``, ``aggregates.chain_attention`` and per knockout cell
        ``n_unreached``.
    """
    cfg = ctx.cfg
    n_sinks = cfg.n_sinks
    drop_nats, top_k = float(cfg.collapse.drop_nats), int(cfg.collapse.top_k)
    n_boot = cfg.n_boot
    bands, variants = _variants(cfg, ctx.bundle.adapter.n_layers)
    ko_rows: list[dict] = []
    unreached: list[dict] = []

    def measure(sp, row: dict) -> dict:
        row = dict(row)
        ko, un = _knockout_pair(ctx, sp, row, variants, n_sinks, drop_nats, top_k)
        ko_rows.extend(ko)
        unreached.extend(un)
        return row

    pr = pair_loop(ctx, "read_location", measure, scope="all", measures=(CHAINS,))
    rows = pr.rows
    chains = CHAINS.name in pr.measured
    groups = mass_groups(pr.readout)
    with ctx.timer("statistics"):
        aggregates = {
            "n_pairs": len(rows), "n_flip": sum(r["flips"] for r in rows),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in rows if r["flips"])),
            "checks": pr.checks(CHECKS),
            "attention": _attention_aggregates(rows, bands, n_boot, ctx.seed, groups),
            "knockout": _knockout_aggregates(ko_rows, variants, n_boot, ctx.seed, unreached if chains else None),
        } | readout_aggregates(ctx, pr)
        if chains:
            aggregates |= {"n_knocked_unreached": len(unreached), "chain_attention": _chain_attention(rows, n_boot, ctx.seed)}
    examples: dict = {}
    for row in rows:
        fam = row["family"]
        if fam not in examples or (row["flips"] and not examples[fam]["flips"]):
            examples[fam] = {k: row[k] for k in ("pair", "flips", "field", "decision", "mass_new")}
            if "chain_new" in row:
                examples[fam]["chain_new_text"] = ctx.bundle.tokenizer.decode(row["chain_new"]["ids"],
                                                                              skip_special_tokens=True)
    what = "(after the marker) " if chains else ""
    return {"rows": rows, "knockout_rows": ko_rows, "aggregates": aggregates,
            "exclusions": pr.exclusions, "excluded": pr.excluded,
            "groups": list(groups), "n_sinks": n_sinks, "bands": bands,
            "variants": [{k: v[k] for k in ("name", "group", "band", "layers")} for v in variants],
            "collapse": {"drop_nats": drop_nats, "top_k": top_k,
                         "rule": f"collapsed = both candidates' first-token log-probs {what}fall by >= drop_nats, "
                                 "or neither candidate stays in the top_k that held one of them"},
            "examples": examples} | ({"knockout_unreached": unreached} if chains else {})


# ---------------------------------------------------------------------------------------------
# presentation


def _subset(agg: dict, family: str) -> dict | None:
    """The flipping pairs' aggregate of a family when it has pairs, else all aligned pairs'."""
    return agg.get("flipping", {}).get(family) or agg.get("all", {}).get(family)


def attention_by_layer(res: dict) -> dict:
    """Over all families (flipping pairs when any): per run, per key group, the mean decision-row
    attention mass at each layer with its interval, for a :class:`Curves` over layers."""
    entry = _subset(res.get("aggregates", {}).get("attention", {}), "all") or {}
    groups = res.get("groups", [])
    out: dict = {}
    for run in RUNS:
        mat = (entry.get(run) or {}).get("layers") or {}
        if not mat.get("mean"):
            continue
        lo, hi = mat.get("ci_low") or [], mat.get("ci_high") or []
        out[f"{run} run"] = {g: {layer: {"mean": row[j], "n": mat["n"],
                                         "ci_mean": [lo[layer][j], hi[layer][j]] if lo and hi else None}
                                 for layer, row in enumerate(mat["mean"]) if row[j] is not None}
                             for j, g in enumerate(groups)}
    return out


def knockout_by_band(res: dict) -> dict:
    """Over all families (flipping pairs when any): per run, per layer band, per knocked group, the
    score change summary, for :class:`Bars` per run."""
    entry = _subset(res.get("aggregates", {}).get("knockout", {}), "all") or {}
    out: dict = {}
    for v in res.get("variants", []):
        for run in RUNS:
            cell = (entry.get(run) or {}).get(v["name"])
            if isinstance(cell, dict) and isinstance(cell.get("delta"), dict):
                out.setdefault(run, {}).setdefault(v["band"], {})[v["group"]] = cell["delta"]
    return out


#: How this probe's records are shown: its figures (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Reshaped(Curves("attention-by-layer", "@/*/#", "attention of the decision query by key group (mean over "
                    "heads and pairs; flipping pairs when any)", "layer", "attention mass"), attention_by_layer),
    *(Reshaped(Bars(f"knockout-{run}", f"{run}/@/*", f"decision-row knockout per layer band, {run} run: score "
                    "change knocked - clean (mean, 95% interval)", "nats"), knockout_by_band) for run in RUNS)))


#: The zoo conformance lane's settings for it (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.bands=[[0.0,0.5],[0.0,1.0]]", "probe.knockout_groups=[[field],[downstream]]"))
