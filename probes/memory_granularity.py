"""``memory_granularity`` (E4): the user memory split into ``S`` independently precompiled blocks
(issue #21 part 2; paper §composition, external validity).

Specification: ``docs/probes/memory_granularity.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness import memory as mem
from kvnotes.harness.kit import units
from kvnotes.harness.constraints import Counts, NonNegative
from kvnotes.harness.paired import mcnemar_exact
from kvnotes.harness.stats import proportion
from kvnotes.harness.registry import Conformance
from kvnotes.ops import compose as kvcompose
from kvnotes.ops.edit import stack
from kvnotes.records.figures import Curves
from kvnotes.records.memory_tables import MEMORY_HEAD, arm_cells, memory_settings
from kvnotes.records.tables import Lines, fmt, fmt_kn
from kvnotes.records.presentation import Presentation


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "user-memory personas; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(mem.MemoryConfig):
    """Keys of ``conf/probe/memory_granularity.yaml`` (shared keys: :class:`kvnotes.harness.memory.MemoryConfig`).

    Attributes:
        blocks: the block counts ``S``.
        seam: tokens of each block recomputed against what precedes it.
        lengths: target memory lengths (one, 2048 tokens, by default: [4096] costs ~14 min of CPU).
    """

    lengths: Counts = field(default_factory=lambda: [2048])
    blocks: Counts = field(default_factory=lambda: [1, 2, 4, 8, 16])
    seam: NonNegative = 0


class Result(mem.MemoryResult):
    edit_rows: list[dict]
    cross_rows: list[dict]
    costs: list[dict]


def partition(offsets: list[int], S: int) -> list[tuple[int, int]]:
    """``S`` contiguous line ranges ``[i, j)`` of about equal token count.

    Args:
        offsets: line token offsets and the total at the end
            (:meth:`kvnotes.harness.memory.MemoryPrompt.offsets`), ``n_lines + 1`` values.
        S: number of blocks, ``1 <= S <= n_lines``.

    Returns:
        the ranges; boundary ``k`` is the first line starting at or after ``k * M / S`` tokens (moved
        on when two boundaries would coincide).

    Raises:
        KvnotesError: ``S`` outside ``[1, n_lines]``.
    """
    n = len(offsets) - 1
    if not 1 <= S <= n:
        raise KvnotesError(f"cannot split {n} memory lines into {S} blocks")
    M = offsets[-1]
    cuts = [0]
    for k in range(1, S):
        c = next(i for i in range(1, n + 1) if offsets[i] >= k * M / S)
        c = min(max(c, cuts[-1] + 1), n - (S - k))
        cuts.append(c)
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


def cross_variants(blocks: list[tuple[int, int]], a: int, b: int) -> dict[str, list[tuple[int, int]]]:
    """The ``together`` and ``split`` partitions for adjacent lines ``a < b = a + 1``, each with
    ``len(blocks)`` blocks (``memory_granularity``, ``docs/probes/memory_granularity.md``)."""
    cuts = [i for i, _ in blocks][1:]
    if b in cuts:
        together = [c if c != b else b + 1 for c in cuts]
        split = cuts
    else:
        near = min(range(len(cuts)), key=lambda k: abs(cuts[k] - b))
        together, split = cuts, sorted(cuts[:near] + [b] + cuts[near + 1:])
    n = blocks[-1][1]

    def ranges(cs):
        cs = sorted(set(c for c in cs if 0 < c < n))
        return list(zip([0, *cs], [*cs, n]))
    return {"together": ranges(together), "split": ranges(split)}


class Blocks:
    """Precompiled blocks of one prompt, keyed by line range (each precompiled once)."""

    def __init__(self, model, prompt: mem.MemoryPrompt, sink: torch.Tensor | None) -> None:
        self.model, self.prompt, self.sink = model, prompt, sink
        self.store: dict[tuple[int, int], kvcompose.Chunk] = {}
        self.cost: dict[tuple[int, int], tuple[int, float]] = {}      # (tokens forwarded, seconds) per block
        self.tokens, self.seconds = 0, 0.0

    def get(self, i: int, j: int) -> kvcompose.Chunk:
        if (i, j) not in self.store:
            ids = torch.cat(self.prompt.entries[i:j])
            self.store[(i, j)], t = mem.timed(kvcompose.precompile, self.model, ids, self.sink)
            n = int(ids.shape[0]) + (0 if self.sink is None else int(self.sink.shape[0]))
            self.cost[(i, j)] = (n, t)
            self.tokens += n
            self.seconds += t
        return self.store[(i, j)]

    def compose(self, ranges: list[tuple[int, int]], seam: int):
        """The all-slot cache of ``[prefix | blocks]`` and the splice's wall seconds."""
        parts = [self.prompt.prefix, *[self.get(i, j) for i, j in ranges]]
        (cache, _), t = mem.timed(kvcompose.compose, self.model, parts, True, seam, all_slots=True)
        return cache, t


def with_answer(prompt: mem.MemoryPrompt, query: str, answer: str) -> mem.MemoryPrompt:
    """``prompt`` whose query ``query`` expects ``answer`` (after an edit)."""
    q = prompt.queries[query]
    return mem.MemoryPrompt(prompt.persona, prompt.target, prompt.prefix, prompt.entries, prompt.facts, prompt.n_filler,
                        {**prompt.queries, query: mem.TokQuery(q.id, q.suffix, q.firsts, answer, q.uses)}, prompt.excluded)


def _read_all(model, prompt: mem.MemoryPrompt, caches: list) -> dict[str, torch.Tensor]:
    pos = prompt.start + int(prompt.memory.shape[0])
    batch = stack(caches, pos)
    return {q.id: mem.read(model, batch, pos, q.suffix) for q in prompt.queries.values()}


@torch.no_grad()
def granularity(model, tokenizer, prompt: mem.MemoryPrompt, Ss: list[int], seam: int,
                edited: mem.MemoryPrompt | None = None, fact: str | None = None) -> dict:
    """E4 on one prompt (the specification).

    Args:
        edited: the prompt with the edited fact (same filler), or None for no edit measurement.
        fact: the edited fact's id.

    Returns:
        ``{rows, edit_rows, cross_rows, cost}``.
    """
    sink = mem.bos_sink(tokenizer, prompt)
    full, t_full = mem.prefill(model, prompt.base)
    store = Blocks(model, prompt, sink)
    offs = prompt.offsets()
    parts = {S: partition(offs, S) for S in Ss}
    cost: dict = {"persona": prompt.persona, "length": prompt.target, "memory_tokens": int(prompt.memory.shape[0]),
                  "full_s": t_full, "full_tokens": int(prompt.base.shape[0]), "by_S": {}}
    caches = []
    for S in Ss:
        tok0, sec0 = store.tokens, store.seconds
        cache, t = store.compose(parts[S], seam)
        caches.append(cache)
        cost["by_S"][str(S)] = {"precompile_tokens": store.tokens - tok0, "precompile_s": store.seconds - sec0,
                                "compose_s": t, "block_tokens_max": max(offs[j] - offs[i] for i, j in parts[S])}
    lps = _read_all(model, prompt, [full, *caches])
    rows = []
    for q in prompt.queries.values():
        row = mem.reference(lps[q.id][0], prompt, q)
        for k, S in enumerate(Ss):
            row["arms"][f"S={S}"] = mem.compare(lps[q.id][0], lps[q.id][1 + k], q)
        rows.append(row)
    del caches
    cross_rows = []
    for q in prompt.queries.values():
        if not q.cross or len(q.uses) != 2:
            continue
        a, b = sorted(prompt.line_of(f) for f in q.uses)
        if b != a + 1:
            continue
        for S in (s for s in Ss if s >= 2):
            variants = cross_variants(parts[S], a, b)
            vc = [store.compose(variants[v], seam)[0] for v in ("together", "split")]
            lp = _read_all(model, prompt, vc)[q.id]
            full_lp = lps[q.id][0]
            row = mem.reference(full_lp, prompt, q, S=S, blocks={v: [list(r) for r in variants[v]] for v in variants})
            row["arms"] = {v: mem.compare(full_lp, lp[i], q) for i, v in enumerate(("together", "split"))}
            cross_rows.append(row)
    edit_rows = []
    if edited is not None and fact is not None:
        full_new, t_new = mem.prefill(model, edited.base)
        new_store = Blocks(model, edited, sink)
        line = edited.line_of(fact)
        caches, costs = [], {}
        for S in Ss:
            for i, j in parts[S]:                       # unchanged blocks: the old precompiled K/V
                if not i <= line < j:
                    new_store.store[(i, j)] = store.get(i, j)
            cache, t = new_store.compose(parts[S], seam)
            caches.append(cache)
            n_block, t_block = new_store.cost[next(r for r in parts[S] if r[0] <= line < r[1])]
            costs[S] = {"edit_tokens": float(n_block + edited.start + S * seam), "edit_s": t_block + t}
        elps = _read_all(model, edited, [full_new, *caches])
        for q in edited.queries.values():
            row = mem.reference(elps[q.id][0], edited, q, fact=fact, full_tokens=int(edited.base.shape[0]), full_s=t_new)
            for k, S in enumerate(Ss):
                row["arms"][f"S={S}"] = mem.compare(elps[q.id][0], elps[q.id][1 + k], q) | {
                    **costs[S], "token_ratio": costs[S]["edit_tokens"] / int(edited.base.shape[0]),
                    "time_ratio": costs[S]["edit_s"] / t_new}
            edit_rows.append(row)
    return {"rows": rows, "edit_rows": edit_rows, "cross_rows": cross_rows, "cost": cost}


def _cross_summary(rows: list[dict]) -> dict:
    out: dict = {}
    for v in ("together", "split"):
        out[v] = {"top1_agreement": proportion(sum(r["arms"][v]["top1_agree"] for r in rows), len(rows)),
                  "accuracy": proportion(sum(r["arms"][v]["correct"] for r in rows), len(rows)),
                  "kl_mean": sum(r["arms"][v]["kl"] for r in rows) / len(rows) if rows else None}
    try:
        out["mcnemar_together_vs_split"] = mcnemar_exact([r["arms"]["together"]["correct"] for r in rows],
                                                         [r["arms"]["split"]["correct"] for r in rows])
    except KvnotesError as exc:
        out["mcnemar_together_vs_split"] = {"error": str(exc)}
    return out


def aggregate(out: dict, Ss: list[int], cfg, seed: int) -> tuple[dict, dict, dict]:
    """Per length: per ``S`` the arm summary and mean costs (``rows``), the edit's summary and mean
    cost (``edit_rows``), the cross-referential summary (pooled and per ``S``); tests per cell and BH."""
    agg, tests = {}, {}
    alpha, ma, mk = cfg.alpha, cfg.margin_accuracy, cfg.margin_kl
    for L in dict.fromkeys(r["length"] for r in out["rows"]):
        rs = [r for r in out["rows"] if r["length"] == L]
        es = [r for r in out["edit_rows"] if r["length"] == L]
        xs = [r for r in out["cross_rows"] if r["length"] == L]
        cs = [c for c in out["costs"] if c["length"] == L]
        a: dict = {"by_S": {}, "edit_by_S": {}, "full_s_mean": sum(c["full_s"] for c in cs) / len(cs),
                   "full_tokens_mean": sum(c["full_tokens"] for c in cs) / len(cs)}
        for S in Ss:
            arm = f"S={S}"
            s = mem.arm_summary(rs, arm, cfg.n_boot, seed)
            for k in ("precompile_tokens", "precompile_s", "compose_s", "block_tokens_max"):
                s[f"{k}_mean"] = sum(c["by_S"][str(S)][k] for c in cs) / len(cs)
            a["by_S"][str(S)] = s
            tests[f"{L}/S={S}"] = mem.paired_tests(rs, arm, alpha, ma, mk)
            if es:
                e = mem.arm_summary(es, arm, cfg.n_boot, seed)
                for k in ("edit_tokens", "edit_s", "token_ratio", "time_ratio"):
                    e[f"{k}_mean"] = sum(r["arms"][arm][k] for r in es) / len(es)
                a["edit_by_S"][str(S)] = e
                tests[f"{L}/edit/S={S}"] = mem.paired_tests(es, arm, alpha, ma, mk)
        a["cross"] = {"pooled": _cross_summary(xs),
                      **{f"S={S}": _cross_summary([r for r in xs if r["S"] == S]) for S in Ss if S >= 2}}
        agg[str(L)] = a
    return agg, tests, mem.adjust(tests, alpha)


def run(ctx) -> dict:
    """E4 over every persona and length; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    suite = mem.load_suite(cfg)
    Ss = [int(s) for s in cfg.blocks]
    tk = dict(ctx.template_kwargs) or None          # the model's chat-template arguments, thinking switch applied
    out: dict = {"rows": [], "edit_rows": [], "cross_rows": [], "costs": []}
    excluded = []
    jobs = [(L, p) for L in cfg.lengths for p in suite.personas]
    for L, persona in units(ctx, jobs, "memory_granularity"):
        with ctx.timer("render"):
            kw = {"chat_template": cfg.chat_template, "template_kwargs": tk}
            prompt = mem.build_prompt(tok, suite, persona, int(L), cfg.seed, **kw)
            edited, fact = None, None
            if persona.edits:
                e = persona.edits[0]
                edited = with_answer(mem.build_prompt(tok, suite, persona, int(L), cfg.seed, {e.fact: e.value},
                                                          prompt.n_filler, **kw), e.query, e.answer)
                fact = e.fact
        excluded += mem.excluded_rows(prompt)
        with ctx.timer("granularity"):
            res = granularity(model, tok, prompt, Ss, cfg.seam, edited, fact)
        for k in ("rows", "edit_rows", "cross_rows"):
            out[k] += res[k]
        out["costs"].append(res["cost"])
    with ctx.timer("statistics"):
        agg, tests, adjusted = aggregate(out, Ss, cfg, ctx.seed)
    return {**out, "aggregates": agg, "tests": tests, "bh": adjusted,
            "exclusions": dict(Counter(e["reason"] for e in excluded)), "excluded": excluded,
            "settings": mem.settings(cfg, suite, blocks=Ss, seam=cfg.seam)}


def memory_granularity_table(rec: dict) -> str:
    """E4: per length and S, composition and localized-edit agreement with full, cost, and the
    cross-referential split."""
    w = Lines()
    res = rec["result"]
    w(memory_settings(rec))
    w(MEMORY_HEAD + " precompile s (all blocks) |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, s in a["by_S"].items():
            w(f"| {L} | S={S} | {arm_cells(s, res['tests'][f'{L}/S={S}'])} | {s['precompile_s_mean']:.2f} |")
    w("\nLocalized edit (only the block holding the changed fact recompiled), against the full re-prefill "
      "of the edited memory:\n")
    w(MEMORY_HEAD + " edit tokens / full | edit time / full |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, s in a["edit_by_S"].items():
            w(f"| {L} | S={S} | {arm_cells(s, res['tests'][f'{L}/edit/S={S}'])} | {s['token_ratio_mean']:.4f} | "
              f"{s['time_ratio_mean']:.3f} |")
    w("\nCross-referential queries (two linked facts) with the facts in one block vs split across two:\n")
    w("| memory | S | together: top-1 agreement | together: accuracy | together: KL mean | split: top-1 agreement "
      "| split: accuracy | split: KL mean | McNemar together vs split |")
    w("|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, c in a["cross"].items():
            t, s, m = c["together"], c["split"], c["mcnemar_together_vs_split"]
            mc = f"b={m['b']}, c={m['c']}, p={m['p']:.3g}" if "p" in m else "n/a"
            w(f"| {L} | {S} | {fmt_kn(t['top1_agreement'])} | {fmt_kn(t['accuracy'])} | {fmt(t['kl_mean'], '.4f')} | "
              f"{fmt_kn(s['top1_agreement'])} | {fmt_kn(s['accuracy'])} | {fmt(s['kl_mean'], '.4f')} | {mc} |")
    return w.text()


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Curves("s-curves-agreement", "@/by_S/#/top1_agreement", "top-1 agreement with full against the number of "
           "blocks S, per memory length (Wilson 95%)", "blocks S", "agreement", xlog=True),
    Curves("s-curves-kl", "@/by_S/#/kl", "KL(full || composed) against the number of blocks S, per memory "
           "length (mean, 95% interval)", "blocks S", "KL (nats)", xlog=True, ylog=True)),
    table=memory_granularity_table)


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.lengths=[96]", "probe.personas=[maria]", "probe.blocks=[1,2]"), shapes="two")
