"""``memory_transplant`` (E2): is a precompiled user memory spliced into a prompt as good as
prefilling it there? (issue #21 part 2; paper §composition, external validity.)

Specification: ``docs/probes/memory_transplant.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvnotes.harness import memory as mem
from kvnotes.harness.kit import units
from kvnotes.harness.constraints import NonNegatives
from kvnotes.harness.registry import Conformance
from kvnotes.ops import compose as kvcompose
from kvnotes.ops.edit import stack
from kvnotes.records.figures import Bars
from kvnotes.records.memory_tables import MEMORY_HEAD, arm_cells, memory_settings
from kvnotes.records.tables import Lines
from kvnotes.records.presentation import Presentation


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "user-memory personas; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(mem.MemoryConfig):
    """Keys of ``conf/probe/memory_transplant.yaml`` (shared keys: :class:`kvnotes.harness.memory.MemoryConfig`).

    Attributes:
        seams: seam lengths of the rotated arms (the no-rotate control runs at seam 0).
    """

    seams: NonNegatives = field(default_factory=lambda: [0, 1, 4])


class Result(mem.MemoryResult):
    arm_names: list[str]
    costs: list[dict]


def arms_of(seams: list[int]) -> list[tuple[str, bool, int]]:
    """``(name, rotate, seam)`` of every arm: the rotated seams, then the no-rotate control."""
    return [(f"rotate/seam={s}", True, int(s)) for s in seams] + [("no_rotate/seam=0", False, 0)]


@torch.no_grad()
def transplant(model, tokenizer, prompt: mem.MemoryPrompt, arms: list[tuple[str, bool, int]]) -> tuple[list[dict], dict]:
    """E2 on one prompt: the full prefill and every arm, every query read on each.

    Returns:
        (rows of :func:`kvnotes.harness.memory.reference` with ``arms`` filled, the cost row
        ``{persona, length, memory_tokens, full_s, precompile_s, compose_s: {arm: s}}``).
    """
    pos = prompt.start + int(prompt.memory.shape[0])
    full, t_full = mem.prefill(model, prompt.base)
    chunk, t_pre = mem.timed(kvcompose.precompile, model, prompt.memory, mem.bos_sink(tokenizer, prompt))
    caches, t_arm = [], {}
    for name, rotate, seam in arms:
        (cache, _), t_arm[name] = mem.timed(kvcompose.compose, model, [prompt.prefix, chunk], rotate, seam,
                                            all_slots=True)
        caches.append(cache)
    batch = stack([full, *caches], pos)
    rows = []
    for q in prompt.queries.values():
        lps = mem.read(model, batch, pos, q.suffix)
        row = mem.reference(lps[0], prompt, q)
        for i, (name, _, _) in enumerate(arms):
            row["arms"][name] = mem.compare(lps[0], lps[1 + i], q)
        rows.append(row)
    cost = {"persona": prompt.persona, "length": prompt.target, "memory_tokens": int(prompt.memory.shape[0]),
            "full_s": t_full, "precompile_s": t_pre, "compose_s": t_arm}
    return rows, cost


def aggregate(rows: list[dict], costs: list[dict], names: list[str], cfg, seed: int) -> tuple[dict, dict, dict]:
    """Per length (key ``"<L>"``) and arm: :func:`kvnotes.harness.memory.arm_summary`, the paired
    tests (cell ``"<L>/<arm>"``) and BH over the cells; plus the mean costs per length."""
    agg, tests = {}, {}
    for L in dict.fromkeys(r["length"] for r in rows):
        rs = [r for r in rows if r["length"] == L]
        cs = [c for c in costs if c["length"] == L]
        agg[str(L)] = {"arms": {a: mem.arm_summary(rs, a, cfg.n_boot, seed) for a in names},
                       "memory_tokens_mean": sum(c["memory_tokens"] for c in cs) / len(cs),
                       "full_s_mean": sum(c["full_s"] for c in cs) / len(cs),
                       "precompile_s_mean": sum(c["precompile_s"] for c in cs) / len(cs),
                       "compose_s_mean": {a: sum(c["compose_s"][a] for c in cs) / len(cs) for a in names}}
        for a in names:
            tests[f"{L}/{a}"] = mem.paired_tests(rs, a, cfg.alpha, cfg.margin_accuracy,
                                                 cfg.margin_kl)
    return agg, tests, mem.adjust(tests, cfg.alpha)


def run(ctx) -> dict:
    """E2 over every persona and length of the suite; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    suite = mem.load_suite(cfg)
    arms = arms_of(list(cfg.seams))
    names = [a[0] for a in arms]
    tk = dict(ctx.template_kwargs) or None          # the model's chat-template arguments, thinking switch applied
    rows, costs, excluded = [], [], []
    jobs = [(L, p) for L in cfg.lengths for p in suite.personas]
    for L, persona in units(ctx, jobs, "memory_transplant"):
        with ctx.timer("render"):
            prompt = mem.build_prompt(tok, suite, persona, int(L), cfg.seed, chat_template=cfg.chat_template,
                                      template_kwargs=tk)
        excluded += mem.excluded_rows(prompt)
        with ctx.timer("transplant"):
            rs, cost = transplant(model, tok, prompt, arms)
        rows += rs
        costs.append(cost)
    with ctx.timer("statistics"):
        agg, tests, adjusted = aggregate(rows, costs, names, cfg, ctx.seed)
    return {"rows": rows, "aggregates": agg, "tests": tests, "bh": adjusted, "arm_names": names, "costs": costs,
            "exclusions": dict(Counter(e["reason"] for e in excluded)), "excluded": excluded,
            "settings": mem.settings(cfg, suite, seams=[int(s) for s in cfg.seams])}


def memory_transplant_table(rec: dict) -> str:
    """E2: per length and arm, agreement with the full prefill, KL and the paired tests."""
    w = Lines()
    res = rec["result"]
    w(memory_settings(rec))
    w(MEMORY_HEAD)
    w("|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            w(f"| {L} ({a['memory_tokens_mean']:.0f}) | {arm} | {arm_cells(s, res['tests'][f'{L}/{arm}'])} |")
    w("\n| memory (tokens) | full prefill s | precompile (once) s | " + " | ".join(f"splice {a} s" for a in res["arm_names"]) + " |")
    w("|---|---|---|" + "---|" * len(res["arm_names"]))
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['full_s_mean']:.2f} | {a['precompile_s_mean']:.2f} | "
          + " | ".join(f"{a['compose_s_mean'][n]:.3f}" for n in res["arm_names"]) + " |")
    return w.text()


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Bars("length-agreement", "@/arms/*/decision_agreement", "decision agreement with the full prefill per "
         "memory length and arm (owned queries; Wilson 95%)", "agreement"),
    mem.KL_BARS),
    table=memory_transplant_table)


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.lengths=[96]", "probe.personas=[maria]", "probe.seams=[0,1]"), shapes="two")
