"""``field_refresh``: how much of a field change the field's own KV carries (docs/design.md §3, §5).

For every flipping pair (flip rule of docs/design.md §3; the rest are counted by reason) the old run's
prefix cache ``[0, d)`` is patched from the new run's, all layers, at these position sets:

- ``none`` (nothing; recovery 0 by definition) and ``all`` (``[0, d)``; recovery 1) — checks;
- ``field``: the field span ``[a, b)`` only — the finding: recovery of refreshing only the field;
- ``downstream``: ``[b, d)`` only;
- ``field_downstream``: ``[a, d)``. The prefix ``[0, a)`` is identical in both runs (causal
  attention over identical tokens), so this equals ``all``: recovery 1 **by construction**. It is
  reported as a check (``checks.max_abs_field_downstream_minus_1``), not as a finding.

Recovery ``r = (s_patched - s_old) / (s_new - s_old)`` (docs/design.md §3), unclipped.

**Exact refresh.** Copying the new run's field KV into the old cache is exact because the field
only attends to ``[0, a)``, identical in both runs. The probe verifies that instead of assuming
it: the new field tokens are run at positions ``a .. b-1`` on a view of the old cache truncated to
``[0, a)`` (:func:`kvnotes.kv.cache.prefix_view`; for a sliding-window layer whose window already dropped part
of ``[0, a)`` the prefix is prefilled instead, recorded as ``exact_method``), and the recomputed
field KV (:func:`recompute_span`) is compared to the copied one (``k_max_abs_diff``,
``v_max_abs_diff``: max over layers, KV heads, field positions and head dims) and patched into the
old cache in its place (``r_field_exact``; ``score_abs_diff_exact`` is ``|s_exact - s_field|`` in
nats).

All variants of a pair are scored in one batched call of
:func:`kvnotes.harness.readout.variant_scores` (variant caches chunked to ``ctx.budget_bytes``).
Aggregates per family (and ``all``) come from :func:`kvnotes.harness.kit.summaries_by_family`: mean,
median, cluster-bootstrap CIs (scenarios, then instances) and the share of pairs whose decision the
patch flipped (Wilson CI).
"""

from __future__ import annotations

from typing import Any, Optional

from kvnotes.records.schema import TypedDict

from dataclasses import dataclass

from collections import Counter
from functools import partial

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvnotes.records.schema import BaseResult, PairRow, Summary
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.kit import ProbeConfig
from kvnotes.kv import cache as kvcache
from kvnotes.harness import kit as K
from kvnotes.harness.kit import exclusions_by_family, families_of, flipping_pairs, summaries_by_family
from kvnotes.kv.generate import answer_marker, generate, owned_side, stop_tokens, unreached_label
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.selection import round_robin
from kvnotes.harness.readout import PairRun, first_token_scores, variant_scores

#: Position sets patched (all layers) from the new run into the old run, in scoring order.
VARIANTS = ("none", "field", "downstream", "field_downstream", "all")
#: With ``scenario.variant=cot`` the variants' reasoning is generated and the decision read after it.
SUPPORTS_COT = True
#: Variants whose recovery is fixed by construction (reported as checks, not findings).
CHECK_VARIANTS = ("none", "field_downstream", "all")


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/field_refresh.yaml`` (defaults there; see the module docstring)."""

    exact: bool = True
    keep_caches: bool = False
    #: ``scenario.variant=cot``: most tokens generated per chain, and how many aligned pairs to screen
    cot_max_new_tokens: NonNegative = 40
    cot_max_pairs: Optional[Count] = 12


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
def refresh_pair(model, run: PairRun, mode: str = "first_token",
                 budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES, exact: bool = True) -> dict:
    """Recovery of every variant in :data:`VARIANTS` for one pair, plus the exact field refresh.

    Args:
        run: the pair's clean run with its prefix caches over ``[0, d)``.
        mode: readout mode (``first_token`` or ``full``, docs/design.md §3).
        budget_bytes: memory budget for one chunk of variant caches.
        exact: also recompute the field against the old prefix (:func:`exact_field_source`).

    Returns:
        ``r_<variant>`` (recovery), ``s_<variant>`` (score, nats) and ``flipped_<variant>`` (the
        patched run takes the new run's decision) for each variant; with ``exact``, also
        ``r_field_exact``, ``s_field_exact``, ``flipped_field_exact``, ``k_max_abs_diff``,
        ``v_max_abs_diff``, ``score_abs_diff_exact`` (nats) and ``exact_method``.

    Raises:
        RuntimeError: from :func:`exact_field_source`.
        ValueError: ``mode`` is not a readout mode.
    """
    pair = run.pair
    d = pair.decision
    n_layers = len(run.old_cache.layers)
    sets = variant_positions(pair.field, d)
    masks = kvcache.position_masks(n_layers, d, [sets[v] for v in VARIANTS])
    s = variant_scores(model, pair, run.old_cache, run.new_cache, masks, mode, budget_bytes)
    r, f = run.recovery(s), run.decision_flipped(s)
    out: dict = {}
    for i, v in enumerate(VARIANTS):
        out |= {f"r_{v}": float(r[i]), f"s_{v}": float(s[i]), f"flipped_{v}": bool(f[i])}
    if exact:
        source, diffs = exact_field_source(model, run)
        s_ex = variant_scores(model, pair, run.old_cache, source,
                              kvcache.position_masks(n_layers, d, [sets["field"]]), mode, budget_bytes)
        out |= diffs | {"r_field_exact": float(run.recovery(s_ex)[0]), "s_field_exact": float(s_ex[0]),
                        "flipped_field_exact": bool(run.decision_flipped(s_ex)[0]),
                        "score_abs_diff_exact": abs(float(s_ex[0]) - out["s_field"])}
    return out


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


def cot_pair(ctx, pair, max_new: int) -> tuple[dict, str | None]:
    """One pair under chain of thought: every variant's patched cache (:func:`kvnotes.kv.cache.build_variants`,
    ``none`` = the clean old run, ``all`` = the clean new run) decodes its reasoning in one batch
    (:func:`kvnotes.kv.generate.generate`) and the decision is read after the answer marker.

    Returns:
        (the row: ``s_<v>`` scores after the marker (None: marker not reached), ``r_<v>`` recovery
        against the clean chains, ``flipped_<v>`` (the chain names the new candidate), ``reached_<v>``,
        ``chain_len_<v>``; the exclusion reason or None for a generated flip).
    """
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    sc = pair.spec.instance.scenario
    d = pair.decision
    n_layers = ctx.bundle.adapter.n_layers
    sets = variant_positions(pair.field, d)
    with ctx.timer("prefill"):
        old_c, new_c = kvcache.prefill(model, pair.old.ids[:d]), kvcache.prefill(model, pair.new.ids[:d])
    masks = kvcache.position_masks(n_layers, d, [sets[v] for v in VARIANTS])
    with ctx.timer("generate"):
        gen = generate(model, kvcache.build_variants(model.config, old_c, new_c, masks), int(pair.old.ids[d]), d,
                       max_new, answer_marker(tok, sc.variants[pair.spec.variant].answer_marker, ctx.thinking),
                       stop_tokens(tok))
    row = pair_row(pair)
    side = {}
    for i, v in enumerate(VARIANTS):
        chain, lp = gen.chains[i], gen.logprobs[i]
        side[v] = owned_side(lp, pair) if chain.reached else None
        row[f"s_{v}"] = float(first_token_scores(lp[None], pair)[0]) if chain.reached else None
        row[f"reached_{v}"], row[f"chain_len_{v}"] = chain.reached, chain.length
        row[f"flipped_{v}"] = side[v] == "new" if chain.reached else None
    row["old_text"] = tok.decode(gen.chains[0].ids, skip_special_tokens=True)
    row["new_text"] = tok.decode(gen.chains[-1].ids, skip_special_tokens=True)
    if not row["reached_none"] or not row["reached_all"]:
        side_, chain = ("old", gen.chains[0]) if not row["reached_none"] else ("new", gen.chains[-1])
        return row, unreached_label(tok, side_, chain, ctx.thinking)
    if side["none"] != "old" or side["all"] != "new":
        return row, "no_cot_flip"
    s_old, s_new = row["s_none"], row["s_all"]
    row |= {"s_old": s_old, "s_new": s_new, "effect": s_new - s_old, "flips": True, "reason": None}
    for v in VARIANTS:
        row[f"r_{v}"] = None if row[f"s_{v}"] is None else (row[f"s_{v}"] - s_old) / (s_new - s_old)
    return row, None


def run_cot(ctx) -> dict:
    """:func:`run` under ``scenario.variant=cot``: pairs screened by generation (the clean old chain
    decides the old candidate and the new chain the new one, both after the marker), then the
    variants' recovery from their chains. Variants whose chain does not reach the marker are left
    out of that variant's summary and counted (``n_unreached``)."""
    cfg = ctx.cfg
    n_boot = int(cfg.n_boot)
    limit = cfg.cot_max_pairs
    order = round_robin([pair_row(p) for p in ctx.pairs.pairs])      # a cap keeps every scenario
    pairs = [ctx.pairs.pairs[i] for i in (order if limit is None else order[: int(limit)])]
    rows, excluded = [], list(ctx.pairs.excluded)
    for pair in tqdm(pairs, desc="field_refresh cot", disable=not cfg.progress):
        row, reason = cot_pair(ctx, pair, int(cfg.cot_max_new_tokens))
        if reason:
            excluded.append(row | {"reason": reason})
        else:
            rows.append(row)
    families = families_of(ctx, rows + excluded)
    with ctx.timer("statistics"):
        recovery = {v: summaries_by_family(rows, f"r_{v}", f"flipped_{v}", families, n_boot, ctx.seed)
                    for v in VARIANTS}
    exclusions = K.exclusion_counts(excluded)
    if len(pairs) < len(ctx.pairs.pairs):                  # counted, no rows: never screened
        exclusions["beyond_max_pairs"] = len(ctx.pairs.pairs) - len(pairs)
    aggregates = {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows),
                  "families": families, "readout": "generated", "findings": ["field", "downstream"],
                  "checks_by_construction": list(CHECK_VARIANTS), "recovery": recovery,
                  "n_unreached": {v: sum(not r[f"reached_{v}"] for r in rows) for v in VARIANTS},
                  "checks": {"max_abs_none": K.worst(rows, "r_none"), "max_abs_all_minus_1": K.worst(rows, "r_all", 1.0)},
                  "exclusions_by_family": exclusions_by_family(excluded, families)}
    return {"rows": rows, "exclusions": dict(exclusions), "excluded": excluded, "variants": list(VARIANTS),
            "aggregates": aggregates}


def run(ctx) -> dict:
    """Field-only vs field+downstream refresh of every flipping pair; see the module docstring.

    Each flipping pair is refreshed right after its clean run (its prefix caches are used once and
    dropped), so every pair is prefilled once per job."""
    if K.is_cot(ctx):
        return run_cot(ctx)
    cfg = ctx.cfg
    model = ctx.bundle.model
    n_boot = int(cfg.n_boot)
    exact = bool(cfg.exact)

    def refresh(run_, row):
        with ctx.timer("variants"):
            return refresh_pair(model, run_, ctx.readout, ctx.budget_bytes, exact)

    fs = flipping_pairs(ctx, desc="field_refresh", keep_caches=bool(cfg.keep_caches), process=refresh)
    rows = fs.rows
    families = families_of(ctx, rows + fs.excluded)
    with ctx.timer("statistics"):
        recovery = {v: summaries_by_family(rows, f"r_{v}", f"flipped_{v}", families, n_boot, ctx.seed)
                    for v in VARIANTS + (("field_exact",) if exact else ())}
    worst = partial(K.worst, rows)
    checks = {"max_abs_none": worst("r_none"), "max_abs_field_downstream_minus_1": worst("r_field_downstream", 1.0),
              "max_abs_all_minus_1": worst("r_all", 1.0)}
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
                  "exclusions_by_family": exclusions_by_family(fs.excluded, families)}
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "variants": list(VARIANTS),
            "aggregates": aggregates}
