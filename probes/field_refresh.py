"""``field_refresh``: how much of a field change the field's own KV carries (docs/design.md §3, §5).

Specification: ``docs/probes/field_refresh.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig, families_of, summaries_by_family
from kvnotes.harness.protocol import Check, GeneratedReadout, Measure, patch_columns, readout_aggregates, run_patches
from kvnotes.harness.screened import ScreenedPair
from kvnotes.harness.readout import PairRun, variant_scores
from kvnotes.harness.registry import RECOVERY_TOL, Conformance, Invariants, flipping_rows
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.kv.patch import exact_field_source
from kvnotes.records.figures import FLIPPED, Bars
from kvnotes.records.presentation import Presentation, ResultsColumn
from kvnotes.records.schema import BaseResult, PairRow, Summary, TypedDict
from kvnotes.records.tables import ci

#: Position sets patched (all layers) from the new run into the old run, in scoring order.
VARIANTS = ("none", "field", "downstream", "field_downstream", "all")
#: With ``scenario.variant=cot`` the variants' reasoning is generated and the decision read after it.
SUPPORTS_COT = True
#: The exact field refresh's name (a Measure of the direct readout; its finding and its checks).
EXACT = "field_exact"
#: Variants whose recovery is fixed by construction (reported as checks, not findings).
CHECK_VARIANTS = ("none", "field_downstream", "all")


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/field_refresh.yaml``
    (the defaults are here; the YAML sets what differs; see the specification); with
    ``scenario.variant=cot`` the generated readout's keys (:class:`kvnotes.harness.protocol.GeneratedReadout`)."""

    exact: bool = True
    #: keep every pair's prefix caches from the clean runs (faster, more memory)
    keep_caches: bool = False


def variant_positions(field: tuple[int, int], decision: int) -> dict[str, list[int]]:
    """Positions of each variant in :data:`VARIANTS` for field ``[a, b)`` and decision ``d``.

    Returns:
        name -> sorted positions in ``[0, d)``.
    """
    a, b = field
    d = decision
    return {"none": [], "field": list(range(a, b)), "downstream": list(range(b, d)),
            "field_downstream": list(range(a, d)), "all": list(range(d))}


@torch.no_grad()
def exact_refresh(model, run: PairRun, s_field: float, mode: str = "first_token",
                  budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """The exact field refresh of one pair (:func:`kvnotes.kv.patch.exact_field_source`) scored like the copied one.

    Args:
        run: the pair's clean run with its prefix caches over ``[0, d)``.
        s_field: the copied field refresh's score (nats), to compare with.

    Returns:
        ``r_field_exact``, ``s_field_exact``, ``flipped_field_exact``, ``k_max_abs_diff``,
        ``v_max_abs_diff``, ``score_abs_diff_exact`` (nats) and ``exact_method``.

    Raises:
        RuntimeError: from :func:`kvnotes.kv.patch.exact_field_source`.
    """
    pair = run.pair
    source, diffs = exact_field_source(model, run)
    field = variant_positions(pair.field, pair.decision)["field"]
    s_ex = variant_scores(model, pair, run.old_cache, source,
                          kvpatch.position_masks(len(run.old_cache.layers), pair.decision, [field]), mode, budget_bytes)
    return diffs | {"r_field_exact": float(run.recovery(s_ex)[0]), "s_field_exact": float(s_ex[0]),
                    "flipped_field_exact": bool(run.decision_flipped(s_ex)[0]),
                    "score_abs_diff_exact": abs(float(s_ex[0]) - s_field)}


def refresh_pair(model, run: PairRun, mode: str = "first_token",
                 budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES, exact: bool = True) -> dict:
    """Recovery of every variant in :data:`VARIANTS` for one pair
    (:func:`kvnotes.harness.protocol.patch_columns`), plus the exact field refresh
    (:func:`exact_refresh`) with ``exact``: the direct readout's columns of a flipping pair.

    Raises:
        RuntimeError: from :func:`kvnotes.kv.patch.exact_field_source`.
        ValueError: ``mode`` is not a readout mode.
    """
    out = patch_columns(ScreenedPair(run, model, mode, budget_bytes), variant_positions(run.pair.field, run.pair.decision))
    return out | (exact_refresh(model, run, out["s_field"], mode, budget_bytes) if exact else {})


class RefreshRow(PairRow):
    """A flipping pair: ``r_<variant>`` (recovery), ``s_<variant>``, ``flipped_<variant>``."""

    r_none: float | None
    r_field: float | None
    r_downstream: float | None
    r_field_downstream: float | None
    r_all: float | None
    flipped_field: bool | None


class RefreshAggregates(TypedDict):
    n_pairs: int
    n_flip: int
    families: list[str]
    recovery: dict[str, dict[str, Summary]]
    checks: dict[str, Any]
    exclusions_by_family: dict[str, dict[str, int]]


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[RefreshRow]
    aggregates: RefreshAggregates
    variants: list[str]


def _exact_checks(rows: list[dict]) -> dict:
    """The exact field refresh's checks: its K/V against the new run's, its score and recovery
    against the copied field K/V's, and how each pair's was computed."""
    return {"k_max_abs_diff": max((r["k_max_abs_diff"] for r in rows), default=None),
            "v_max_abs_diff": max((r["v_max_abs_diff"] for r in rows), default=None),
            "score_abs_diff_exact": max((r["score_abs_diff_exact"] for r in rows), default=None),
            "max_abs_r_field_exact_minus_copy": max((abs(r["r_field_exact"] - r["r_field"]) for r in rows),
                                                    default=None),
            "exact_methods": dict(Counter(r["exact_method"] for r in rows))}


#: Checks of the patch variants fixed by construction (:data:`CHECK_VARIANTS`): ``[a, d)`` patched
#: equals all of ``[0, d)`` only when the decision is read at ``d`` directly.
CHECKS = (Check("max_abs_none", lambda rows: K.worst(rows, "r_none")),
          Check("max_abs_all_minus_1", lambda rows: K.worst(rows, "r_all", 1.0)),
          Check("max_abs_field_downstream_minus_1", lambda rows: K.worst(rows, "r_field_downstream", 1.0),
                readouts=("direct",)))


def run(ctx) -> dict:
    """Field-only vs field+downstream refresh of every flipping pair under the run's readout
    (:func:`kvnotes.harness.protocol.run_patches`); see the specification.

    Under the direct readout each flipping pair is refreshed right after its clean run (its prefix
    caches are used once and dropped), so every pair is prefilled once per job, and the exact field
    refresh (a :class:`kvnotes.harness.protocol.Measure` of the direct readout) is checked; under the
    generated readout variants whose chain does not reach the marker are left out of that variant's
    summary and counted (``n_unreached``)."""
    cfg = ctx.cfg

    def exact_columns(sp, row):
        return exact_refresh(ctx.bundle.model, sp.run, row["s_field"], ctx.readout, ctx.budget_bytes)

    pr = run_patches(ctx, lambda pair: variant_positions(pair.field, pair.decision), "field_refresh",
                     keep_caches=cfg.keep_caches, names=VARIANTS,
                     extra=Measure(EXACT, exact_columns, readouts=("direct",)) if cfg.exact else None)
    rows = pr.rows
    families = families_of(ctx, rows + pr.excluded)
    with ctx.timer("statistics"):
        recovery = {v: summaries_by_family(rows, f"r_{v}", f"flipped_{v}", families, cfg.n_boot, ctx.seed)
                    for v in VARIANTS + tuple(pr.measured)}
    checks = pr.checks(CHECKS) | (_exact_checks(rows) if EXACT in pr.measured else {})
    aggregates = K.pair_counts(ctx, rows, pr.excluded, families) | {
        "findings": ["field", "downstream"] + pr.measured,
        "checks_by_construction": list(CHECK_VARIANTS), "recovery": recovery, "checks": checks}
    return {"rows": rows, "exclusions": dict(pr.exclusions), "excluded": pr.excluded, "variants": list(VARIANTS),
            "aggregates": aggregates | readout_aggregates(ctx, pr)}


# ---------------------------------------------------------------------------------------------
# presentation


def _recovery(finding: str):
    return lambda rec, fam: ci(rec["result"]["aggregates"]["recovery"].get(finding, {}).get(fam))


#: The columns this probe's records add to the per-family results table (kvnotes table --results).
FIELD_REFRESH_RESULTS = (ResultsColumn(20, "field-only refresh", _recovery("field")),
                         ResultsColumn(30, "downstream only", _recovery("downstream")))


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(results=FIELD_REFRESH_RESULTS, headline="recovery/field/all",
    figures=(
    Bars("family-recovery", "recovery/[field,field_exact,downstream,field_downstream]/@",
         "mean recovery per family and patch (95% interval)", "recovery"),
    Bars("family-flipped", "recovery/[field,field_exact,downstream,field_downstream]/@/decision_flipped",
         FLIPPED, "share of pairs")))


#: fp32 K/V of two computations of the same thing (the exact refresh and the new run's field).
KV_TOL = 1e-4


def invariants(rec: dict) -> Invariants:
    """What a record holds on any model: patching field and downstream (or everything) recovers 1,
    the exact refresh recovers what the copied field K/V does, and its K/V equals the new run's."""
    rows = flipping_rows(rec)
    bad = [f"{r['pair']}: r_field_downstream {r['r_field_downstream']}, r_all {r['r_all']}, r_field_exact "
           f"{r['r_field_exact']} vs r_field {r['r_field']}, K/V diff {max(r['k_max_abs_diff'], r['v_max_abs_diff'])}"
           for r in rows if not (abs(r["r_field_downstream"] - 1) <= RECOVERY_TOL and abs(r["r_all"] - 1) <= RECOVERY_TOL
                                 and abs(r["r_field_exact"] - r["r_field"]) <= RECOVERY_TOL
                                 and max(r["k_max_abs_diff"], r["v_max_abs_diff"]) < KV_TOL)]
    return Invariants("field+downstream=1", len(rows), bad)


#: The zoo conformance lane runs it on every entry, multimodal ones too (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(mrope=(), invariants=invariants)
