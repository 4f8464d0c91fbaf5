"""``memory_agent`` (E5): the memory agent over many turns (issue #21 part 2; paper §editing,
external validity: a user memory kept as an editable cache across a session).

Specification: ``docs/probes/memory_agent.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Optional

import numpy as np
import torch
from annotated_types import Len
from scipy.stats import linregress

from kvnotes.context import EditableContext
from kvnotes.harness import memory as mem
from kvnotes.harness.kit import units
from kvnotes.harness.constraints import Count, one_of
from kvnotes.harness.registry import Conformance
from kvnotes.records.memory_tables import arm_cells, memory_settings
from kvnotes.records.tables import Lines, fmt, fmt_counts
from kvnotes.records.figures import Bars, Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.scenarios.memory import filler_lines, memory_lines

#: Session arms (edit modes of :class:`kvnotes.context.EditableContext`).
ARMS = ("in_place", "erratum", "auto")


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "user-memory personas; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(mem.MemoryConfig):
    """``conf/probe/memory_agent.yaml``.

    Attributes:
        lengths: memory lengths (tokens) of the timed sessions.
        turns: turns per timed session.
        long_turns: turns of the long-horizon run.
        long_length: memory length of the long-horizon run (null: no long-horizon run).
        arms: the edit modes compared.
    """

    lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    turns: Count = 12
    long_turns: Count = 28
    long_length: Optional[Count] = 1024
    arms: Annotated[list[Annotated[str, one_of(*ARMS)]], Len(min_length=1)] = field(default_factory=lambda: list(ARMS))


class Result(mem.MemoryResult):
    """What ``run`` returns (record ``result``)."""

    arm_names: list[str]


def toggle_schedule(suite, persona) -> list[tuple[str, str, str, str]]:
    """The facts a session toggles, in order: ``(fact, query, original value, other value)`` for each
    fact with a value and a query that uses it alone; the other value is the suite's edit of that
    fact, else the query's first other candidate."""
    out = []
    for f in persona.facts:
        q = next((q for q in persona.queries if list(q.uses) == [f.id]), None)
        if f.value is None or q is None:
            continue
        cands = list(suite.candidates(q))
        edit = next((e for e in persona.edits if e.fact == f.id), None)
        other = edit.value if edit is not None else next((c for c in cands if c != f.value), None)
        if other is not None and f.value in cands and other in cands:
            out.append((f.id, q.id, f.value, other))
    return out


def memory_context(model, tokenizer, suite, persona, prompt: mem.MemoryPrompt, cfg,
                   template_kwargs: dict | None = None) -> EditableContext:
    """The persona's memory as an editable context (facts with a value as fields), not prefilled,
    rendered with the model's chat-template arguments ``template_kwargs``: the session of
    ``memory_agent`` (``docs/probes/memory_agent.md``)."""
    kw = {"answer_prefix": suite.answer_prefix, "chat_template": bool(cfg.chat_template),
          "template_kwargs": template_kwargs}
    ctx = EditableContext(model, tokenizer, **kw)
    ctx.add_text(suite.header + "\n")
    for line, fid in memory_lines(persona, filler_lines(suite, persona.id, prompt.n_filler)):
        fact = persona.fact(fid) if fid is not None else None
        if fact is None or fact.value is None or "{value}" not in fact.text:
            ctx.add_text(line + "\n")
            continue
        head, _, tail = fact.text.partition("{value}")
        ctx.add_text(head).add_field(fid, fact.value, label=fact.label).add_text(tail + "\n")
    return ctx


def context_query(suite, persona, qid: str, answer: str, ctx: EditableContext) -> tuple[mem.TokQuery, list[str]]:
    """Query ``qid`` of ``persona`` as read on the context ``ctx`` (its tokens and the candidates'
    first tokens there), expecting ``answer``; with the candidates' strings, for
    :meth:`kvnotes.context.EditableContext.decide`."""
    q = persona.query(qid)
    cands = suite.candidates(q)
    firsts = mem.first_tokens(ctx.tokenizer, ctx, cands)
    return mem.TokQuery(q.id, ctx.layout.ids, firsts, answer, tuple(q.uses)), list(cands.values())


@torch.no_grad()
def run_session(model, tokenizer, suite, persona, prompt: mem.MemoryPrompt, cfg, n_turns: int, run: str,
                template_kwargs: dict | None = None) -> list[dict]:
    """One session of ``n_turns`` turns (the specification): one row per turn."""
    plan = toggle_schedule(suite, persona)
    if not plan:
        return []
    base = memory_context(model, tokenizer, suite, persona, prompt, cfg, template_kwargs)
    first_q = suite.question.format(question=persona.query(plan[0][1]).question)
    base.add_request(first_q)
    base.prefill()
    arms = {a: base.fork() for a in cfg.arms}
    ref = base.fork()
    cum = dict.fromkeys([*cfg.arms, "full"], 0.0)
    rows = []
    for t in range(n_turns):
        fid, qid, orig, other = plan[t % len(plan)]
        value = other if ref.fields[fid] == orig else orig
        question = suite.question.format(question=persona.query(qid).question)
        ref.set_request(question)
        rep = ref.edit(fid, value, "full")
        tq, cands = context_query(suite, persona, qid, value, ref)
        d_full, t_read = mem.timed(ref.decide, cands)
        ttft_full = rep.cost.seconds + t_read
        cum["full"] += ttft_full
        row = mem.reference(d_full.logprobs, prompt, tq, run=run, turn=t + 1, fact=fid, value=value,
                            ttft_full=ttft_full, cum_full=cum["full"])
        row["prompt_tokens"] = int(ref.layout.length)
        for arm, ctx in arms.items():
            er, t_edit = mem.timed(ctx.edit, fid, value, arm, candidates=cands)
            c_req, t_req = mem.timed(ctx.set_request, question)
            d, t_dec = mem.timed(ctx.decide, cands)
            ttft = t_edit + t_req + t_dec
            cum[arm] += ttft
            row["arms"][arm] = mem.compare(d_full.logprobs, d.logprobs, tq) | {
                "ttft": ttft, "cum": cum[arm], "applied": er.applied,
                "tokens": float(er.cost.tokens + c_req.tokens)}
        rows.append(row)
    return rows


def drift(rows: list[dict], arm: str) -> dict:
    """Per-turn means over personas of agreement (owned turns) and KL, and the least-squares slope of
    KL (persona means per turn) on the turn index with its two-sided p-value."""
    turns = sorted({r["turn"] for r in rows})
    kl = [float(np.mean([r["arms"][arm]["kl"] for r in rows if r["turn"] == t])) for t in turns]
    agree = []
    for t in turns:
        own = [r for r in rows if r["turn"] == t and r["owned"]]
        agree.append(sum(r["arms"][arm]["top1_agree"] for r in own) / len(own) if own else None)
    fit = linregress(turns, kl) if len(turns) > 2 and np.ptp(kl) > 0 else None
    return {"turns": turns, "kl_mean": kl, "agreement": agree,
            "kl_slope": None if fit is None else float(fit.slope),
            "kl_slope_p": None if fit is None else float(fit.pvalue)}


def aggregate(rows: list[dict], cfg, seed: int) -> tuple[dict, dict, dict]:
    """Per ``run/length``: each arm's :func:`kvnotes.harness.memory.arm_summary`, cumulative time to
    first token (sum over the session's turns, mean over personas) and its ratio to the reference's,
    ``applied`` counts, the drift curve (long horizon); paired tests per cell with BH."""
    agg, tests = {}, {}
    for run, L in dict.fromkeys((r["run"], r["length"]) for r in rows):
        rs = [r for r in rows if r["run"] == run and r["length"] == L]
        last = [r for r in rs if r["turn"] == max(x["turn"] for x in rs)]
        cum_full = float(np.mean([r["cum_full"] for r in last]))
        per = {}
        for a in cfg.arms:
            s = mem.arm_summary(rs, a, cfg.n_boot, seed)
            cum = float(np.mean([r["arms"][a]["cum"] for r in last]))
            s |= {"cum_ttft_s": cum, "cum_ttft_ratio": cum_full / cum if cum else None,
                  "applied": dict(Counter(r["arms"][a]["applied"] for r in rs))}
            if run == "long":
                s["drift"] = drift(rs, a)
            per[a] = s
            tests[f"{run}/{L}/{a}"] = mem.paired_tests(rs, a, cfg.alpha, cfg.margin_accuracy,
                                                       cfg.margin_kl)
        agg[f"{run}/{L}"] = {"arms": per, "n": len(rs), "turns": max(r["turn"] for r in rs), "cum_ttft_full_s": cum_full,
                             "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in rs]))}
    return agg, tests, mem.adjust(tests, cfg.alpha)


def run(ctx) -> dict:
    """E5: timed sessions at every length and the long-horizon run; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    suite = mem.load_suite(cfg)
    tk = dict(ctx.template_kwargs) or None          # the model's chat-template arguments, thinking switch applied
    jobs = [("session", int(L), cfg.turns) for L in cfg.lengths]
    if cfg.long_length:
        jobs.append(("long", int(cfg.long_length), cfg.long_turns))
    rows: list[dict] = []
    excluded: list[dict] = []
    for (name, L, n), persona in units(ctx, [(j, p) for j in jobs for p in suite.personas], "memory_agent"):
        with ctx.timer("render"):
            prompt = mem.build_prompt(tok, suite, persona, L, cfg.seed, chat_template=cfg.chat_template,
                                      template_kwargs=tk)
        if not toggle_schedule(suite, persona):
            excluded.append({"persona": persona.id, "length": L, "reason": "no_toggleable_fact"})
            continue
        with ctx.timer("turns"):
            rows += run_session(model, tok, suite, persona, prompt, cfg, n, name, tk)
    with ctx.timer("statistics"):
        agg, tests, adjusted = aggregate(rows, cfg, ctx.seed)
    return {"rows": rows, "aggregates": agg, "tests": tests, "bh": adjusted, "arm_names": list(cfg.arms),
            "exclusions": dict(Counter(e["reason"] for e in excluded)), "excluded": excluded,
            "settings": mem.settings(cfg, suite, turns=cfg.turns, long_turns=cfg.long_turns,
                                     long_length=cfg.long_length, arms=list(cfg.arms))}


def memory_agent_table(rec: dict) -> str:
    """E5: per run (timed sessions, long horizon), length and arm: agreement with the re-prefill of
    the rewritten prompt, KL, cumulative time to first token against re-prefilling every turn, the
    paired tests, and the long horizon's KL slope over turns."""
    w = Lines()
    res = rec["result"]
    w(memory_settings(rec))
    w("| run / memory (tokens) | turns | arm | decision agreement (owned) | top-1 agreement | accuracy arm / full | "
      "KL(full‖arm) mean [95% CI] | McNemar (arm vs full) | TOST accuracy | TOST KL | cumulative TTFT s "
      "(re-prefill s) | re-prefill / arm | KL slope per turn (p) | applied |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            dr = s.get("drift")
            slope = "n/a" if not dr or dr["kl_slope"] is None else f"{dr['kl_slope']:+.2e} ({dr['kl_slope_p']:.2g})"
            w(f"| {cell} ({a['prompt_tokens_mean']:.0f}) | {a['turns']} | {arm} | "
              f"{arm_cells(s, res['tests'][f'{cell}/{arm}'])} | {s['cum_ttft_s']:.2f} "
              f"({a['cum_ttft_full_s']:.2f}) | {fmt(s['cum_ttft_ratio'], '.2f')}x | {slope} | {fmt_counts(s['applied'])} |")
    return w.text()


def drift_by_turn(metric: str):
    """``result -> {"all": {"<arm> (<cell>)": {x: turns, y: values}}}``: a long-horizon run's per-turn
    ``metric`` (``agreement``: decision agreement with the re-prefill, owned turns; ``kl_mean``:
    mean KL(full || arm)), for a :class:`Curves` over turns."""
    def reshape(res: dict) -> dict:
        out: dict = {}
        for cell, a in res.get("aggregates", {}).items():
            for arm in res.get("arm_names", []) if cell.startswith("long/") else ():
                d = a["arms"][arm].get("drift") or {}
                out.setdefault("all", {})[f"{arm} ({cell})"] = {"x": d.get("turns", []), "y": d.get(metric, [])}
        return out
    return reshape


def session_ttft(res: dict) -> dict:
    """Per timed session (memory length), each arm's cumulative time to first token (mean over
    personas) and re-prefilling every turn's, for :class:`Bars`."""
    out: dict = {}
    for cell, a in res.get("aggregates", {}).items():
        if cell.startswith("session/"):
            n = len(res.get("settings", {}).get("personas", [])) or 1
            out[cell] = {arm: {"mean": a["arms"][arm]["cum_ttft_s"], "n": n} for arm in res.get("arm_names", [])}
            out[cell]["re-prefill"] = {"mean": a["cum_ttft_full_s"], "n": n}
    return out


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(table=memory_agent_table, figures=(
    Reshaped(Curves("drift-agreement", "@/*", "long horizon: decision agreement with the re-prefill per turn "
                    "(owned turns)", "turn", "agreement", xy=("x", "y")), drift_by_turn("agreement")),
    Reshaped(Curves("drift-kl", "@/*", "long horizon: KL(full || arm) per turn (persona means)", "turn",
                    "KL (nats)", xy=("x", "y"), ylog=True), drift_by_turn("kl_mean")),
    Reshaped(Bars("session-ttft", "@/*", "timed sessions: cumulative time to first token (mean over personas; "
                  "measured on this machine)", "seconds"), session_ttft)))


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.lengths=[96]", "probe.personas=[maria]", "probe.turns=2", "probe.long_turns=3",
                                  "probe.long_length=96"), shapes="two")
