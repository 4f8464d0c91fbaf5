"""Probe ``edit``: edit the cached old prompt into the new one by every method of the edit-method
registry (:mod:`kvnotes.ops.methods`, operations of :mod:`kvnotes.ops.edit`) and measure quality
against cost (paper "Models Take Notes at Prefill", §editing; ``docs/editing.md``).

Specification: ``docs/probes/edit.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

import numpy as np
import torch
from pydantic import AfterValidator

from kvnotes.context import ERRATUM_WORDINGS
from kvnotes.errors import KvnotesError
from kvnotes.harness import edit_prompts as sedits
from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegative, OpenFraction, one_of
from kvnotes.harness.kit import ProbeConfig, families_of, summaries_by_family
from kvnotes.harness.protocol import (PROMPT_VARIANT, GeneratedReadout, Read, pair_loop, read_caches, readout_aggregates,
                                      readout_config)
from kvnotes.harness.screened import ScreenedPair
from kvnotes.harness.selection import SELECTION, alternate_splits, pair_rng, round_robin, with_split
from kvnotes.harness.stats import proportion
from kvnotes.harness.registry import Conformance
from kvnotes.kv.cache import AllSlotCache
from kvnotes.kv.decision import kl_nats, recovery
from kvnotes.ops import edit, methods
from kvnotes.ops.methods import EditSource, Prompted
from kvnotes.records.figures import Bars, Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult
from kvnotes.records.tables import Lines, fmt, fmt_p

# ------ the edit registry's source for a pair: the prompts a method names, rendered for this pair

class PairEditor(EditSource):
    """What every method of one pair reads (:class:`kvnotes.ops.methods.EditSource`), shared by the
    direct and CoT readouts: the stale cache, the full re-prefill and the field refresh (each
    computed once), and the prompts the methods name, rendered for this pair (:data:`PROMPTS`)."""

    def __init__(self, ctx, pair, kwargs: dict):
        self.ctx, self.pair = ctx, pair
        self.tok = ctx.bundle.tokenizer
        cfg = ctx.cfg
        self.placement = cfg.placement
        self.template = str(cfg.erratum_template or sedits.ERRATUM_TEMPLATE)
        self.chat = ctx.scenario.chat_template
        self.kwargs = kwargs
        transcript = ctx.scenario.transcript
        self.turns = None if transcript is None else transcript.turns      # None: the flat layout
        spec = pair.spec
        self.inst, self.variant = spec.instance, spec.variant
        same = sedits.edited_prompt(self.tok, self.inst, spec.old, pair.old, self.variant, chat_template=self.chat,
                                    template_kwargs=kwargs, turns=self.turns)
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
                                  template_kwargs=self.kwargs, turns=self.turns)
        return Prompted(self.stale, ep.prompt.ids, ep.reuse, ep.prompt.decision)

    def hoisted(self) -> Prompted:
        """The new value in the hoisted layout, aligned with the old value's hoisted prompt, whose cache
        (what one would have stored with that layout) is prefilled here, not counted."""
        spec = self.pair.spec
        old_h, new_h = sedits.hoisted_pair(self.tok, self.inst, spec.old, spec.new, self.variant, self.chat,
                                           self.kwargs, self.turns)
        cached = AllSlotCache.prefill(self.model, old_h.ids[: old_h.decision])
        return Prompted(cached, new_h.prompt.ids, new_h.reuse, new_h.prompt.decision)

    def named(self) -> dict[str, tuple[edit.Edited, int]]:
        """``name -> (edited, decision token)`` for every method of the registry that is not ranked
        (:data:`EDIT_METHODS`), in record order."""
        return {name: methods.apply(methods.METHODS[name], self) for name in EDIT_METHODS}

    def erratum(self, value: str) -> str:
        """The erratum text stating ``value`` for this pair's instance."""
        return sedits.erratum_text(self.inst, value, self.template)

    def worded(self, wording: str) -> tuple[edit.Edited, int]:
        """The registry's erratum method with its line in ``wording`` (:data:`kvnotes.context.ERRATUM_WORDINGS`)
        instead of the configured template: (edited cache, decision token)."""
        saved, self.template = self.template, ERRATUM_WORDINGS[wording]
        try:
            return methods.apply(methods.METHODS["erratum"], self)
        finally:
            self.template = saved

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

#: With ``scenario.variant=cot`` this probe decodes the reasoning before reading the decision.
SUPPORTS_COT = True


def _ranking(name: str) -> str:
    """A registered position ranking (:data:`kvnotes.ops.methods.RANKINGS`)."""
    if name not in RANKINGS:
        raise ValueError(f"must be one of {', '.join(map(repr, RANKINGS))}")
    return name


Ranking = Annotated[str, AfterValidator(_ranking)]


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/edit.yaml``
    (the defaults are here; the YAML sets what differs; see the specification); ``cot_<key>``
    stands in for ``<key>`` under the generated readout (:func:`kvnotes.harness.protocol.readout_config`)."""

    #: selective@K rankings of downstream positions
    rankings: list[Ranking] = field(default_factory=lambda: ["attention", "kv_deviation", "last", "random"])
    #: K sweep (K above a pair's downstream length is skipped)
    ks: list[NonNegative] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64])
    #: oracle_copy@K (UPPER BOUND: K/V copied from the full re-prefill); null: off
    oracle_ranking: Optional[Ranking] = "attention"
    #: erratum line: before_request | after_context | before_decision
    placement: Annotated[str, one_of(*sedits.PLACEMENTS)] = "before_request"
    #: null: kvnotes.harness.edit_prompts.ERRATUM_TEMPLATE ({field}, {value})
    erratum_template: Optional[str] = None
    #: also run the erratum in each of these wordings (kvnotes.context.ERRATUM_WORDINGS: none, value,
    #: tag, override, reevaluate): does the correction's wording matter once the new value is present?
    erratum_wordings: list[Annotated[str, one_of(*ERRATUM_WORDINGS)]] = field(default_factory=list)
    #: instances used to choose the ranking; the rest are held out
    selection_fraction: OpenFraction = 0.5
    #: cap on flipping pairs edited (null: all; round-robin over scenarios); the rest are counted
    max_pairs: Optional[Count] = 24
    #: the K sweep runs on the first N edited pairs (round-robin; null: all) to bound CPU time
    sweep_max_pairs: Optional[NonNegative] = 8
    #: over-correction control pairs (same clean decision) erratum-edited
    max_control_pairs: NonNegative = 8
    #: null = the model's (its chat_template_kwargs and thinking switch); an override must match them
    chat_template_kwargs: Any = None
    #: under cot (:func:`kvnotes.harness.protocol.readout_config`): the K sweep (rankings as above),
    #: the upper bound (null: off) and the pairs swept (null: every edited pair)
    cot_ks: list[NonNegative] = field(default_factory=lambda: [8, 32])
    cot_oracle_ranking: Optional[Ranking] = None
    cot_sweep_max_pairs: Optional[NonNegative] = None


class Result(BaseResult):
    """What ``run`` returns (record ``result``): ``rows`` of edited flipping pairs with each
    method's recovery and agreement (CoT: generated decisions), ``aggregates`` per method,
    ``warnings`` (one line each, also on stderr: e.g. why no ranking was chosen)."""

    rows: list[dict[str, Any]]
    excluded: list[dict[str, Any]]
    warnings: list[str]


def _metrics(read: Read, full: Read, e: edit.Edited, ref: edit.Edited, sp: ScreenedPair) -> dict:
    """One method's columns on a pair: its score and recovery against the clean scores, agreement
    with full's decision, KL(full || method) and top-1 (None when a chain missed its marker), and
    its cost relative to full (``ref``); under the generated readout also ``reached``,
    ``chain_len`` and ``side`` (the candidate its chain names, :class:`kvnotes.harness.protocol.Read`)."""
    both = read.reached and full.reached
    out = {"s": read.s, "r": recovery(read.s, sp.s_old, sp.s_new),
           "agree": read.side is not None and read.side == full.side,
           "kl": float(kl_nats(full.logprobs, read.logprobs)) if both else None,
           "top1": int(read.logprobs.argmax()) == int(full.logprobs.argmax()) if both else None,
           "tokens": e.tokens, "frac": e.tokens / ref.tokens,
           "flops_frac": e.flops / ref.flops if np.isfinite(e.flops) else None,
           "time_ratio": e.seconds / ref.seconds if np.isfinite(e.seconds) else None}
    return out | read.chain_columns(reached="reached", length="chain_len", side="side")


def edit_pair(ctx, sp: ScreenedPair, kwargs, rankings, ks, oracle_ranking, sweep: bool,
              wordings: Sequence[str] = ()) -> dict:
    """Every method's columns on one flipping pair under the run's readout (:func:`_metrics`,
    controls' ``moved``); the K sweep when ``sweep``; the erratum in each of ``wordings``
    (``wordings``: name -> columns)."""
    pair = sp.pair
    ed = PairEditor(ctx, pair, kwargs)
    named = ed.named()
    reads = read_caches(ctx, pair, {n: (e.cache, e.pos, t) for n, (e, t) in named.items()})
    full, stale = reads["full"], reads["stale"]
    methods = {n: _metrics(reads[n], full, e, ed.full, sp) for n, (e, _) in named.items()}
    for name in CONTROLS:                       # generated: no decision read is not moved (see reached)
        methods[name]["moved"] = reads[name].side is not None and reads[name].side != stale.side
    out = {"n_downstream": pair.downstream[1] - pair.downstream[0], "full_seconds": ed.full.seconds,
           "methods": methods, "sweep": {}}
    if wordings:
        worded = {w: ed.worded(w) for w in wordings}
        reads = read_caches(ctx, pair, {w: (e.cache, e.pos, t) for w, (e, t) in worded.items()})
        out["wordings"] = {w: _metrics(reads[w], full, e, ed.full, sp) for w, (e, _) in worded.items()}
    if sweep:
        variants = {name: (e, ranking, k) for name, ranking, k, e in sweep_methods(ed, rankings, ks, oracle_ranking)}
        reads = read_caches(ctx, pair, {n: (v[0].cache, v[0].pos, ed.token) for n, v in variants.items()})
        out["sweep"] = {n: _metrics(reads[n], full, e, ed.full, sp) | {"ranking": r, "k": k}
                        for n, (e, r, k) in variants.items()}
    return out


def control_pairs(ctx, excluded: list[dict], kwargs, limit: int) -> tuple[list[dict], dict]:
    """Over-correction: the correct erratum on pairs whose clean scores have the same sign (the
    clean runs take the same candidate; under the generated readout the excluded rows carry no
    clean scores, so there are none); ``overcorrected`` = the erratum's decision differs from
    full's."""
    by_id = {p.spec.id: p for p in ctx.pairs.pairs}
    rows, skipped = [], Counter()
    cands = [r for r in excluded if r.get("s_old") is not None and (r["s_old"] > 0) == (r["s_new"] > 0)]
    for r in cands[:limit]:
        pair = by_id[r["pair"]]
        ed = PairEditor(ctx, pair, kwargs)
        err, tok = methods.apply(methods.METHODS["erratum"], ed)
        reads = read_caches(ctx, pair, {"full": (ed.full.cache, ed.full.pos, ed.token), "erratum": (err.cache, err.pos, tok)})
        full, got = reads["full"], reads["erratum"]
        rows.append({k: r[k] for k in ("pair", "scenario", "family", "instance", "old", "new", "expect_flip")}
                    | {"s_full": full.s, "s_erratum": got.s, "overcorrected": got.side != full.side})
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
    """Recovery and agreement (cluster bootstrap, Wilson), KL, top-1, cost of one method. Under the
    generated readout also ``agreement`` over every pair (a chain that missed its marker does not
    agree; ``recovery`` leaves it out) and ``reached_marker``."""
    have = [r for r in rows if key in r[section]]
    m = lambda r: r[section][key]                                                # noqa: E731
    out = {"recovery": summaries_by_family(have, lambda r: m(r)["r"], lambda r: m(r)["agree"], families, n_boot, seed)}
    for name in ("kl", "frac", "flops_frac", "time_ratio"):
        out[name] = _family_means(have, lambda r, n=name: m(r)[n], families)
    groups = {g: [r for r in have if g in ("all", r["family"])] for g in ["all", *families]}
    out["top1"] = {g: proportion(sum(bool(m(r)["top1"]) for r in rs), sum(m(r)["top1"] is not None for r in rs))
                   for g, rs in groups.items()}
    if have and "reached" in m(have[0]):
        out["agreement"] = {g: proportion(sum(m(r)["agree"] for r in rs), len(rs)) for g, rs in groups.items()}
        out["reached_marker"] = proportion(sum(m(r)["reached"] for r in have), len(have))
    return out


def choose_ranking(rows, rankings, ks, n_instances: int | None = None) -> dict:
    """Pick the ranking with the highest mean agreement over K on the swept selection pairs; report
    every ranking's agreement curve on the swept held-out pairs (the chosen one is the claim).

    Args:
        rows: the edited rows, tagged with ``split`` (over every flipping pair, before the caps) and
            ``swept``.
        n_instances: the run's ``scenario.n_instances``, for the reason when nothing is chosen.

    Returns:
        ``selection_instances`` / ``held_out_instances`` (of the edited rows), ``n_swept`` per side,
        ``selection_score`` per ranking, ``chosen`` (None when nothing could be chosen, then
        ``reason`` says why; else ``reason`` is None) and ``held_out`` curves.
    """
    sel = {r["instance"] for r in rows if r["split"] == SELECTION}
    held = {r["instance"] for r in rows if r["split"] != SELECTION}
    swept = [r for r in rows if r["swept"]]

    def curve(name, ids):
        pts = {}
        for k in ks:
            vals = [r["sweep"][f"selective_{name}@{k}"]["agree"] for r in swept
                    if r["instance"] in ids and f"selective_{name}@{k}" in r["sweep"]]
            pts[str(k)] = proportion(sum(vals), len(vals))
        return pts

    score = {}
    for name in rankings:
        ps = [p["p"] for p in curve(name, sel).values() if p["p"] is not None]
        score[name] = float(np.mean(ps)) if ps else None
    valid = {n: s for n, s in score.items() if s is not None}
    chosen = max(valid, key=valid.get) if valid else None          # ties: the first in `rankings`
    n_swept = {"selection": sum(r["instance"] in sel for r in swept), "heldout": sum(r["instance"] in held for r in swept)}
    return {"selection_instances": sorted(sel), "held_out_instances": sorted(held), "n_swept": n_swept,
            "selection_score": score, "chosen": chosen,
            "reason": None if chosen else _no_choice(rows, rankings, n_swept, n_instances),
            "held_out": {n: curve(n, held) for n in rankings}}


def ranking_verdict(rows, choice: dict, ks, families, n_boot: int, seed: int) -> dict:
    """The verdict beside the ranking chosen on selection instances (issue #53): on the swept held-out
    pairs, ``selective@K`` recovery under the chosen ranking against the ``random`` ranking (the
    control), averaged over K (:func:`kvnotes.harness.kit.verdicts`); ``{}`` when no ranking was
    chosen, the chosen one is ``random``, or ``random`` was not swept."""
    chosen = choice.get("chosen")
    if chosen is None or chosen == "random":
        return {}
    held = [r for r in rows if r["swept"] and r["split"] != SELECTION]

    def over_k(name):
        def get(r):
            vals = [r["sweep"][f"selective_{name}@{k}"]["r"] for k in ks
                    if f"selective_{name}@{k}" in r["sweep"] and r["sweep"][f"selective_{name}@{k}"]["r"] is not None]
            return float(np.mean(vals)) if vals else None
        return get

    if not any(over_k("random")(r) is not None for r in held):
        return {}
    return {"ranking": K.verdicts(held, over_k(chosen), over_k("random"), families,
                                  f"selective@K recovery with the {chosen} ranking (chosen on selection instances) vs "
                                  f"the random ranking, held-out pairs, averaged over K {list(ks)}", n_boot, seed)}


def _no_choice(rows, rankings, n_swept: dict, n_instances: int | None) -> str:
    """Why :func:`choose_ranking` chose no ranking, in words."""
    if not rankings:
        return "probe.rankings is empty: there is no ranking to choose"
    if not rows:
        return "no flipping pair was edited"
    if not any(r["split"] == SELECTION for r in rows):
        if n_instances == 1:
            return ("scenario.n_instances=1: every instance is held out, so no ranking is chosen on selection "
                    "instances (run with scenario.n_instances >= 2)")
        return ("no edited pair is on a selection instance: a scenario's instances split into selection and "
                "held-out only when two or more of them have flipping pairs")
    if not n_swept["selection"]:
        return "the K sweep ran on no selection pair (probe.sweep_max_pairs)"
    return "no selective@K variant ran on a selection pair: every K of probe.ks exceeds their downstream length"


# --------------------------------------------------------------------------------------------- run

def run(ctx) -> dict:
    """Every edit method on every flipping pair under the run's readout; see the specification."""
    cfg = readout_config(ctx)                # under cot: cot_ks, cot_oracle_ranking, cot_sweep_max_pairs
    kwargs = dict(cfg.chat_template_kwargs or ctx.template_kwargs or {})
    rankings = [str(r) for r in cfg.rankings]
    ks = [int(k) for k in cfg.ks]
    oracle_ranking = cfg.oracle_ranking
    n_boot, seed = cfg.n_boot, ctx.seed
    pr = pair_loop(ctx, "edit: clean runs", keep=True)        # every flipping row first: the cap is round-robin
    # the split is over every flipping pair's instances, before the caps (a cap that keeps one instance
    # of a scenario would put it on the held-out side); the sweep takes both sides in turn
    split_rows, _, _ = with_split(pr.rows, cfg.selection_fraction, seed)
    order = round_robin(split_rows)
    limit, sweep_limit = cfg.max_pairs, cfg.sweep_max_pairs
    if limit is not None and len(order) > int(limit):
        pr.exclusions["beyond_max_pairs"] = pr.exclusions.get("beyond_max_pairs", 0) + len(order) - int(limit)
        order = order[: int(limit)]
    swept = set(order if sweep_limit is None else alternate_splits(split_rows, order)[: int(sweep_limit)])
    rows = []
    for i in K.units(ctx, order, "edit"):
        with ctx.timer("edits"):
            rows.append(split_rows[i] | {"swept": i in swept}
                        | edit_pair(ctx, pr.pairs[i], kwargs, rankings, ks, oracle_ranking, i in swept,
                                    [str(w) for w in cfg.erratum_wordings]))
    families = families_of(ctx, rows + pr.excluded)
    with ctx.timer("controls"):
        ctrl_rows, ctrl_skipped = control_pairs(ctx, pr.excluded, kwargs, cfg.max_control_pairs)
    with ctx.timer("statistics"):
        named = {m: method_summary(rows, m, families, n_boot, seed) for m in EDIT_METHODS}
        index = {n: (v["ranking"], v["k"]) for r in rows for n, v in r["sweep"].items()}
        sweep_names = sorted(index, key=lambda n: (index[n][0] == "oracle_copy", index[n]))
        sweep = {n: method_summary(rows, n, families, n_boot, seed, "sweep") for n in sweep_names}
        wordings = {str(w): method_summary(rows, str(w), families, n_boot, seed, "wordings")
                    for w in cfg.erratum_wordings}
        controls = {m: {g: proportion(sum(r["methods"][m]["moved"] for r in rows if g in ("all", r["family"])),
                                      sum(1 for r in rows if g in ("all", r["family"]))) for g in ["all", *families]}
                    for m in CONTROLS}
        controls["overcorrection"] = proportion(sum(r["overcorrected"] for r in ctrl_rows), len(ctrl_rows))
        choice = choose_ranking(rows, rankings, ks, ctx.scenario.n_instances)
        verdicts = ranking_verdict(rows, choice, ks, families, n_boot, seed)
    aggregates = K.pair_counts(ctx, rows, pr.excluded, families) | {
                  "variant": PROMPT_VARIANT[pr.readout], "methods": named, "sweep": sweep,
                  "sweep_index": {n: {"ranking": index[n][0], "k": index[n][1]} for n in sweep_names},
                  "ranking_choice": choice, "controls": controls, "control_pairs_skipped": ctrl_skipped,
                  "wordings": wordings, "verdicts": verdicts,
                  "upper_bounds": [n for n, m in methods.METHODS.items() if m.upper_bound and oracle_ranking]
                  } | readout_aggregates(ctx, pr)
    warnings = ([f"edit: no ranking chosen for the K sweep: {choice['reason']}"]
                if choice["reason"] and rows and rankings else [])
    return {"rows": rows, "control_rows": ctrl_rows, "exclusions": pr.exclusions, "excluded": pr.excluded,
            "aggregates": aggregates, "warnings": warnings}


# ---------------------------------------------------------------------------------------------
# presentation


def edit_table(record: dict) -> str:
    """The method table of an ``edit`` record (either readout), with its controls and the ranking
    chosen on selection instances. Under the generated readout agreement counts every pair (a chain
    that missed its marker does not agree) and a column says how many reached their markers."""
    w = Lines()
    agg = record["result"]["aggregates"]
    variant = agg.get("variant", "direct")
    chains = any("reached_marker" in m for m in agg["methods"].values())     # a generated readout's column
    w(f"## {record['model']['name']} · edit · {record['scenario']['name']} · {variant} · "
          f"n_flip={agg['n_flip']} · exclusions {record['result']['exclusions']}\n")
    w("| method | agrees with full (Wilson 95%) | " + ("reached marker | " if chains else "")
      + "mean recovery | KL(full‖m) nats | top-1 = full | tokens / total | FLOPs / full | time / full (median) |")
    w("|---|---|---|---|---|---|---|---|" + ("---|" if chains else ""))
    worded = [(f"erratum, wording {w}", m) for w, m in agg.get("wordings", {}).items()]
    for name, m in [*agg["methods"].items(), *agg["sweep"].items(), *worded]:
        rec = m["recovery"]["all"]
        agree = m["agreement"]["all"] if chains else rec.get("decision_flipped")
        w(f"| {name} | {fmt_p(agree)} | " + (f"{fmt_p(m['reached_marker'])} | " if chains else "")
          + f"{fmt(rec['mean'], '.2f')} | {fmt(m['kl']['all']['mean'])} | {fmt_p(m['top1']['all'])} | "
          f"{fmt(m['frac']['all']['mean'])} | {fmt(m['flops_frac']['all']['mean'])} | "
          f"{fmt(m['time_ratio']['all']['median'], '.2f')} |")
    c = agg["controls"]
    moved = ", ".join(f"{k} {fmt_p(v['all'])}" for k, v in c.items() if k != "overcorrection")
    w(f"\ncontrols (moved the stale decision): {moved}; over-correction (correct erratum flips "
      f"a same-decision control pair): {fmt_p(c['overcorrection'])}")
    ch = agg["ranking_choice"]
    if ch.get("chosen") is None and ch.get("reason"):
        w(f"\nno ranking chosen on selection instances: {ch['reason']}")
        return w.text()
    w(f"\nranking chosen on selection instances: {ch['chosen']} (selection mean agreement over K: "
          f"{ {k: (None if v is None else round(v, 3)) for k, v in ch['selection_score'].items()} }); held-out agreement "
          f"by K: " + ", ".join(f"{k}: {fmt_p(p)}" for k, p in (ch["held_out"].get(ch["chosen"]) or {}).items()))
    return w.text()


def frontier_points(res: dict) -> dict:
    """The edit frontier of a result: per method (and sweep point) its mean share of tokens
    recomputed (``x``) and mean recovery (``y``), over all families, for a :class:`Curves` of points."""
    aggs = res.get("aggregates", {})
    out: dict = {}
    for name, m in {**aggs.get("methods", {}), **aggs.get("sweep", {})}.items():
        if isinstance(m, dict) and "frac" in m and "recovery" in m:
            x, y = m["frac"]["all"].get("mean"), m["recovery"]["all"].get("mean")
            if x is not None and y is not None:
                out.setdefault("all", {})[name] = {"x": [x], "y": [y]}
    return out


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Reshaped(Curves("edit-frontier", "@/*", "edit frontier: recovery against the share of tokens recomputed",
                    "tokens recomputed / total", "mean recovery", xy=("x", "y"), markers=True), frontier_points),
    Bars("erratum-wordings", "wordings/*/recovery/@", "the erratum in each wording: recovery per family "
         "(mean, 95% interval)", "recovery"),
    Bars("erratum-wordings-follow", "wordings/*/recovery/@/decision_flipped", "the erratum in each wording: "
         "share of decisions that take the new value (Wilson 95%)", "share of pairs")),
    table=edit_table)


#: The zoo conformance lane's settings for it, multimodal entries included (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.ks=[0,4]", "probe.max_pairs=4", "probe.sweep_max_pairs=1", "probe.max_control_pairs=2"),
                          mrope=())
