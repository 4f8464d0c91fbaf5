"""``memory_edits`` (E3): a fact of the user memory changes mid-session; how well does each way of
updating the cache match a re-prefill? (issue #21 part 2; paper §editing, external validity.)

Specification: ``docs/probes/memory_edits.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvnotes.context import EditableContext
from kvnotes.harness import memory as mem
from kvnotes.harness.kit import units
from kvnotes.harness.constraints import Count, Counts, NonNegative
from kvnotes.harness.registry import Conformance
from kvnotes.records.figures import Bars
from kvnotes.records.memory_tables import MEMORY_HEAD, arm_cells, memory_settings
from kvnotes.records.tables import Lines, fmt_counts
from kvnotes.records.presentation import Presentation
from kvnotes.scenarios.memory import filler_lines, memory_lines

#: The arms besides ``selective@K``, in report order (``full`` last: the reference).
BASE_ARMS = ("stale", "in_place", "erratum", "recompile_chunk")


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "user-memory personas; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(mem.MemoryConfig):
    """Keys of ``conf/probe/memory_edits.yaml`` (shared keys: :class:`kvnotes.harness.memory.MemoryConfig`).

    Attributes:
        ks: K of the ``selective@K`` arms.
        recompile_seam: memory tokens recomputed against the prefix when the recompiled chunk is spliced.
        max_edits_per_persona: edits of each persona run (in file order).
    """

    ks: Counts = field(default_factory=lambda: [4, 16])
    recompile_seam: NonNegative = 0
    max_edits_per_persona: Count = 1


class Result(mem.MemoryResult):
    arm_names: list[str]
    checks: dict


def memory_texts(suite, persona, prompt: mem.MemoryPrompt, fact: str, value: str | None = None) -> tuple[str, str, str]:
    """``(memory text before the fact's value, after it, whole memory with value)``, the lines of
    ``prompt`` (same filler), with the fact's value ``value`` (None: the persona's own); the edited
    session of ``memory_edits`` is built from them (``docs/probes/memory_edits.md``)."""
    lines = memory_lines(persona, filler_lines(suite, persona.id, prompt.n_filler),
                         {fact: value} if value is not None else None)
    i = next(j for j, (_, f) in enumerate(lines) if f == fact)
    f = persona.fact(fact)
    head, _, tail = f.text.partition("{value}")
    before = "".join(line + "\n" for line, _ in lines[:i]) + head
    after = tail + "\n" + "".join(line + "\n" for line, _ in lines[i + 1:])
    whole = "".join(line + "\n" for line, _ in lines)
    return before, after, whole


def arm_names(ks: list[int]) -> list[str]:
    return ["stale", "in_place", *[f"selective@{k}" for k in ks], "erratum", "recompile_chunk"]


@torch.no_grad()
def edit_session(model, tokenizer, suite, persona, prompt: mem.MemoryPrompt, edit, ks: list[int], seam: int,
                 chat_template: bool = True, template_kwargs: dict | None = None) -> dict:
    """E3 for one edit on one prompt: every arm and the reference (the specification).

    Returns:
        the row: :func:`kvnotes.harness.memory.reference` columns (``answer`` = the edit's new
        answer) plus ``fact``, ``old``, ``new``, ``old_answer``, ``base_tokens``, ``base_s`` and per
        arm :func:`kvnotes.harness.memory.compare` with ``tokens``, ``seconds``, ``applied``,
        ``token_ratio``, ``time_ratio`` (to ``full``), and ``same_tokens`` for ``recompile_chunk``.
    """
    q = persona.query(edit.query)
    fact = persona.fact(edit.fact)
    cands = suite.candidates(q)
    question = suite.question.format(question=q.question)
    head = suite.header + "\n"
    before, after, _ = memory_texts(suite, persona, prompt, fact.id)
    kw = {"answer_prefix": suite.answer_prefix, "chat_template": chat_template, "template_kwargs": template_kwargs}
    base = EditableContext(model, tokenizer, **kw)
    base.add_text(head + before).add_field(fact.id, fact.value or "", label=fact.label).add_text(after)
    base.add_request(question)
    base_cost = base.prefill()
    out: dict[str, dict] = {}
    runs: dict[str, tuple] = {}
    for arm in ["full", "stale", "in_place", *[f"selective@{k}" for k in ks], "erratum"]:
        c = base.fork()
        rep = c.edit(fact.id, edit.value, mode=arm)
        d = c.decide(list(cands.values()))
        runs[arm] = (c, d.logprobs, rep.cost, rep.applied)
    full_ctx = runs["full"][0]
    _, _, whole_new = memory_texts(suite, persona, prompt, fact.id, edit.value)
    chunked = EditableContext(model, tokenizer, seam=seam, **kw)
    chunked.add_text(head).add_chunk(whole_new).add_request(question)
    cost = chunked.prefill(compose_chunks=True)
    runs["recompile_chunk"] = (chunked, chunked.decide(list(cands.values())).logprobs, cost, f"recompile_chunk@seam={seam}")
    firsts = mem.first_tokens(tokenizer, full_ctx, cands)
    tq = mem.TokQuery(q.id, full_ctx.layout.ids, firsts, edit.answer, tuple(q.uses))
    lp_full, full_cost = runs["full"][1], runs["full"][2]
    row = mem.reference(lp_full, prompt, tq, fact=fact.id, old=fact.value, new=edit.value, old_answer=q.answer,
                        base_tokens=float(base_cost.tokens), base_s=float(base_cost.seconds))
    row["prompt_tokens"] = int(full_ctx.layout.length)
    for arm, (c, lp, cst, applied) in runs.items():
        if arm == "full":
            continue
        out[arm] = mem.compare(lp_full, lp, tq) | {
            "tokens": float(cst.tokens), "seconds": float(cst.seconds), "applied": applied,
            "token_ratio": float(cst.tokens) / float(full_cost.tokens), "time_ratio": float(cst.seconds) / float(full_cost.seconds)}
    out["recompile_chunk"]["same_tokens"] = bool(torch.equal(chunked.layout.ids, full_ctx.layout.ids))
    row["arms"] = out
    row["full_tokens"], row["full_s"] = float(full_cost.tokens), float(full_cost.seconds)
    return row


def aggregate(rows: list[dict], names: list[str], cfg, seed: int) -> tuple[dict, dict, dict]:
    """Per length: :func:`kvnotes.harness.memory.arm_summary` of each arm plus its mean cost
    (tokens, seconds, ratios to ``full``) and ``applied`` counts; the paired tests per
    ``"<L>/<arm>"`` cell and BH over them."""
    agg, tests = {}, {}
    for L in dict.fromkeys(r["length"] for r in rows):
        rs = [r for r in rows if r["length"] == L]
        per = {}
        for a in names:
            s = mem.arm_summary(rs, a, cfg.n_boot, seed)
            for k in ("tokens", "seconds", "token_ratio", "time_ratio"):
                s[f"{k}_mean"] = sum(r["arms"][a][k] for r in rs) / len(rs)
            s["applied"] = dict(Counter(r["arms"][a]["applied"] for r in rs))
            per[a] = s
            tests[f"{L}/{a}"] = mem.paired_tests(rs, a, cfg.alpha, cfg.margin_accuracy,
                                                 cfg.margin_kl)
        agg[str(L)] = {"arms": per, "n": len(rs), "full_tokens_mean": sum(r["full_tokens"] for r in rs) / len(rs),
                       "full_s_mean": sum(r["full_s"] for r in rs) / len(rs),
                       "stale_owned_old": sum(r["arms"]["stale"]["choice"] == r["old_answer"] for r in rs)}
    return agg, tests, mem.adjust(tests, cfg.alpha)


def run(ctx) -> dict:
    """E3 over every persona, length and (up to ``max_edits_per_persona``) edit; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    suite = mem.load_suite(cfg)
    names = arm_names([int(k) for k in cfg.ks])
    tk = dict(ctx.template_kwargs) or None          # the model's chat-template arguments, thinking switch applied
    jobs = [(L, p, e) for L in cfg.lengths for p in suite.personas for e in p.edits[:cfg.max_edits_per_persona]]
    rows = []
    for L, persona, edit in units(ctx, jobs, "memory_edits"):
        with ctx.timer("render"):
            prompt = mem.build_prompt(tok, suite, persona, int(L), cfg.seed, chat_template=cfg.chat_template,
                                      template_kwargs=tk)
        with ctx.timer("edits"):
            rows.append(edit_session(model, tok, suite, persona, prompt, edit, [int(k) for k in cfg.ks],
                                     cfg.recompile_seam, cfg.chat_template, tk))
    with ctx.timer("statistics"):
        agg, tests, adjusted = aggregate(rows, names, cfg, ctx.seed)
    checks = {"recompile_same_tokens": sum(r["arms"]["recompile_chunk"]["same_tokens"] for r in rows), "n_rows": len(rows)}
    return {"rows": rows, "aggregates": agg, "tests": tests, "bh": adjusted, "arm_names": names, "checks": checks,
            "exclusions": {}, "excluded": [],
            "settings": mem.settings(cfg, suite, ks=[int(k) for k in cfg.ks], recompile_seam=cfg.recompile_seam,
                                     max_edits_per_persona=cfg.max_edits_per_persona)}


def memory_edits_table(rec: dict) -> str:
    """E3: per length and arm, agreement with the full re-prefill, KL, cost and the paired tests."""
    w = Lines()
    res = rec["result"]
    w(memory_settings(rec))
    w(f"recompile_chunk had the full prompt's exact tokens in {res['checks']['recompile_same_tokens']}/"
      f"{res['checks']['n_rows']} rows\n")
    w(MEMORY_HEAD + " tokens / full | time / full | applied |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            w(f"| {L} | {arm} | {arm_cells(s, res['tests'][f'{L}/{arm}'])} | {s['token_ratio_mean']:.4f} | "
              f"{s['time_ratio_mean']:.3f} | "
              f"{fmt_counts(s['applied'])} |")
    w("\n| memory | full re-prefill tokens | full re-prefill s | stale arm still names the old answer |")
    w("|---|---|---|---|")
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['full_tokens_mean']:.0f} | {a['full_s_mean']:.2f} | {a['stale_owned_old']}/{a['n']} |")
    return w.text()


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Bars("length-agreement", "@/arms/*/top1_agreement", "top-1 agreement with the full re-prefill per memory "
         "length and arm (Wilson 95%)", "agreement"),
    mem.KL_BARS),
    table=memory_edits_table)


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.lengths=[96]", "probe.personas=[maria]", "probe.ks=[4]"), shapes="two")
