"""``suffix_recovery``: where in the downstream the notes live (docs/design.md §3, §5).

Specification: ``docs/probes/suffix_recovery.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from annotated_types import Len
from pydantic import AfterValidator

from kvnotes.harness import kit as K
from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import Count, LayerBands, OpenFraction, Share, one_of, require_instances
from kvnotes.harness.kit import ProbeConfig, RandomControl, families_of, summaries_by_family
from kvnotes.harness.protocol import GeneratedReadout, pair_loop, readout_aggregates, readout_config
from kvnotes.harness.screened import ScreenedPair
from kvnotes.harness.selection import (ANCHORS, OFFSET_ANCHORS, coverage, coverage_warnings, grid_points, k_for, offset_profiles, offsets, pair_rng,
                                       position_sets, position_values, profile_for, rank_values, split_instances,
                                       split_warnings)
from kvnotes.harness.registry import Conformance
from kvnotes.kv.masks import VariantPlan, patched_positions
from kvnotes.records.figures import Bars, Curves
from kvnotes.records.presentation import Presentation, ResultsColumn
from kvnotes.records.schema import BaseResult, NotRequired, PairRow, TypedDict
from kvnotes.records.tables import ci

SET_FAMILIES = ("suffix", "prefix", "topk", "random")
#: Set families of the chain-of-thought curves (the others need the direct single-position map).
COT_FAMILIES = ("suffix", "prefix")
#: With ``scenario.variant=cot`` the coarse curves are read after generated reasoning.
SUPPORTS_COT = True
REFERENCES = ("none", "field", "downstream", "field_downstream")
NO_DOWNSTREAM = "no_downstream"


def _cot_family(name: str) -> str:
    """A set family the cot curves run (:data:`COT_FAMILIES`)."""
    if name not in COT_FAMILIES:
        raise ValueError(f"must be one of {', '.join(map(repr, COT_FAMILIES))} (scenario.variant=cot runs the coarse "
                         f"curves; topk and random need the single-position map or many draws, which stay "
                         f"direct-readout only)")
    return name


@dataclass
class Grid:
    """Set sizes k: fractions of the downstream length ``d - b`` (rounded up) and absolute counts (a
    count larger than a pair's downstream is skipped for that pair and counted)."""

    fractions: Annotated[list[Share], Len(min_length=1)] = field(default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0])
    counts: list[Count] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/suffix_recovery.yaml``
    (the defaults are here; the YAML sets what differs; see the specification); with
    ``scenario.variant=cot`` the generated readout's keys (:class:`kvnotes.harness.protocol.GeneratedReadout`),
    and ``cot_grid``, ``cot_families`` and ``cot_single`` stand in for ``grid``, ``families`` and
    ``single`` (:func:`kvnotes.harness.protocol.readout_config`)."""

    grid: Grid = field(default_factory=Grid)
    #: the set families: last-k / first-k downstream positions, the top-k positions ranked on
    #: selection pairs (held-out pairs), k-matched random sets
    families: Annotated[list[Annotated[str, one_of(*SET_FAMILIES)]], Len(min_length=1)] = field(
        default_factory=lambda: list(SET_FAMILIES))
    #: the single-position map (every downstream position alone; the top-k ranking reads it)
    single: bool = True
    #: n_draws: k-matched random sets per grid point (Generator seeded from seed + pair id)
    random: RandomControl = field(default_factory=lambda: RandomControl(5))
    #: aligned: match positions by aligning the downstream tokens | decision: offsets d - p | field_end:
    #: offsets p - b
    topk_anchor: Annotated[str, one_of(*ANCHORS)] = "aligned"
    #: share of each scenario's instances used to rank top-k positions
    selection_fraction: OpenFraction = 0.5
    #: number of equal layer bands, or a list of [lo, hi) layer ranges
    layer_bands: LayerBands = 5
    #: also patch every set together with the field (secondary curves)
    with_field: bool = True
    #: keep every random set in the rows (top-k sets are always kept)
    store_sets: bool = False
    #: keep the flipping pairs' prefix caches from the clean runs: each pair is prefilled once (~10 MB per
    #: pair on SmolLM2-135M); false bounds memory, then they are prefilled again
    keep_caches: bool = True
    #: ``scenario.variant=cot``: set sizes (fractions of the downstream), set families (last-k / first-k
    #: downstream positions), the single-position map (a chain per position: off)
    cot_grid: Grid = field(default_factory=lambda: Grid(fractions=[0.1, 0.25, 0.5, 1.0], counts=[]))
    cot_families: Annotated[list[Annotated[str, AfterValidator(_cot_family)]], Len(min_length=1)] = field(default_factory=lambda: list(COT_FAMILIES))
    cot_single: bool = False

    def check_run(self, run) -> None:
        """The held-out top-k curve needs a selection split, its ranking the single-position map and
        its verdict the random sets.

        Raises:
            KvnotesError: ``topk`` among the set families with ``scenario.n_instances < 2``, without
                the single-position map or without ``random`` (its control).
        """
        if "topk" in self.families:
            require_instances(run, 2, "suffix_recovery", "ranks positions on selection instances and tests them "
                              "on held-out ones")
            if not self.single:
                raise KvnotesError("probe.single=false: the topk set family ranks positions by the selection pairs' "
                                   "single-position map (set probe.single=true or leave topk out of probe.families)")
            if "random" not in self.families:
                raise KvnotesError("probe.families: the topk set family is judged against k-matched random sets, its "
                                   "control (keep random among the families or leave topk out)")


# ---------------------------------------------------------------------------------------------
# one pair


def _curves(idx: dict, rec: list[float], flip: list[bool]) -> tuple[dict, dict]:
    """Per curve name and grid point: the mean recovery over its sets and whether most of them
    flip the decision (None for a skipped grid point)."""
    curves, flipped = {}, {}
    for name, per_k in idx.items():
        vals: list = []
        flips: list = []
        for ids in per_k:
            if ids is None:
                vals.append(None)
                flips.append(None)
            elif any(rec[i] is None for i in ids):                 # a chain missed its marker
                vals.append(None)
                flips.append(None)
            else:
                vals.append(float(np.mean([rec[i] for i in ids])))
                flips.append(sum(bool(flip[i]) for i in ids) > len(ids) / 2)
        curves[name], flipped[name] = vals, flips
    return curves, flipped


def evaluate_pair(sp: ScreenedPair, grid: list[dict], bands: list[dict], rng: np.random.Generator,
                  n_draws: int, topk_order: list[int] | None = None, with_field: bool = True,
                  store_sets: bool = False, families: Sequence[str] = SET_FAMILIES, single: bool = True) -> dict:
    """Every variant of one screened pair, scored (or decoded) in one batch under the run's readout.

    Args:
        sp: the screened pair (:class:`kvnotes.harness.screened.ScreenedPair`).
        grid: :func:`kvnotes.harness.selection.grid_points`.
        bands: :func:`kvnotes.harness.kit.layer_bands`.
        rng: the pair's generator for random sets (:func:`pair_rng`).
        n_draws: random sets per grid point.
        topk_order: downstream positions ranked by the selection profile (held-out pairs), or None.
        with_field: also evaluate every set together with the field.
        store_sets: keep the random sets in the result.
        families: the set families (``topk`` only with ``topk_order``).
        single: evaluate the single-position map.

    Returns:
        ``r_<ref>``/``flipped_<ref>`` for :data:`REFERENCES`; with ``single``, ``single``/``single_flipped``
        (``[n]``, downstream order); ``bands``/``bands_flipped``; ``k`` (per grid point, None when
        skipped); ``curves``/``curves_flipped`` (family -> per grid point; ``random`` is the mean
        over draws and its flip flag the majority; None where a chain missed its marker); with
        ``random``: ``random_draws`` (per grid point, per draw),
        ``random_flip_share``, ``random_sizes`` (distinct positions actually patched per draw,
        read back from the masks) and ``random_outside`` (patched positions outside ``[b, d)``,
        must be 0); ``topk_sets`` (held-out pairs); ``n_variants`` (unique masks evaluated);
        ``n_unreached`` (variants whose chain missed its marker: 0 under the direct readout); under
        the generated readout ``chains`` (``ref:<name>``, ``<family>@<g>``, ``band@<i>`` -> chain
        record, :meth:`kvnotes.harness.screened.ScreenedPair.chain_records`).
    """
    pair = sp.pair
    a, b = pair.field
    d = pair.decision
    down = (b, d)
    n = d - b
    field = list(range(a, b))
    plan = VariantPlan(sp.model.config.get_text_config().num_hidden_layers, d)
    names = {f"ref:{k}": plan.add(v) for k, v in (("none", []), ("field", field), ("downstream", range(b, d)),
                                                    ("field_downstream", range(a, d)))}
    single_idx = [plan.add([p]) for p in range(b, d)] if single else []
    band_idx = [plan.add(range(b, d), range(*band["layers"])) for band in bands]
    names |= {f"band@{i}": v for i, v in enumerate(band_idx)}
    ks = [k_for(pt, n) for pt in grid]
    fams = [f for f in families if f != "topk" or topk_order is not None]
    sets = position_sets(fams, ks, down, rng, n_draws, topk_order)
    idx = {f: [None if s is None else [plan.add(x) for x in s] for s in sets[f]] for f in fams}
    if with_field:
        idx |= {f"field+{f}": [None if s is None else [plan.add(field + x) for x in s] for s in sets[f]] for f in fams}
    names |= {f"{c}@{g}": ids[0] for c, per_k in idx.items() for g, ids in enumerate(per_k) if ids and len(ids) == 1}
    masks = plan.masks()
    sc = sp.score(masks)
    rec, flip = sc.r, sc.flipped
    out: dict = {"downstream": [b, d], "n_downstream": n, "n_variants": len(plan.specs), "k": ks}
    for name in REFERENCES:
        i = names[f"ref:{name}"]
        out[f"r_{name}"], out[f"flipped_{name}"] = rec[i], flip[i]
    if single:
        out["single"] = [rec[i] for i in single_idx]
        out["single_flipped"] = [flip[i] for i in single_idx]
    out["bands"] = [rec[i] for i in band_idx]
    out["bands_flipped"] = [flip[i] for i in band_idx]
    out["curves"], out["curves_flipped"] = _curves(idx, rec, flip)
    if "random" in fams:
        rnd = idx["random"]
        out["random_draws"] = [None if ids is None else [rec[i] for i in ids] for ids in rnd]
        out["random_flip_share"] = [None if ids is None else float(np.mean([flip[i] for i in ids])) for ids in rnd]
        patched = patched_positions(masks)                                           # [V, d]
        out["random_sizes"] = [None if ids is None else [int(patched[i].sum()) for i in ids] for ids in rnd]
        out["random_outside"] = sum(int(patched[i, :b].sum()) for ids in rnd if ids for i in ids)
        if store_sets:
            out["random_sets"] = sets["random"]
    if topk_order is not None:
        out["topk_sets"] = [None if s is None else s[0] for s in sets["topk"]]
    out["n_unreached"] = sum(not ok for ok in sc.reached)
    return out | sp.chain_records(sc, names, "chains")


# ---------------------------------------------------------------------------------------------
# the probe


def _example(tokenizer, pair, row: dict) -> dict:
    """One pair's single-position map with the prompt's token strings, for figures."""
    ids = pair.new.ids[: pair.decision + 1].tolist()
    return {"pair": row["pair"], "split": row.get("split"), "tokens": [tokenizer.decode([t]) for t in ids],
            "field": list(pair.field), "decision": pair.decision, "downstream": row["downstream"],
            "single": row["single"], "old": row["old"], "new": row["new"]}



def _offset_map(rows: list[dict], anchor: str) -> dict:
    """Mean single-position recovery per anchor offset over rows: ``{offset, mean, n}`` lists."""
    acc: dict[int, list[float]] = {}
    for r in rows:
        for o, v in zip(offsets(tuple(r["downstream"]), anchor).tolist(), r["single"], strict=True):
            acc.setdefault(o, []).append(v)
    offs = sorted(acc)
    return {"offset": offs, "mean": [float(np.mean(acc[o])) for o in offs], "n": [len(acc[o]) for o in offs]}


def _summaries(rows: list[dict], value, flipped, families: list[str], n_boot: int, seed: int,
               missed=None) -> dict:
    """:func:`kvnotes.harness.kit.summaries_by_family` over the rows with a value, with
    ``n_unreached`` per family and ``all``: the rows whose chain for this value missed its marker
    (``missed(row)``; default: the value is None), none under the direct readout."""
    missed = missed or (lambda r: value(r) is None)
    got = summaries_by_family(rows, value, flipped, families, n_boot, seed)
    for g, cell in got.items():
        cell["n_unreached"] = sum(bool(missed(r)) for r in rows if g == "all" or r["family"] == g)
    return got


def _aggregates(rows, held, grid, bands, families, n_boot, seed, anchor, fams, single: bool) -> dict:
    """The curves (held-out: the top-k ranking's pairs; all pairs), references and layer bands, the
    single-position map's summaries (with ``single``) and the random draws' flip shares (with the
    ``random`` family), over the values whose chain reached its marker."""
    def curve(rs, name):
        out = []
        for g in range(len(grid)):
            got = _summaries(rs, lambda r, g=g: r["curves"].get(name, [None] * len(grid))[g],
                             lambda r, g=g: bool(r["curves_flipped"][name][g]), families, n_boot, seed,
                             missed=lambda r, g=g: name in r["curves"] and r["k"][g] is not None
                             and r["curves"][name][g] is None)
            skipped = sum(1 for r in rs if name in r["curves"] and r["k"][g] is None)
            out.append(got | {"n_skipped_k_exceeds_downstream": skipped})
        return out

    canonical = [*SET_FAMILIES, *(f"field+{f}" for f in SET_FAMILIES)]
    names = [n for n in canonical if any(n in r["curves"] for r in rows)]
    held_names = [n for n in canonical if any(n in r["curves"] for r in held)]
    curves = {"heldout": {n: curve(held, n) for n in held_names},
              "all": {n: curve(rows, n) for n in names if "topk" not in n}}

    def draw_share(rs):
        out = []
        for i in range(len(grid)):
            cell = {}
            for g in ["all", *families]:
                v = [r["random_flip_share"][i] for r in rs
                     if r["random_flip_share"][i] is not None and (g == "all" or r["family"] == g)]
                cell[g] = float(np.mean(v)) if v else None
            out.append(cell)
        return out

    refs = {n: _summaries(rows, lambda r, n=n: r[f"r_{n}"], lambda r, n=n: bool(r[f"flipped_{n}"]), families,
                          n_boot, seed) for n in REFERENCES}
    band_aggs = [_summaries(rows, lambda r, i=i: r["bands"][i], lambda r, i=i: bool(r["bands_flipped"][i]),
                            families, n_boot, seed) for i in range(len(bands))]
    out = {"curves": curves, "references": refs, "bands": band_aggs}
    if single:
        out["single"] = {
            "max": summaries_by_family(rows, lambda r: max(r["single"]), lambda r: any(r["single_flipped"]), families,
                                       n_boot, seed),
            "sum": summaries_by_family(rows, lambda r: float(np.sum(r["single"])), lambda r: any(r["single_flipped"]),
                                       families, n_boot, seed),
            "by_offset": {anc: {g: _offset_map([r for r in rows if g == "all" or r["family"] == g], anc)
                                for g in ["all", *families]} for anc in OFFSET_ANCHORS},
        }
    if "random" in fams:
        out["random_draw_flip_share"] = {"heldout": draw_share(held), "all": draw_share(rows)}
    return out


class Band(TypedDict):
    """A layer band (:func:`kvnotes.harness.kit.layer_bands`)."""

    name: str
    layers: list[int]


class SuffixRow(PairRow):
    """A flipping pair: split (with the ``topk`` family), single-position map (with ``single``), band
    and curve recoveries (None where a chain missed its marker)."""

    split: NotRequired[str]
    downstream: list[int]
    single: NotRequired[list[float]]
    #: variants whose chain missed its marker (0 under the direct readout)
    n_unreached: int
    #: held-out pairs: downstream positions no selection position maps to (they rank last)
    topk_unmatched: NotRequired[int]
    bands: list[float | None]
    curves: dict[str, list[float | None]]
    r_none: float | None
    r_downstream: float | None


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[SuffixRow]
    grid: list[dict[str, Any]]
    layer_bands: list[Band]
    set_families: list[str]
    topk_anchor: str
    split: dict[str, Any]
    selection_pairs: list[str]
    examples: dict[str, dict[str, Any]]
    #: what could not be measured and why, one line each (also said on stderr)
    warnings: list[str]


#: Recovery levels whose smallest sufficient suffix is reported (``aggregates.suffix_fraction_for``).
RECOVERY_LEVELS = (0.5, 0.8)


def suffix_fraction_for(curves: dict, grid: list[dict], families: list[str]) -> dict:
    """The downstream fraction needed for a recovery level: per level of :data:`RECOVERY_LEVELS`
    and family (and ``all``), the smallest fraction ``f`` of the grid whose last-``f`` suffix set
    (all pairs; mean recovery) reaches the level, or None when no fraction does (the paper's
    dose-response of the field's placement reads it at 0.8: where the notes sit decides how much
    of the downstream must be patched).

    Args:
        curves: ``aggregates.curves.all`` (set family -> per grid point -> family -> summary).
        grid: the grid points (only ``fraction`` points are read).

    Returns:
        ``{str(level): {family: fraction or None}}`` (families without pairs left out).
    """
    suffix = curves.get("suffix", [])
    out: dict = {}
    for level in RECOVERY_LEVELS:
        out[str(level)] = {}
        for g in ["all", *families]:
            if not any((cell.get(g) or {}).get("n") for cell in suffix):
                continue                                    # a family without pairs: nothing to say
            hits = [pt["value"] for pt, cell in zip(grid, suffix) if pt["kind"] == "fraction"
                    and (c := cell.get(g) or {}).get("mean") is not None and c.get("n") and c["mean"] >= level]
            out[str(level)][g] = min(hits) if hits else None
    return out


def _mean_over_grid(row: dict, family: str) -> float | None:
    """A row's recovery of set family ``family`` averaged over the grid points where both the
    top-k and the random sets were evaluated (the area under the paired curves), None without any."""
    curves = row["curves"]
    if "topk" not in curves or "random" not in curves:
        return None
    vals = [v for v, t, c in zip(curves[family], curves["topk"], curves["random"]) if t is not None and c is not None]
    return float(np.mean(vals)) if vals else None


def _checks(rows: list[dict], held_rows: list[dict], grid: list[dict], sel, fams: list[str]) -> dict:
    """The probe's self-checks: exact references, the full set equals the downstream patch (where
    both chains reached their markers); with the ``random`` family, random sets inside the downstream
    span and of their size; with ``topk``, held-out profiles from selection pairs only."""
    full = [g for g, pt in enumerate(grid) if pt["kind"] == "fraction" and pt["value"] == 1.0]
    out = {
        "max_abs_none": K.worst(rows, "r_none"),
        "max_abs_field_downstream_minus_1": K.worst(rows, "r_field_downstream", 1.0),
        "max_abs_full_set_minus_downstream": max((abs(r["curves"][f][g] - r["r_downstream"]) for r in rows
                                                  for f in r["curves"] if not f.startswith("field+") for g in full
                                                  if r["curves"][f][g] is not None and r["r_downstream"] is not None),
                                                 default=None)}
    if "random" in fams:
        out |= {"random_outside_downstream": sum(r["random_outside"] for r in rows),
                "random_size_mismatch": sum(s != k for r in rows for k, ss in zip(r["k"], r["random_sizes"]) if ss
                                            for s in ss)}
    if "topk" in fams:
        inst_of = {r["pair"]: r["instance"] for r in rows}
        out["heldout_profile_pairs_not_in_selection"] = sum(inst_of[p] not in sel for r in held_rows
                                                            for p in r["topk_profile_pairs"])
    return out


def run(ctx) -> dict:
    """Suffix / prefix / top-k / random recovery curves, single-position map and layer bands of
    every flipping pair under the run's readout (:func:`kvnotes.harness.protocol.pair_loop`; under
    the generated one its ``cot_`` grid, set families and single-position map,
    :func:`kvnotes.harness.protocol.readout_config`: the coarse curves and bands); see the specification."""
    cfg = readout_config(ctx)
    n_layers = ctx.bundle.model.config.get_text_config().num_hidden_layers
    grid, fams = grid_points(list(cfg.grid.fractions), list(cfg.grid.counts)), list(cfg.families)
    ranked = "topk" in fams                     # the held-out top-k curve: a selection / held-out split
    bands_spec = cfg.layer_bands
    bands = K.layer_bands(n_layers, bands_spec if isinstance(bands_spec, int) else [list(x) for x in bands_spec])
    anchor = cfg.topk_anchor
    n_draws = int(cfg.random.n_draws)
    n_boot = cfg.n_boot

    pr = pair_loop(ctx, "suffix_recovery", exclude=lambda p: NO_DOWNSTREAM if p.decision <= p.field[1] else None,
                   keep=True, keep_caches=cfg.keep_caches)
    rows, excluded = pr.rows, pr.excluded
    sel, held = split_instances(rows, cfg.selection_fraction, ctx.seed) if ranked else (set(), set())
    order = sorted(range(len(rows)), key=lambda i: rows[i]["instance"] not in sel)   # selection first, stable
    out_rows: list[dict | None] = [None] * len(rows)
    profiles = None
    for i in K.units(ctx, order, "suffix_recovery"):
        row = rows[i] | ({"split": "selection" if rows[i]["instance"] in sel else "heldout"} if ranked else {})
        topk_order = None
        if row.get("split") == "heldout":
            if profiles is None:       # every selection pair is done: build the ranking profiles once
                profiles = offset_profiles([r | {"downstream_ids": pr.pairs[j].pair.downstream_ids}
                                            for j, r in enumerate(out_rows)
                                            if r is not None and r["split"] == "selection"], anchor)
            prof, source = profile_for(profiles, row["scenario"], row["family"])
            row |= {"topk_profile_source": source, "topk_profile_pairs": prof["pairs"] if prof else []}
            if prof is not None:
                down, ids = pr.pairs[i].pair.downstream, pr.pairs[i].pair.downstream_ids
                vals = position_values(prof, down, anchor, ids)              # one alignment per pair
                topk_order = rank_values(vals, down, anchor)
                row["topk_unmatched"] = int(np.isnan(vals).sum())
        row |= evaluate_pair(pr.pairs[i], grid, bands, pair_rng(ctx.seed, row["pair"]), n_draws, topk_order,
                             cfg.with_field, cfg.store_sets, fams, single=cfg.single)
        pr.pairs[i] = pr.pairs[i].released()                                     # free the caches
        out_rows[i] = row
    rows = [r for r in out_rows if r is not None]
    families = families_of(ctx, rows + excluded)
    held_rows = [r for r in rows if r.get("split") == "heldout" and "topk_sets" in r]
    examples: dict = {}
    for r, sp in zip(rows, pr.pairs) if cfg.single else ():
        cur = examples.get(r["family"])
        if cur is None or (cur["split"] != "heldout" and r.get("split") == "heldout"):
            examples[r["family"]] = _example(ctx.bundle.tokenizer, sp.pair, r)
    with ctx.timer("statistics"):
        aggregates = _aggregates(rows, held_rows, grid, bands, families, n_boot, ctx.seed, anchor, fams, cfg.single)
    aggregates["suffix_fraction_for"] = suffix_fraction_for(aggregates["curves"]["all"], grid, families)
    aggregates["checks"] = _checks(rows, held_rows, grid, sel, fams)
    aggregates |= {"n_unreached": sum(r["n_unreached"] for r in rows),
                   "not_run": ([] if cfg.single else ["single"]) + [f for f in SET_FAMILIES if f not in fams]}
    warnings: list[str] = []
    split: dict = {}
    if ranked:
        aggregates["verdicts"] = {"topk_positions": K.verdicts(
            held_rows, lambda r: _mean_over_grid(r, "topk"), lambda r: _mean_over_grid(r, "random"), families,
            f"top-k positions ranked on selection pairs ({anchor} positions) vs k random downstream positions, "
            f"held-out recovery averaged over the grid", n_boot, ctx.seed)}
        aggregates |= {"n_selection": sum(r["split"] == "selection" for r in rows), "n_heldout": len(held_rows),
                       "n_heldout_without_profile": sum(r["split"] == "heldout" and "topk_sets" not in r for r in rows)}
        warnings = split_warnings("suffix_recovery", rows, "held-out top-k curve", len(held_rows),
                                  "have no selection pairs of their scenario or family to rank positions by")
        sel_rows = [r for r in rows if r["split"] == "selection"]
        aggregates["profile_coverage"] = coverage(sel_rows, {r["pair"] for r in sel_rows}, ("scenario",))
        warnings += coverage_warnings("suffix_recovery", aggregates["profile_coverage"], "position ranking")
        split = {"selection_fraction": cfg.selection_fraction, "seed": ctx.seed, "selection": sorted(sel),
                 "heldout": sorted(held)}
    aggregates = readout_aggregates(ctx, pr) | K.pair_counts(ctx, rows, excluded, families) | aggregates
    return {"rows": rows, "exclusions": pr.exclusions, "excluded": excluded, "grid": grid, "layer_bands": bands,
            "topk_anchor": anchor, "aggregates": aggregates, "set_families": fams, "warnings": warnings, "split": split,
            "selection_pairs": [r["pair"] for r in rows if r.get("split") == "selection"], "examples": examples}


# ---------------------------------------------------------------------------------------------
# presentation


def _heldout(curve: str, kind: str, value: float):
    """A held-out curve of a suffix_recovery record at one grid point (``-`` for a record without it:
    no top-k ranking, as under the generated readout's coarse curves, or no such grid point)."""
    def cell(rec: dict, fam: str) -> str:
        res = rec["result"]
        points = [(g["kind"], g["value"]) for g in res["grid"]]
        held = res["aggregates"]["curves"]["heldout"].get(curve)
        if held is None or (kind, value) not in points:
            return "-"
        return ci(held[points.index((kind, value))].get(fam))
    return cell


def _fraction_for(level: str):
    """The smallest suffix fraction reaching ``level`` of recovery (``-`` when none does, or for a
    record without it)."""
    def cell(rec: dict, fam: str) -> str:
        got = rec["result"]["aggregates"].get("suffix_fraction_for", {}).get(level, {})
        if fam not in got:
            return "-"
        return "none reaches it" if got[fam] is None else f"{got[fam]:g}"
    return cell


#: The columns this probe's records add to the per-family results table (kvnotes table --results).
SUFFIX_RECOVERY_RESULTS = (ResultsColumn(40, "last 10% of downstream (held-out)", _heldout("suffix", "fraction", 0.1)),
                           ResultsColumn(50, "top-1 position (held-out)", _heldout("topk", "count", 1)),
                           ResultsColumn(60, "k-matched random position (held-out)", _heldout("random", "count", 1)),
                           ResultsColumn(65, "downstream suffix for 80% recovery", _fraction_for("0.8")))


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(results=SUFFIX_RECOVERY_RESULTS, headline="references/field/all",
    figures=(
    Curves("k-curves", "curves/?heldout,all/*/#/@", "recovery against the set size k per set family "
           "({alt} pairs; mean, 95% interval)", "k", "recovery", x="grid", xlog=("count",),
           ref="references/downstream/@", ref_name="all downstream", dashed=("field+",)),
    Bars("family-references", "references/*/@", "reference patches per family (mean recovery, 95% interval)",
         "recovery"),
    Bars("family-bands", "bands/@/*", "recovery per layer band, all downstream positions (per family; "
         "mean, 95% interval)", "recovery", labels="layer_bands"),
    Curves("offset-profile", "single/by_offset/decision/*", "single-position recovery by offset from the "
           "decision position (mean over flipping pairs)", "offset d - p", "recovery", xy=("offset", "mean"),
           xreverse=True)))


#: The zoo conformance lane's settings for it (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.random.n_draws=1", "probe.grid.fractions=[0.5,1.0]", "probe.grid.counts=[1,4]",
                                  "probe.layer_bands=2"))
