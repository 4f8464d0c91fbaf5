"""``memory_placement`` (E1): does it matter where the user memory sits in a long prompt? Memory
early vs late, by integration depth (issue #21 part 2; paper §composition, external validity).

Specification: ``docs/probes/memory_placement.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness import memory as mem
from kvnotes.harness.kit import units
from kvnotes.harness.constraints import Count
from kvnotes.harness.stats import proportion, summarize
from kvnotes.harness.registry import Conformance
from kvnotes.ops.edit import stack
from kvnotes.records.figures import Bars
from kvnotes.records.memory_tables import kl_cell, memory_settings, tests_cells
from kvnotes.records.tables import Lines, fmt, fmt_kn
from kvnotes.records.presentation import Presentation
from kvnotes.scenarios.memory import MemorySuite, Persona, filler_lines

#: The two placements, in the order of the batch read.
PLACEMENTS = ("early", "late")


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "user-memory personas; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(mem.MemoryConfig):
    """Keys of ``conf/probe/memory_placement.yaml`` (shared keys: :class:`kvnotes.harness.memory.MemoryConfig`).

    Attributes:
        document: target document length in tokens (None: the memory length ``L``); clipped to the
            model's context.
    """

    document: Optional[Count] = None


class Result(mem.MemoryResult):
    placements: list[str]
    costs: list[dict]


def document_entries(tokenizer, suite: MemorySuite, persona: Persona, target: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Per line the ``[n_i]`` ids of a neutral document of at least ``target`` tokens, for
    ``memory_placement`` (``docs/probes/memory_placement.md``); a longer document extends a shorter one."""
    n = max(8, target // 6)
    while True:
        lines = filler_lines(suite, f"{persona.id}/document", n, seed)
        ids = [torch.tensor(x, dtype=torch.long)
               for x in tokenizer([s + "\n" for s in lines], add_special_tokens=False)["input_ids"]]
        total, out = 0, []
        for e in ids:
            if total >= target:
                return tuple(out)
            out.append(e)
            total += int(e.shape[0])
        if total >= target:
            return tuple(out)
        n *= 2


def fit(entries: tuple[torch.Tensor, ...], budget: int) -> tuple[torch.Tensor, ...]:
    """The longest prefix of ``entries`` whose tokens fit ``budget``."""
    out, total = [], 0
    for e in entries:
        if total + int(e.shape[0]) > budget:
            break
        out.append(e)
        total += int(e.shape[0])
    return tuple(out)


def placements(prompt: mem.MemoryPrompt, doc: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{placement: [p + M + D] ids}`` before the query: early = prefix, memory, document; late =
    prefix, document, memory (the same tokens in another order)."""
    return {"early": torch.cat([prompt.prefix, prompt.memory, doc]),
            "late": torch.cat([prompt.prefix, doc, prompt.memory])}


@torch.no_grad()
def place(model, prompt: mem.MemoryPrompt, doc: torch.Tensor) -> tuple[list[dict], dict]:
    """E1 on one prompt and document: both placements prefilled, every query read on each.

    Returns:
        (rows of :func:`kvnotes.harness.memory.reference` with early as the reference and
        ``arms.late`` filled, the cost row ``{persona, length, memory_tokens, document_tokens,
        prefill_s: {placement: s}}``).
    """
    ids = placements(prompt, doc)
    pos = int(ids["early"].shape[0])
    caches, secs = [], {}
    for name in PLACEMENTS:
        cache, secs[name] = mem.prefill(model, ids[name])
        caches.append(cache)
    batch = stack(caches, pos)
    M, D = int(prompt.memory.shape[0]), int(doc.shape[0])
    rows = []
    for q in prompt.queries.values():
        lps = mem.read(model, batch, pos, q.suffix)
        row = mem.reference(lps[0], prompt, q, depth=len(q.uses), document_tokens=D,
                            prompt_tokens=pos + int(q.suffix.shape[0]))
        row["arms"]["late"] = mem.compare(lps[0], lps[1], q)
        rows.append(row)
    cost = {"persona": prompt.persona, "length": prompt.target, "memory_tokens": M, "document_tokens": D,
            "prefill_s": secs}
    return rows, cost


def cell_summary(rows: list[dict], n_boot: int, seed: int) -> dict:
    """One ``length x depth`` cell: :func:`kvnotes.harness.memory.arm_summary` of ``late`` against
    ``early`` plus each placement's accuracy and answer log-prob and the accuracy difference late - early."""
    personas, queries = [r["persona"] for r in rows], [r["query"] for r in rows]
    k_early = sum(r["owned"] for r in rows)
    k_late = sum(r["arms"]["late"]["correct"] for r in rows)
    return {**mem.arm_summary(rows, "late", n_boot, seed),
            "accuracy_early": proportion(k_early, len(rows)), "accuracy_late": proportion(k_late, len(rows)),
            "difference": (k_late - k_early) / len(rows) if rows else None,
            "answer_logprob": {"early": summarize([r["full_answer_logprob"] for r in rows], personas, queries,
                                                  n_boot, seed),
                               "late": summarize([r["arms"]["late"]["answer_logprob"] for r in rows], personas,
                                                 queries, n_boot, seed)}}


def aggregate(rows: list[dict], costs: list[dict], cfg, seed: int) -> tuple[dict, dict, dict]:
    """Per length (key ``"<L>"``) and depth (``by_depth``): :func:`cell_summary`, the paired tests
    (cell ``"<L>/depth=<d>"``) and BH over the cells; plus mean tokens and prefill seconds per length."""
    agg, tests = {}, {}
    for L in dict.fromkeys(r["length"] for r in rows):
        rs = [r for r in rows if r["length"] == L]
        cs = [c for c in costs if c["length"] == L]
        by_depth = {}
        for d in sorted({r["depth"] for r in rs}):
            rd = [r for r in rs if r["depth"] == d]
            by_depth[str(d)] = cell_summary(rd, cfg.n_boot, seed)
            tests[f"{L}/depth={d}"] = mem.paired_tests(rd, "late", cfg.alpha, cfg.margin_accuracy,
                                                       cfg.margin_kl)
        agg[str(L)] = {"by_depth": by_depth,
                       "memory_tokens_mean": sum(c["memory_tokens"] for c in cs) / len(cs),
                       "document_tokens_mean": sum(c["document_tokens"] for c in cs) / len(cs),
                       "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rs) / len(rs),
                       "prefill_s_mean": {p: sum(c["prefill_s"][p] for c in cs) / len(cs) for p in PLACEMENTS}}
    return agg, tests, mem.adjust(tests, cfg.alpha)


def context_of(model) -> int | None:
    """The model's context length (``max_position_embeddings``), or None when it states none."""
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def run(ctx) -> dict:
    """E1 over every persona and length of the suite; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    suite = mem.load_suite(cfg)
    tk = dict(ctx.template_kwargs) or None          # the model's chat-template arguments, thinking switch applied
    limit = context_of(model)
    rows, costs, excluded = [], [], []
    jobs = [(L, p) for L in cfg.lengths for p in suite.personas]
    for L, persona in units(ctx, jobs, "memory_placement"):
        with ctx.timer("render"):
            prompt = mem.build_prompt(tok, suite, persona, int(L), cfg.seed, chat_template=cfg.chat_template,
                                      template_kwargs=tk)
            target = int(cfg.document) if cfg.document else int(L)
            entries = document_entries(tok, suite, persona, target, cfg.seed)
            if limit is not None:
                longest = max((int(q.suffix.shape[0]) for q in prompt.queries.values()), default=0)
                budget = limit - prompt.start - int(prompt.memory.shape[0]) - longest
                entries = fit(entries, budget)
            if not entries:
                raise KvnotesError(f"memory_placement: no room for a document next to a {L}-token memory in a "
                                   f"{limit}-token context")
            doc = torch.cat(entries)
        excluded += mem.excluded_rows(prompt)
        with ctx.timer("placement"):
            rs, cost = place(model, prompt, doc)
        rows += rs
        costs.append(cost)
    with ctx.timer("statistics"):
        agg, tests, adjusted = aggregate(rows, costs, cfg, ctx.seed)
    return {"rows": rows, "aggregates": agg, "tests": tests, "bh": adjusted, "placements": list(PLACEMENTS),
            "costs": costs, "exclusions": dict(Counter(e["reason"] for e in excluded)), "excluded": excluded,
            "settings": mem.settings(cfg, suite, document=cfg.document, context=limit,
                                     reference="early", arm="late",
                                     kl="KL(early||late) at the decision position, nats (descriptive; tost_kl tests "
                                        "it against 0)")}


def memory_placement_table(rec: dict) -> str:
    """E1: per length and integration depth, accuracy with the memory early vs late, the answer's
    log-prob, KL(early‖late) and the paired tests of late against early."""
    w = Lines()
    res = rec["result"]
    w(memory_settings(rec))
    w("Reference = early ([prefix | memory | document | query]), arm = late ([prefix | document | memory | query]); "
      "McNemar b = late right and early wrong, c = the reverse\n")
    w("| memory (tokens) | document | depth (facts) | accuracy early | accuracy late | late − early | "
      "answer log-prob early / late | top-1 agreement | KL(early‖late) mean [95% CI] | McNemar (late vs early) | "
      "TOST accuracy | TOST KL |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for d, s in a["by_depth"].items():
            lp = s["answer_logprob"]
            w(f"| {L} ({a['memory_tokens_mean']:.0f}) | {a['document_tokens_mean']:.0f} | {d} | "
              f"{fmt_kn(s['accuracy_early'])} | {fmt_kn(s['accuracy_late'])} | {fmt(s['difference'], '+.2f')} | "
              f"{fmt(lp['early'].get('mean'), '.2f')} / {fmt(lp['late'].get('mean'), '.2f')} | "
              f"{fmt_kn(s['top1_agreement'])} | {kl_cell(s['kl'])} | {tests_cells(res['tests'][f'{L}/depth={d}'])} |")
    w("\n| memory (tokens) | prompt tokens (mean) | prefill early s | prefill late s |")
    w("|---|---|---|---|")
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['prompt_tokens_mean']:.0f} | {a['prefill_s_mean']['early']:.2f} | "
          f"{a['prefill_s_mean']['late']:.2f} |")
    return w.text()


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Bars("length-accuracy", "@/by_depth/*/[accuracy_early,accuracy_late]", "accuracy with the memory early "
         "and late per memory length and depth (facts) (95% interval)", "accuracy"),),
    table=memory_placement_table)


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.lengths=[96]", "probe.personas=[maria]"), shapes="two")
