"""Probe ``edit``: edit the cached old prompt into the new one by every method of the edit-method
registry (:mod:`kvnotes.ops.methods`, operations of :mod:`kvnotes.ops.edit`) and measure quality
against cost (paper "Models Take Notes at Prefill", §editing; ``docs/editing.md``).

For each flipping pair (old -> new; :func:`kvnotes.harness.kit.flipping_pairs`) the old prompt is
prefilled into an all-slot cache (the *stale* cache, not counted as cost) and edited by every
registered method (:class:`PairEditor` renders the prompts they name); today:

- ``full`` (re-prefill of the new prompt, the reference), ``stale`` (no edit), ``refresh_field``;
- ``erratum`` / ``field_plus_erratum``: :data:`kvnotes.harness.edit_prompts.ERRATUM_TEMPLATE` with the new value
  inserted at ``placement``, forwarding only what follows the longest common token prefix;
- ``hoist``: the new value in the hoisted layout, reusing the old hoisted prompt's cache up to the
  field (that cache is what one would have stored with that layout; not counted);
- ``selective@K`` for each ranking in ``rankings`` and ``K`` in ``ks`` (capped at the downstream
  length): field refresh + true recompute of the top-K downstream positions;
- ``oracle_copy@K`` (ranking ``oracle_ranking``): an UPPER BOUND that copies K/V from the full
  re-prefill; never a cheap method;
- controls on the same pairs: ``wrong_erratum`` (restates the old value) and ``irrelevant_notice``
  (length-matched) must not move the decision from the stale one.

Per method and pair: score ``s = log p(cand_new) - log p(cand_old)`` at the decision position,
recovery ``(s - s_old) / (s_new - s_old)``, ``agree`` (its candidate decision equals full's: on
flipping pairs, deciding the new outcome), ``KL(full || method)`` (nats, whole vocabulary),
``top1`` (same vocabulary top-1 as full), ``tokens`` recomputed, ``frac`` = tokens / d, FLOPs and
wall time relative to full. Over-correction: the correct erratum applied to control pairs (old and
new clean runs take the same candidate decision) must keep that decision.

**K sweep selection.** The rankings are per-pair rules (no fitted parameters); the data-driven
choice is *which ranking* to use: it is chosen by mean agreement over K on the selection instances
(:func:`kvnotes.harness.selection.split_instances`) and its curve is reported on the held-out instances.

**Chain of thought** (``scenario.variant=cot``): each method's cache is decoded greedily
(``cot.max_new_tokens``) by the shared generated readout (:mod:`kvnotes.kv.generate`) until
the decoded text ends with the variant's ``answer_marker``; the decision is read right after it as
the direct readout reads it: the outcome whose candidate's first token is the top-1 (none when the
top-1 is neither: not owned), with the score ``s`` in nats. A chain that never reaches the marker
is not scored (``reached`` false). A pair counts when the full run reaches the marker and decides the new outcome
while the stale run decides the old one (a generated flip; pairs are screened by generation, not by
the first-token readout, which in CoT is the first reasoning token); the rest are excluded by
reason (``full_no_marker``, ``stale_no_marker``, ``no_cot_flip``).
"""

from __future__ import annotations

from kvnotes.records.presentation import Presentation
from kvnotes.records.figures import edit_frontier
from kvnotes.records.tables import edit_table

from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from pydantic import AfterValidator

from collections import Counter

import numpy as np
import torch
from tqdm import tqdm

from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit, methods
from kvnotes.ops.methods import EditSource, Prompted
from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import Count, NonNegative, OpenFraction, one_of
from kvnotes.harness.pairs import pair_row
from kvnotes.kv.generate import answer_marker, generate, owned_side, stop_tokens, unreached_reason
from kvnotes.harness.readout import first_token_score, first_token_scores
from kvnotes.harness.kit import ProbeConfig, exclusions_by_family, families_of, flipping_pairs, summaries_by_family
from kvnotes.records.schema import BaseResult
from kvnotes.harness.selection import pair_rng, round_robin, split_instances
from kvnotes.harness.stats import proportion
from kvnotes.harness import edit_prompts as sedits

#: With ``scenario.variant=cot`` this probe decodes the reasoning before reading the decision.
SUPPORTS_COT = True


@dataclass
class CotConfig:
    """``cot`` keys: greedy decoding of the reasoning (``scenario.variant=cot``)."""

    max_new_tokens: NonNegative = 40
    ks: list[NonNegative] = field(default_factory=lambda: [8, 32])
    max_pairs: Optional[Count] = 12


def _ranking(name: str) -> str:
    """A registered position ranking (:data:`RANKINGS`: :data:`kvnotes.ops.methods.RANKINGS`)."""
    if name not in RANKINGS:
        raise ValueError(f"must be one of {', '.join(map(repr, RANKINGS))}")
    return name


Ranking = Annotated[str, AfterValidator(_ranking)]


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/edit.yaml`` (defaults there; see the module docstring)."""

    rankings: list[Ranking] = field(default_factory=lambda: ["attention", "kv_deviation", "last", "random"])
    ks: list[NonNegative] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64])
    oracle_ranking: Optional[Ranking] = "attention"
    placement: Annotated[str, one_of(*sedits.PLACEMENTS)] = "before_request"
    erratum_template: Optional[str] = None
    selection_fraction: OpenFraction = 0.5
    max_pairs: Optional[Count] = 24
    sweep_max_pairs: Optional[NonNegative] = 8
    max_control_pairs: NonNegative = 8
    chat_template_kwargs: Any = None
    cot: CotConfig = field(default_factory=CotConfig)


class Result(BaseResult):
    """What ``run`` returns (record ``result``): ``rows`` of edited flipping pairs with each
    method's recovery and agreement (CoT: generated decisions), ``aggregates`` per method."""

    rows: list[dict[str, Any]]
    excluded: list[dict[str, Any]]

def _metrics(lp: torch.Tensor, lp_full: torch.Tensor, e: edit.Edited, full: edit.Edited, pair, s_old, s_new) -> dict:
    s = first_token_score(lp, pair)
    p_full = lp_full.exp()
    return {"s": s, "r": (s - s_old) / (s_new - s_old), "agree": (s > 0) == (first_token_score(lp_full, pair) > 0),
            "kl": float((p_full * (lp_full - lp)).sum()), "top1": int(lp.argmax()) == int(lp_full.argmax()),
            "tokens": e.tokens, "frac": e.tokens / full.tokens,
            "flops_frac": e.flops / full.flops if np.isfinite(e.flops) else None,
            "time_ratio": e.seconds / full.seconds if np.isfinite(e.seconds) else None}


class PairEditor(EditSource):
    """What every method of one pair reads (:class:`kvnotes.ops.methods.EditSource`), shared by the
    direct and CoT readouts: the stale cache, the full re-prefill and the field refresh (each
    computed once), and the prompts the methods name, rendered for this pair (:data:`PROMPTS`)."""

    def __init__(self, ctx, pair, kwargs: dict):
        self.ctx, self.pair = ctx, pair
        self.tok = ctx.bundle.tokenizer
        cfg = ctx.cfg
        self.placement = str(cfg.placement)
        self.template = str(cfg.erratum_template or sedits.ERRATUM_TEMPLATE)
        self.chat = ctx.scenario.chat_template
        self.kwargs = kwargs
        spec = pair.spec
        self.inst, self.variant = spec.instance, spec.variant
        same = sedits.edited_prompt(self.tok, self.inst, spec.old, pair.old, self.variant, chat_template=self.chat,
                                    template_kwargs=kwargs)
        if not torch.equal(same.prompt.ids, pair.old.ids):
            raise KvnotesError("edit: re-rendering the old prompt does not reproduce its tokens; set "
                               "probe.chat_template_kwargs to null (the model's template arguments)")
        self.d = pair.decision
        model = ctx.bundle.model
        super().__init__(model, AllSlotCache.prefill(model, pair.old.ids[: self.d]), pair.new.ids, pair.field, self.d,
                         int(pair.old.ids[self.d]))
        _ = self.full                                   # the reference, computed first

    def prompt_names(self) -> tuple[str, ...]:
        return tuple(PROMPTS)

    def prompt(self, name: str) -> Prompted:
        """The edited prompt ``name`` of this pair (:data:`PROMPTS`).

        Raises:
            KvnotesError: an unknown prompt.
        """
        if name not in PROMPTS:
            raise KvnotesError(f"edit: no {name!r} prompt (known: {', '.join(PROMPTS)})")
        return PROMPTS[name](self)

    def rng(self) -> np.random.Generator:
        """The pair's seeded generator (:func:`kvnotes.harness.selection.pair_rng`)."""
        return pair_rng(self.ctx.seed, self.pair.spec.id)

    def noticed(self, text: str) -> Prompted:
        """The old prompt with ``text`` inserted at the configured placement, aligned with the stale cache."""
        ep = sedits.edited_prompt(self.tok, self.inst, self.pair.spec.old, self.pair.old, self.variant,
                                  notice=text, placement=self.placement, chat_template=self.chat,
                                  template_kwargs=self.kwargs)
        return Prompted(self.stale, ep.prompt.ids, ep.reuse, ep.prompt.decision)

    def hoisted(self) -> Prompted:
        """The new value in the hoisted layout, aligned with the old value's hoisted prompt, whose cache
        (what one would have stored with that layout) is prefilled here, not counted."""
        spec = self.pair.spec
        old_h, new_h = sedits.hoisted_pair(self.tok, self.inst, spec.old, spec.new, self.variant, self.chat,
                                           self.kwargs)
        cached = AllSlotCache.prefill(self.model, old_h.ids[: old_h.decision])
        return Prompted(cached, new_h.prompt.ids, new_h.reuse, new_h.prompt.decision)

    def named(self) -> dict[str, tuple[edit.Edited, int]]:
        """``name -> (edited, decision token)`` for every method of the registry that is not ranked
        (:data:`EDIT_METHODS`), in record order."""
        return {name: methods.apply(methods.METHODS[name], self) for name in EDIT_METHODS}

    def erratum(self, value: str) -> str:
        """The erratum text stating ``value`` for this pair's instance."""
        return sedits.erratum_text(self.inst, value, self.template)

    def rankings(self, names) -> dict[str, tuple[list[int], dict]]:
        """``name -> (downstream positions in ranked order, cost)`` for registered rankings (:data:`RANKINGS`).

        Raises:
            KvnotesError: an unknown ranking name.
        """
        out = {}
        for name in names:
            if name not in RANKINGS:
                raise KvnotesError(f"edit: unknown ranking '{name}' (known: {', '.join(RANKINGS)})")
            out[name] = RANKINGS[name].rank(self)
        return out


#: The prompts the registry's prompt steps name, rendered for a pair: ``name -> fn(editor)``.
PROMPTS = {
    "erratum": lambda ed: ed.noticed(ed.erratum(ed.pair.spec.new)),
    "wrong_erratum": lambda ed: ed.noticed(ed.erratum(ed.pair.spec.old)),
    "irrelevant_notice": lambda ed: ed.noticed(sedits.length_matched_notice(
        ed.tok, sedits.notice_tokens(ed.tok, ed.erratum(ed.pair.spec.new)))),
    "hoist": lambda ed: ed.hoisted(),
}
#: The named edits every pair gets, in record order: the registry's methods that are not ranked.
EDIT_METHODS: tuple[str, ...] = tuple(n for n, m in methods.METHODS.items() if not m.ranked)
#: The rankings of ranked methods (``selective@K``): the registry's (:data:`kvnotes.ops.methods.RANKINGS`).
RANKINGS = methods.RANKINGS
#: Edit methods that are controls (they should not move the decision the way the edit does).
CONTROLS: list[str] = list(methods.controls())


def named_methods() -> tuple[str, ...]:
    """The registered edit methods that are not controls, in record order."""
    return tuple(n for n in EDIT_METHODS if n not in CONTROLS)


def sweep_methods(editor: PairEditor, rankings: list[str], ks: list[int], oracle_ranking: str | None):
    """Yield ``(method name, ranking, K, edited)`` for the ranked methods of the registry: each
    ranking of ``rankings`` for a method, ``oracle_ranking`` (None: skipped) for an upper bound."""
    n_down = editor.pair.downstream[1] - editor.pair.downstream[0]
    ranked = editor.rankings(sorted(set(rankings) | ({oracle_ranking} if oracle_ranking else set())))
    for m in methods.METHODS.values():
        if not m.ranked or (m.upper_bound and not oracle_ranking):
            continue
        for name in ([oracle_ranking] if m.upper_bound else rankings):
            for k in ks:
                if k <= n_down:
                    yield (m.variant(name, k), m.name if m.upper_bound else name, k,
                           methods.apply(m, editor, k, ranked[name])[0])


def readout(model, items: dict, budget_bytes: int) -> dict[str, torch.Tensor]:
    """Decision log-probs of ``{name: (edited, decision token)}``, batched per (position, token)."""
    groups: dict = {}
    for name, (e, tok) in items.items():
        groups.setdefault((e.pos, tok), []).append(name)
    out = {}
    for (pos, tok), names in groups.items():
        lps = edit.decision_logprobs_batch(model, [items[n][0].cache for n in names], tok, pos, budget_bytes)
        out |= dict(zip(names, lps))
    return out


def direct_pair(ctx, run, kwargs, rankings, ks, oracle_ranking, sweep: bool) -> dict:
    """Metrics of every method on one flipping pair (direct readout); the K sweep when ``sweep``."""
    model, pair = ctx.bundle.model, run.pair
    ed = PairEditor(ctx, pair, kwargs)
    named = ed.named()
    lps = readout(model, named, ctx.budget_bytes)
    lp_full = lps["full"]
    methods = {n: _metrics(lps[n], lp_full, e, ed.full, pair, run.s_old, run.s_new) for n, (e, _) in named.items()}
    stale_new = methods["stale"]["s"] > 0
    for name in CONTROLS:
        methods[name]["moved"] = (methods[name]["s"] > 0) != stale_new
    out = {"n_downstream": pair.downstream[1] - pair.downstream[0], "full_seconds": ed.full.seconds,
           "methods": methods, "sweep": {}}
    if sweep:
        variants = {name: (e, ranking, k) for name, ranking, k, e in sweep_methods(ed, rankings, ks, oracle_ranking)}
        lps = readout(model, {n: (v[0], ed.token) for n, v in variants.items()}, ctx.budget_bytes)
        out["sweep"] = {n: _metrics(lps[n], lp_full, e, ed.full, pair, run.s_old, run.s_new) | {"ranking": r, "k": k}
                        for n, (e, r, k) in variants.items()}
    return out


def control_pairs(ctx, fs, kwargs, limit: int) -> tuple[list[dict], dict]:
    """Over-correction: the correct erratum on pairs whose clean runs take the same candidate
    decision; ``overcorrected`` = the erratum's decision differs from full's."""
    by_id = {p.spec.id: p for p in ctx.pairs.pairs}
    rows, skipped = [], Counter()
    cands = [r for r in fs.excluded if r.get("s_old") is not None and (r["s_old"] > 0) == (r["s_new"] > 0)]
    for r in cands[:limit]:
        pair = by_id[r["pair"]]
        ed = PairEditor(ctx, pair, kwargs)
        lps = readout(ctx.bundle.model, {"full": (ed.full, ed.token),
                                         "erratum": methods.apply(methods.METHODS["erratum"], ed)},
                      ctx.budget_bytes)
        lp_full, lp = lps["full"], lps["erratum"]
        rows.append({k: r[k] for k in ("pair", "scenario", "family", "instance", "old", "new", "expect_flip")}
                    | {"s_full": first_token_score(lp_full, pair), "s_erratum": first_token_score(lp, pair),
                       "overcorrected": (first_token_score(lp, pair) > 0) != (first_token_score(lp_full, pair) > 0)})
    skipped["beyond_limit"] = max(0, len(cands) - limit)
    return rows, dict(skipped)


# ------------------------------------------------------------------------------------ aggregates

def _family_means(rows, get, families) -> dict:
    out = {}
    for g in ["all", *families]:
        vals = [v for r in rows if g in ("all", r["family"]) and (v := get(r)) is not None]
        out[g] = {"n": len(vals), "mean": float(np.mean(vals)) if vals else None,
                  "median": float(np.median(vals)) if vals else None}
    return out


def method_summary(rows, key: str, families, n_boot, seed, section: str = "methods") -> dict:
    """Agreement (Wilson), recovery (cluster bootstrap), KL, top-1, cost of one method."""
    have = [r for r in rows if key in r[section]]
    m = lambda r: r[section][key]                                                # noqa: E731
    out = {"recovery": summaries_by_family(have, lambda r: m(r)["r"], lambda r: m(r)["agree"], families, n_boot, seed)}
    for name in ("kl", "frac", "flops_frac", "time_ratio"):
        out[name] = _family_means(have, lambda r, n=name: m(r)[n], families)
    out["top1"] = {g: proportion(sum(m(r)["top1"] for r in have if g in ("all", r["family"])),
                                 sum(1 for r in have if g in ("all", r["family"]))) for g in ["all", *families]}
    return out


def choose_ranking(rows, rankings, ks, seed, fraction) -> dict:
    """Pick the ranking with the highest mean agreement over K on selection instances; report every
    ranking's agreement curve on the held-out instances (the chosen one is the claim)."""
    sel, held = split_instances(rows, fraction, seed)

    rows = [r for r in rows if r["swept"]]

    def curve(name, ids):
        pts = {}
        for k in ks:
            vals = [r["sweep"][f"selective_{name}@{k}"]["agree"] for r in rows
                    if r["instance"] in ids and f"selective_{name}@{k}" in r["sweep"]]
            pts[str(k)] = proportion(sum(vals), len(vals))
        return pts

    score = {}
    for name in rankings:
        ps = [p["p"] for p in curve(name, sel).values() if p["p"] is not None]
        score[name] = float(np.mean(ps)) if ps else None
    valid = {n: s for n, s in score.items() if s is not None}
    chosen = max(valid, key=valid.get) if valid else None          # ties: the first in `rankings`
    return {"selection_instances": sorted(sel), "held_out_instances": sorted(held), "selection_score": score,
            "chosen": chosen, "held_out": {n: curve(n, held) for n in rankings}}


# -------------------------------------------------------------------------------------------- cot

def decision_after_marker(logprobs: torch.Tensor, pair, o_old: str, o_new: str) -> str | None:
    """The owned decision read after the answer marker as an outcome name
    (:func:`kvnotes.kv.generate.owned_side`), or None when it is not owned."""
    return {"old": o_old, "new": o_new}.get(owned_side(logprobs, pair) or "")


def cot_pairs(ctx, kwargs, rankings, ks) -> tuple[list[dict], list[dict]]:
    """CoT readout of every method on the pairs whose generated decision flips (see module doc):
    chains from :func:`kvnotes.kv.generate.generate`, the decision read after the marker."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    max_new = int(cfg.cot.max_new_tokens)
    limit = cfg.cot.max_pairs
    stop_ids = stop_tokens(tok)
    rows, excluded = [], list(ctx.pairs.excluded)

    def decide(items: dict, pair, marker, o_old, o_new) -> dict[str, dict]:
        """``{name: (edited, token)}`` -> ``{name: {decision, reached, s, text, chain_len}}``; one
        batched generation per decision position (the methods' caches stacked, one copy)."""
        groups: dict = {}
        for name, (e, t) in items.items():
            groups.setdefault((e.pos, t), []).append(name)
        res = {}
        for (pos, t), names in groups.items():
            gen = generate(model, edit.stack([items[n][0].cache for n in names], pos), t, pos, max_new,
                           answer_marker(tok, marker, ctx.thinking), stop_ids)
            for j, n in enumerate(names):
                chain, lp = gen.chains[j], gen.logprobs[j]
                res[n] = {"decision": decision_after_marker(lp, pair, o_old, o_new) if chain.reached else None,
                          "reached": chain.reached, "text": tok.decode(chain.ids, skip_special_tokens=True),
                          "chain_len": chain.length, "stopped": chain.stopped,
                          "unreached": unreached_reason(tok, chain, ctx.thinking),
                          "s": float(first_token_scores(lp[None], pair)[0]) if chain.reached else None}
        return res

    order = round_robin([pair_row(p) for p in ctx.pairs.pairs])
    pairs = [ctx.pairs.pairs[i] for i in (order if limit is None else order[: int(limit)])]
    excluded_limit = len(ctx.pairs.pairs) - len(pairs)
    for pair in tqdm(pairs, desc="edit cot", disable=not cfg.progress):
        sc = pair.spec.instance.scenario
        marker = sc.variants[pair.spec.variant].answer_marker
        outcome = {c: o for o, c in sc.candidates.items()}
        o_old, o_new = outcome[pair.spec.cand_old], outcome[pair.spec.cand_new]
        with ctx.timer("cot_screen"):
            ed = PairEditor(ctx, pair, kwargs)
            screen = decide({"full": (ed.full, ed.token), "stale": (edit.Edited(ed.stale, ed.d, 0, 0.0, 0.0), ed.token)},
                            pair, marker, o_old, o_new)
            full, stale = screen["full"], screen["stale"]
        base = pair_row(pair) | {"full_text": full["text"], "stale_text": stale["text"],
                                 "full_decision": full["decision"], "stale_decision": stale["decision"],
                                 "full_chain_len": full["chain_len"], "stale_chain_len": stale["chain_len"]}
        def why(arm: str, got: dict) -> str:
            return f"{arm}_{'no_marker' if got['unreached'] == 'no_answer_marker' else got['unreached']}"
        reason = (why("full", full) if not full["reached"] else why("stale", stale) if not stale["reached"]
                  else None if (full["decision"] == o_new and stale["decision"] == o_old) else "no_cot_flip")
        if reason:
            excluded.append(base | {"reason": reason})
            continue
        full_dec, stale_dec = full["decision"], stale["decision"]
        methods = {"full": {"decision": full_dec, "agree": True, "reached": True, "tokens": ed.full.tokens, "frac": 1.0,
                            "s": full["s"], "chain_len": full["chain_len"]},
                   "stale": {"decision": stale_dec, "agree": False, "reached": True, "tokens": 0, "frac": 0.0,
                             "s": stale["s"], "chain_len": stale["chain_len"]}}
        with ctx.timer("cot_methods"):
            items = {n: v for n, v in ed.named().items() if n not in ("full", "stale")}
            items |= {n: (e, ed.token) for n, _, _, e in sweep_methods(ed, rankings, ks, None)}
            for name, got in decide(items, pair, marker, o_old, o_new).items():
                methods[name] = {"decision": got["decision"], "agree": got["decision"] == full_dec,
                                 "reached": got["reached"], "tokens": items[name][0].tokens,
                                 "frac": items[name][0].tokens / ed.full.tokens, "s": got["s"],
                                 "chain_len": got["chain_len"]}
            for name in CONTROLS:                          # no decision read: not moved (see reached)
                dec = methods[name]["decision"]
                methods[name]["moved"] = dec is not None and dec != stale_dec
        rows.append(base | {"methods": methods})
    if excluded_limit:
        excluded.append({"pair": None, "family": None, "reason": "beyond_max_pairs", "count": excluded_limit})
    return rows, excluded


# --------------------------------------------------------------------------------------------- run

def run(ctx) -> dict:
    """Every edit method on every flipping pair; see the module docstring."""
    cfg = ctx.cfg
    kwargs = dict(cfg.chat_template_kwargs or ctx.template_kwargs or {})
    rankings = [str(r) for r in cfg.rankings]
    ks = [int(k) for k in cfg.ks]
    n_boot, seed = int(cfg.n_boot), ctx.seed
    oracle_ranking = cfg.oracle_ranking
    if ctx.scenario.variant == "cot":
        return run_cot(ctx, kwargs, rankings, [int(k) for k in cfg.cot.ks], n_boot, seed)
    fs = flipping_pairs(ctx, keep_caches=False)
    order = round_robin(fs.rows)
    limit, sweep_limit = cfg.max_pairs, cfg.sweep_max_pairs
    if limit is not None and len(order) > int(limit):
        fs.exclusions["beyond_max_pairs"] = len(order) - int(limit)
        order = order[: int(limit)]
    swept = set(order if sweep_limit is None else order[: int(sweep_limit)])
    rows = []
    for i in tqdm(order, desc="edit", disable=not cfg.progress):
        with ctx.timer("edits"):
            rows.append(fs.rows[i] | {"swept": i in swept}
                        | direct_pair(ctx, fs.runs[i], kwargs, rankings, ks, oracle_ranking, i in swept))
    families = families_of(ctx, rows + fs.excluded)
    with ctx.timer("controls"):
        ctrl_rows, ctrl_skipped = control_pairs(ctx, fs, kwargs, int(cfg.max_control_pairs))
    with ctx.timer("statistics"):
        named = {m: method_summary(rows, m, families, n_boot, seed) for m in EDIT_METHODS}
        index = {n: (v["ranking"], v["k"]) for r in rows for n, v in r["sweep"].items()}
        sweep_names = sorted(index, key=lambda n: (index[n][0] == "oracle_copy", index[n]))
        sweep = {n: method_summary(rows, n, families, n_boot, seed, "sweep") for n in sweep_names}
        controls = {m: {g: proportion(sum(r["methods"][m]["moved"] for r in rows if g in ("all", r["family"])),
                                      sum(1 for r in rows if g in ("all", r["family"]))) for g in ["all", *families]}
                    for m in CONTROLS}
        controls["overcorrection"] = proportion(sum(r["overcorrected"] for r in ctrl_rows), len(ctrl_rows))
        choice = choose_ranking(rows, rankings, ks, seed, float(cfg.selection_fraction))
    aggregates = {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows),
                  "families": families, "variant": "direct", "methods": named, "sweep": sweep,
                  "sweep_index": {n: {"ranking": index[n][0], "k": index[n][1]} for n in sweep_names},
                  "ranking_choice": choice, "controls": controls, "control_pairs_skipped": ctrl_skipped,
                  "upper_bounds": [n for n, m in methods.METHODS.items() if m.upper_bound], "exclusions_by_family": exclusions_by_family(fs.excluded, families)}
    return {"rows": rows, "control_rows": ctrl_rows, "exclusions": fs.exclusions, "excluded": fs.excluded,
            "aggregates": aggregates}


def run_cot(ctx, kwargs, rankings, ks, n_boot, seed) -> dict:
    """CoT mode of :func:`run`: decisions read from greedy decodes of every method's cache."""
    rows, excluded = cot_pairs(ctx, kwargs, rankings, ks)
    families = families_of(ctx, rows + [e for e in excluded if e.get("family")])
    names = sorted({n for r in rows for n in r["methods"]})
    methods = {}
    for n in names:
        have = [r for r in rows if n in r["methods"]]
        methods[n] = {
            "agreement": {g: proportion(sum(r["methods"][n]["agree"] for r in have if g in ("all", r["family"])),
                                        sum(1 for r in have if g in ("all", r["family"]))) for g in ["all", *families]},
            "reached_marker": proportion(sum(r["methods"][n]["reached"] for r in have), len(have)),
            "frac": _family_means(have, lambda r, n=n: r["methods"][n]["frac"], families)}
    controls = {m: proportion(sum(r["methods"][m]["moved"] for r in rows), len(rows)) for m in CONTROLS}
    exclusions = Counter()
    for e in excluded:
        exclusions[e["reason"]] += int(e.get("count", 1))
    aggregates = {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows),
                  "families": families, "variant": "cot", "methods": methods, "controls": controls,
                  "upper_bounds": [], "exclusions_by_family": exclusions_by_family(excluded, families)}
    return {"rows": rows, "exclusions": dict(exclusions), "excluded": excluded, "aggregates": aggregates}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(plot="kvnotes.plots.edit:plot_edit", figures=(edit_frontier,),
    table=edit_table)
