"""``field_refresh``: how much of a field change the field's own KV carries (docs/design.md §3, §5).

Specification: ``docs/probes/field_refresh.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig, exclusions_by_family, families_of, summaries_by_family
from kvnotes.harness.protocol import GeneratedReadout, ScreenedPair, patch_columns, readout_aggregates, run_patches
from kvnotes.harness.readout import PairRun, variant_scores
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.records.figures import FLIPPED, Bars
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, PairRow, Summary, TypedDict
from kvnotes.records.tables import FIELD_REFRESH_RESULTS

#: Position sets patched (all layers) from the new run into the old run, in scoring order.
VARIANTS = ("none", "field", "downstream", "field_downstream", "all")
#: With ``scenario.variant=cot`` the variants' reasoning is generated and the decision read after it.
SUPPORTS_COT = True
#: Variants whose recovery is fixed by construction (reported as checks, not findings).
CHECK_VARIANTS = ("none", "field_downstream", "all")


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/field_refresh.yaml`` (defaults there; see the specification); with
    ``scenario.variant=cot`` the generated readout's keys (:class:`kvnotes.harness.protocol.GeneratedReadout`)."""

    exact: bool = True
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
def recompute_span(model, prefix: DynamicCache, ids: torch.Tensor, start: int) -> DynamicCache:
    """Run ``ids`` at positions ``start .. start + n - 1`` on top of ``prefix`` (extended in place).

    This is the write-side resume of docs/design.md §4: the prefill continues from ``start`` on a cache
    of ``[0, start)`` instead of re-running the prefix. Explicit ``position_ids`` and a full-length
    attention mask, as every forward on an edited cache.

    Args:
        prefix: batch-1 cache over ``[0, start)`` (pass a view if it must be reused).
        ids: ``[n]`` token ids.

    Returns:
        ``prefix``, now over ``[0, start + n)``.
    """
    ids = ids.view(1, -1).to(model.device)
    n = ids.shape[1]
    pos = torch.arange(start, start + n, device=model.device).unsqueeze(0)
    mask = torch.ones(1, start + n, dtype=torch.long, device=model.device)
    model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=prefix, use_cache=True,
          logits_to_keep=1)
    return prefix


def _span_slots(layer, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot indices, positions) of a layer's slots whose positions lie in ``[a, b)``."""
    pos = kvcache.slot_positions(layer)
    idx = ((pos >= a) & (pos < b)).nonzero().flatten()
    return idx, pos[idx]


@torch.no_grad()
def exact_field_source(model, run: PairRun) -> tuple[DynamicCache, dict]:
    """The old prefix cache with the field's KV recomputed from the new field tokens.

    The new field tokens ``new.ids[a:b]`` are run at positions ``a .. b-1`` on the old cache
    truncated to ``[0, a)`` (:func:`kvnotes.kv.cache.prefix_view`, else a prefill of ``old.ids[:a]``); the
    resulting K/V of the field positions replace the old ones in a copy of the old cache.

    Returns:
        (the batch-1 source cache over ``[0, d)``, ``{k_max_abs_diff, v_max_abs_diff, method}``):
        the largest absolute difference between recomputed and copied (new-run) field keys and
        values over layers, KV heads, field positions and head dims; ``method`` is
        ``"truncated_view"`` or ``"prefix_prefill"``.

    Raises:
        RuntimeError: a field position held by the old cache is missing from the recomputation
            (cannot happen for caches built by :func:`kvnotes.kv.cache.prefill`).
    """
    pair = run.pair
    a, b = pair.field
    config = model.config
    prefix = kvcache.prefix_view(run.old_cache, config, a)
    method = "truncated_view"
    if prefix is None:
        prefix = kvcache.prefill(model, pair.old.ids[:a])
        method = "prefix_prefill"
    rec = recompute_span(model, prefix, pair.new.ids[a:b], a)
    keys, values = [], []
    k_diff = v_diff = 0.0
    for lo, ln, lr in zip(run.old_cache.layers, run.new_cache.layers, rec.layers, strict=True):
        k, v = lo.keys.clone(), lo.values.clone()
        idx_o, pos_o = _span_slots(lo, a, b)
        idx_r, pos_r = _span_slots(lr, a, b)
        idx_n, pos_n = _span_slots(ln, a, b)
        if not torch.equal(pos_o, pos_r[torch.isin(pos_r, pos_o)]) or not torch.isin(pos_o, pos_r).all():
            raise RuntimeError(f"field positions {pos_o.tolist()} not all recomputed ({pos_r.tolist()})")
        take = idx_r[torch.isin(pos_r, pos_o)]
        k[:, :, idx_o] = lr.keys[:, :, take]
        v[:, :, idx_o] = lr.values[:, :, take]
        both = torch.isin(pos_r, pos_n)
        match_n = idx_n[torch.isin(pos_n, pos_r)]
        if len(match_n):
            dk = lr.keys[:, :, idx_r[both]].float() - ln.keys[:, :, match_n].float()
            dv = lr.values[:, :, idx_r[both]].float() - ln.values[:, :, match_n].float()
            k_diff, v_diff = max(k_diff, float(dk.abs().max())), max(v_diff, float(dv.abs().max()))
        keys.append(k)
        values.append(v)
    source = kvcache.cache_from_tensors(config, keys, values, kvcache.seq_length(run.old_cache))
    return source, {"k_max_abs_diff": k_diff, "v_max_abs_diff": v_diff, "exact_method": method}


@torch.no_grad()
def exact_refresh(model, run: PairRun, s_field: float, mode: str = "first_token",
                  budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """The exact field refresh of one pair (:func:`exact_field_source`) scored like the copied one.

    Args:
        run: the pair's clean run with its prefix caches over ``[0, d)``.
        s_field: the copied field refresh's score (nats), to compare with.

    Returns:
        ``r_field_exact``, ``s_field_exact``, ``flipped_field_exact``, ``k_max_abs_diff``,
        ``v_max_abs_diff``, ``score_abs_diff_exact`` (nats) and ``exact_method``.

    Raises:
        RuntimeError: from :func:`exact_field_source`.
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
        RuntimeError: from :func:`exact_field_source`.
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


def run(ctx) -> dict:
    """Field-only vs field+downstream refresh of every flipping pair under the run's readout
    (:func:`kvnotes.harness.protocol.run_patches`); see the specification.

    Under the direct readout each flipping pair is refreshed right after its clean run (its prefix
    caches are used once and dropped), so every pair is prefilled once per job, and the exact field
    refresh is checked; under the generated readout variants whose chain does not reach the marker
    are left out of that variant's summary and counted (``n_unreached``)."""
    cfg = ctx.cfg
    n_boot = int(cfg.n_boot)
    generated = K.is_cot(ctx)
    exact = bool(cfg.exact) and not generated

    def exact_columns(sp, row):
        return exact_refresh(ctx.bundle.model, sp.run, row["s_field"], ctx.readout, ctx.budget_bytes)

    pr = run_patches(ctx, lambda pair: variant_positions(pair.field, pair.decision), "field_refresh",
                     keep_caches=bool(cfg.keep_caches), extra=exact_columns if exact else None)
    rows = pr.rows
    families = families_of(ctx, rows + pr.excluded)
    with ctx.timer("statistics"):
        recovery = {v: summaries_by_family(rows, f"r_{v}", f"flipped_{v}", families, n_boot, ctx.seed)
                    for v in VARIANTS + (("field_exact",) if exact else ())}
    worst = partial(K.worst, rows)
    checks = {"max_abs_none": worst("r_none"), "max_abs_all_minus_1": worst("r_all", 1.0)}
    if not generated:                     # [a, d) patched equals all of [0, d) only when read at d directly
        checks["max_abs_field_downstream_minus_1"] = worst("r_field_downstream", 1.0)
    if exact:
        checks |= {"k_max_abs_diff": max((r["k_max_abs_diff"] for r in rows), default=None),
                   "v_max_abs_diff": max((r["v_max_abs_diff"] for r in rows), default=None),
                   "score_abs_diff_exact": max((r["score_abs_diff_exact"] for r in rows), default=None),
                   "max_abs_r_field_exact_minus_copy": max((abs(r["r_field_exact"] - r["r_field"]) for r in rows),
                                                           default=None),
                   "exact_methods": dict(Counter(r["exact_method"] for r in rows))}
    aggregates = {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows),
                  "families": families, "findings": ["field", "downstream"] + (["field_exact"] if exact else []),
                  "checks_by_construction": list(CHECK_VARIANTS), "recovery": recovery, "checks": checks,
                  "exclusions_by_family": exclusions_by_family(pr.excluded, families)}
    if generated:
        aggregates |= readout_aggregates(ctx, pr) | {
            "n_unreached": {v: sum(not r[f"reached_{v}"] for r in rows) for v in VARIANTS}}
    return {"rows": rows, "exclusions": dict(pr.exclusions), "excluded": pr.excluded, "variants": list(VARIANTS),
            "aggregates": aggregates}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(results=FIELD_REFRESH_RESULTS, plot="kvnotes.plots.field_refresh:plot_field_refresh", headline="recovery/field/all",
    figures=(
    Bars("family-recovery", "recovery/[field,field_exact,downstream,field_downstream]/@",
         "mean recovery per family and patch (95% interval)", "recovery"),
    Bars("family-flipped", "recovery/[field,field_exact,downstream,field_downstream]/@/decision_flipped",
         FLIPPED, "share of pairs")))
