"""``dissociation``: the polarity 2x2 — field fixed, the rule's trigger word flipped (docs/design.md §5).

Specification: ``docs/probes/dissociation.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.readout import PairRun, variant_scores
from kvnotes.harness.registry import RECOVERY_TOL, Conformance, Invariants, flipping_rows
from kvnotes.harness.stats import proportion
from kvnotes.harness.tokens import PolarityPair
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.records.figures import Bars
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, PairRow
from kvnotes.scenarios.instances import PolaritySpec

VARIANTS = ("trigger", "notes", "both", "prefix")
REPORTED = ("trigger", "notes", "both")


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "its pairs flip a rule's trigger word; the construction has no rule that gates the decision"

@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/dissociation.yaml``
    (the defaults are here; the YAML sets what differs; see the specification)."""

    pairs: str = "polarity"


def variant_masks(n_layers: int, pair: PolarityPair) -> torch.Tensor:
    """Patch masks ``[len(VARIANTS), n_layers, d]`` in :data:`VARIANTS` order, every layer."""
    t0, t1 = pair.trigger
    d = pair.decision
    sets = {"trigger": range(t0, t1), "notes": range(t1, d), "both": range(t0, d), "prefix": range(0, t0)}
    return kvpatch.position_masks(n_layers, d, [list(sets[v]) for v in VARIANTS])


def orientation(pair: PolarityPair) -> float:
    """+1 or -1 such that ``orientation * score`` is ``log p(A) - log p(B)`` for the scenario's
    fixed outcome order (A = the normal-rule outcome of the first listed field value)."""
    sc = pair.spec.instance.scenario
    outcome_a = sc.outcome(next(iter(sc.values)), "normal")
    return -1.0 if sc.outcome(cast(PolaritySpec, pair.spec).value, "normal") == outcome_a else 1.0


def patch_scores(model, run: PairRun, mode: str = "first_token",
                 budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """The patched scores of one polarity pair's clean run (prefix caches over ``[0, d)``).

    Returns:
        per variant ``s_<v>`` (score), ``shift_<v>`` (``s_<v> - s_old``, nats), ``r_<v>``
        (recovery; None when ``s_new == s_old``), ``flipped_<v>`` (the patched run takes the
        inverted run's decision).
    """
    pair = run.pair
    s = variant_scores(model, pair, run.old_cache, run.new_cache, variant_masks(len(run.old_cache.layers), pair),
                       mode, budget_bytes)
    out = {}
    for i, v in enumerate(VARIANTS):
        sv = float(s[i])
        out |= {f"s_{v}": sv, f"shift_{v}": sv - run.s_old, f"r_{v}": run.recovery(sv) if run.effect else None,
                f"flipped_{v}": bool(run.decision_flipped(sv))}
    return out


def _two_by_two(rows: list[dict], n_boot: int, seed: int) -> dict:
    """Clean 2x2 of ``log p(A) - log p(B)``: cells (field value implies A / B under the normal
    rule) x (normal / inverted rule), and per instance the interaction
    ``[s(A-value, normal) - s(B-value, normal)] - [s(A-value, inverted) - s(B-value, inverted)]``
    (positive when the model follows the field *through* the trigger)."""
    cells = {}
    for val in ("A", "B"):
        rs = [r for r in rows if r["value_outcome"] == val]
        for pol, key in (("normal", "s_fixed_normal"), ("inverted", "s_fixed_inverted")):
            cells[f"{val}_{pol}"] = K.summary(rs, key, n_boot, seed)
    by_inst: dict[str, dict] = {}
    for r in rows:
        by_inst.setdefault(r["instance"], {"scenario": r["scenario"], "instance": r["instance"]})[r["value_outcome"]] = r
    inter = [(i["A"]["s_fixed_normal"] - i["B"]["s_fixed_normal"]) - (i["A"]["s_fixed_inverted"] - i["B"]["s_fixed_inverted"])
             for i in by_inst.values() if "A" in i and "B" in i]
    complete = [i for i in by_inst.values() if "A" in i and "B" in i]
    return {"cells": cells, "interaction": K.summary([i | {"_v": v} for i, v in zip(complete, inter)], "_v", n_boot, seed)}


def _aggregate(rows: list[dict], excluded: list[dict], n_boot: int, seed: int) -> tuple[dict, dict]:
    out, notes = {}, {}
    fams = sorted({r["family"] for r in rows} | {r["family"] for r in excluded})
    for fam in ["all"] + fams:
        rs = rows if fam == "all" else [r for r in rows if r["family"] == fam]
        ex = excluded if fam == "all" else [r for r in excluded if r["family"] == fam]
        flips = [r for r in rs if r["flips"]]
        entry = {
            "n_pairs": len(rs), "n_flip": len(flips), "n_scenarios": len({r["scenario"] for r in rs}),
            "flip_rate": proportion(len(flips), len(rs)),
            "not_flipping": dict(Counter(r["reason"] for r in rs if not r["flips"])),
            "excluded": dict(Counter(r["reason"] for r in ex)),
            "effect_all": K.summary(rs, "effect", n_boot, seed),
            "abs_effect_all": K.summary(rs, lambda r: abs(r["effect"]), n_boot, seed),
            "shift_all": {v: K.summary(rs, f"shift_{v}", n_boot, seed) for v in VARIANTS},
            "abs_shift_all": {v: K.summary(rs, lambda r, v=v: abs(r[f"shift_{v}"]), n_boot, seed) for v in VARIANTS},
            "recovery": {v: K.recovery_summary(flips, f"r_{v}", f"flipped_{v}", n_boot, seed) for v in REPORTED},
            "two_by_two": _two_by_two(rs, n_boot, seed),
        }
        out[fam] = entry
        if fam != "all" and not flips:
            notes[fam] = (f"no polarity pair flips ({len(rs)} aligned pairs: {entry['not_flipping'] or 'none'}; "
                          f"excluded at tokenisation: {entry['excluded'] or 'none'}): trigger-only vs notes recovery "
                          f"is undefined for this family and not reported")
    return out, notes


class PolarityRow(PairRow):
    """A polarity pair: per variant ``s_<v>``, ``shift_<v>``, ``r_<v>``, ``flipped_<v>``; its clean 2x2 cell."""

    value_outcome: str
    trigger: list[int]
    shift_trigger: float
    shift_notes: float
    r_both: float | None
    s_fixed_normal: float
    s_fixed_inverted: float


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[PolarityRow]
    notes: dict[str, str]
    skipped_scenarios: dict[str, int]
    skipped: list[dict[str, Any]]
    variants: list[str]


def run(ctx) -> dict:
    """Patch trigger / notes / both of every polarity pair (``pairs: polarity`` in the probe config:
    ``run.py`` prepares them, :func:`kvnotes.harness.pairs.prepare_polarity_pairs`); see the specification.

    Returns:
        ``rows`` (every aligned polarity pair: spans, clean status, per-variant scores, shifts,
        recoveries), ``aggregates`` (per family and ``all``), ``notes`` (families without flips),
        ``exclusions`` (pair reason -> count: tokenisation and non-flipping), ``excluded``,
        ``skipped_scenarios`` (reason -> count of scenarios) and ``skipped`` (their rows).
    """
    cfg = ctx.cfg
    model = ctx.bundle.model
    n_boot = cfg.n_boot
    rows = []
    for run_, row in K.each_pair(ctx, desc="dissociation"):
        pair = cast(PolarityPair, run_.pair)
        with ctx.timer("patching"):
            cols = patch_scores(model, run_, ctx.readout, ctx.budget_bytes)
        sgn = orientation(pair)
        sc = pair.spec.instance.scenario
        t0, t1 = pair.trigger
        rows.append(row | cols | {
            "value": cast(PolaritySpec, pair.spec).value, "value_outcome": "A" if sgn < 0 else "B",
            "trigger": [t0, t1], "value_field": list(pair.value_field),
            "trigger_normal": sc.polarity_values["normal"], "trigger_inverted": sc.polarity_values["inverted"],
            "s_fixed_normal": sgn * row["s_old"], "s_fixed_inverted": sgn * row["s_new"],
        })
    tok_excluded = ctx.pairs.excluded
    skipped = ctx.pairs.skipped
    excluded = K.excluded_rows(tok_excluded, rows)
    with ctx.timer("statistics"):
        aggregates, notes = _aggregate(rows, tok_excluded, n_boot, ctx.seed)
    aggregates["checks"] = {
        "max_both_recovery_err": max((abs(r["r_both"] - 1) for r in rows if r["r_both"] is not None), default=None),
        "max_both_score_err": max((abs(r["s_both"] - r["s_new"]) for r in rows), default=None),
        "max_prefix_shift": max((abs(r["shift_prefix"]) for r in rows), default=None),
    }
    return {"rows": rows, "aggregates": aggregates, "notes": notes,
            "exclusions": K.exclusion_counts(excluded), "excluded": excluded,
            "skipped_scenarios": dict(Counter(s["reason"] for s in skipped)), "skipped": skipped,
            "variants": list(VARIANTS)}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Bars("family-recovery", "@/recovery/*", "recovery towards the inverted rule per family and patch "
         "(flipping polarity pairs; mean, 95% interval)", "recovery"),
    Bars("family-shift", "@/abs_shift_all/*", "|score shift| per family and patch (all aligned pairs; mean, "
         "95% interval)", "nats"),
    Bars("family-two-by-two", "@/two_by_two/cells/*", "clean 2x2: log p(A) - log p(B) per field value outcome "
         "and rule polarity (mean, 95% interval)", "nats")))


def invariants(rec: dict) -> Invariants:
    """What a record holds on any model: trigger and notes patched together recover 1."""
    rows = flipping_rows(rec)
    return Invariants("trigger+notes=1", len(rows),
                      [f"{r['pair']}: r_both {r['r_both']}" for r in rows if abs(r["r_both"] - 1) > RECOVERY_TOL])


#: The zoo conformance lane runs it on the one polarity scenario of its suite (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("scenario.ids=[account_role]",), invariants=invariants)
