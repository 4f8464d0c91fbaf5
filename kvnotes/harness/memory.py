"""The user-memory experiments' shared parts (issue #21 part 2; paper "Models Take Notes at Prefill",
§composition and §editing, external validity): a persona's memory rendered and tokenised at a
target length, decisions read from a cache, per-query rows against the full prefill, and the paired
statistics of an arm against the full prefill.

**Layout.** One prompt is ``[prefix | memory | suffix]``: the chat template up to and including
the header line (live), the memory lines (:func:`kvnotes.scenarios.memory.memory_lines`; each line ``+
"\\n"`` tokenised on its own, so any split at line boundaries has the same tokens as the whole), and
the query with the end of the user turn and the answer prefix (live). The full prefill of exactly
these tokens is the reference of every arm: ``[prefix | memory]`` is prefilled once per persona and
length into an all-slot cache and each query's suffix is forwarded on top (one prefill in two
forwards, the KV-cache computation itself).

**Decisions.** A query's decision is read at the last suffix position: fp32 next-token
log-probs over the vocabulary. The full prefill *owns* a query when its vocabulary top-1 is the
first token of the expected answer's candidate (``docs/design.md``, "Decision ownership"); decision
agreement counts owned queries whose arm has the same vocabulary top-1; top-1 agreement counts all
queries; ``kl`` is KL(full || arm) in nats; ``correct`` is the arm's vocabulary top-1 being the
expected answer's first token.

**Paired statistics** (:func:`paired_tests`, :mod:`kvnotes.harness.paired`): an exact McNemar test
of the arm's correctness against the full prefill's on the same queries; TOST equivalence of the
correctness (margin ``margin_accuracy``, a share) and of KL(full || arm) against 0 (margin
``margin_kl``, nats) over persona clusters; Benjamini-Hochberg over every test of one family in a
record (:func:`adjust`).

Each experiment's own inputs (a neutral document beside the memory, the memory split into
precompiled blocks, the memory text around one fact, the memory as an editable session) live in its
probe module; its specification is its page under ``docs/probes/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import Counts, OpenFraction, PositiveFloat, Share, one_of
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.paired import bh, mcnemar_exact, tost
from kvnotes.harness.stats import proportion, summarize
from kvnotes.records.figures import Bars
from kvnotes.kv.cache import AllSlotCache
from kvnotes.kv.decision import kl_nats
from kvnotes.models.text import render_text, tokenize
from kvnotes.records.schema import TypedDict
from kvnotes.scenarios.memory import MemorySuite, Persona, filler_lines, load_memory, memory_lines


#: The memory probes' KL figure (their presentations): KL(full || arm) per memory length and arm.
KL_BARS = Bars("length-kl", "@/arms/*/kl", "KL(full || arm) per memory length and arm (mean, 95% interval)",
               "KL (nats)", ylog=True)


@dataclass
class MemoryConfig(ProbeConfig):
    """Keys shared by the memory probes (``conf/probe/memory_*.yaml``).

    Attributes:
        suite: the memory suite file (:mod:`kvnotes.scenarios.memory`); ``scenario=memory`` sets it.
        personas: persona ids to keep (None: all).
        lengths: target memory lengths in tokens (the memory chunk; the prompt adds prefix and query).
        seed: filler seed.
        chat_template: render through the model's chat template.
        alpha: level of each test (TOST one-sided tests, McNemar, BH's false discovery rate).
        margin_accuracy: TOST margin on the correctness difference arm - full (a share).
        margin_kl: TOST margin on mean KL(full || arm) (nats).
    """

    pairs: Annotated[str, one_of("none")] = "none"
    suite: str = "scenarios/memory/personas.yaml"
    personas: Any = None
    lengths: Counts = field(default_factory=lambda: [1024, 4096])
    seed: int = 0
    chat_template: bool = True
    alpha: OpenFraction = 0.05
    margin_accuracy: Share = 0.1
    margin_kl: PositiveFloat = 0.05


@dataclass(frozen=True)
class TokQuery:
    """A tokenised query: ``suffix`` ``[q]`` ids (question, end of turn, answer prefix), the first
    token of each candidate (answer key -> id), the expected answer and the facts it uses."""

    id: str
    suffix: torch.Tensor
    firsts: dict[str, int]
    answer: str
    uses: tuple[str, ...]

    @property
    def cross(self) -> bool:
        return len(self.uses) > 1

    @property
    def answer_first(self) -> int:
        return self.firsts[self.answer]


@dataclass(frozen=True)
class MemoryPrompt:
    """A persona's prompt at one length (module docstring, "Layout").

    Attributes:
        persona: persona id.
        target: the target memory length (tokens).
        prefix: ``[p]`` live prefix ids (BOS first when the tokenizer has one).
        entries: per memory line its ``[n_i]`` ids.
        facts: per memory line the fact id, or None for filler.
        n_filler: filler lines used.
        queries: tokenised queries by id.
        excluded: ``{query, reason}`` of queries that cannot be read (a candidate merging with the
            answer prefix, two candidates sharing a first token).
    """

    persona: str
    target: int
    prefix: torch.Tensor
    entries: tuple[torch.Tensor, ...]
    facts: tuple[str | None, ...]
    n_filler: int
    queries: dict[str, TokQuery]
    excluded: tuple[dict, ...] = ()

    @property
    def memory(self) -> torch.Tensor:
        """``[M]`` the memory's ids (every line)."""
        return torch.cat(self.entries)

    @property
    def start(self) -> int:
        """Position of the memory's first token (= prefix length)."""
        return int(self.prefix.shape[0])

    @property
    def base(self) -> torch.Tensor:
        """``[p + M]`` prefix and memory ids (what is cached before a query)."""
        return torch.cat([self.prefix, self.memory])

    def offsets(self) -> list[int]:
        """Token offset of each line inside the memory, plus the memory length at the end."""
        out = [0]
        for e in self.entries:
            out.append(out[-1] + int(e.shape[0]))
        return out

    def line_of(self, fact: str) -> int:
        """Index of the line holding ``fact``."""
        return self.facts.index(fact)


def load_suite(cfg) -> MemorySuite:
    """The memory suite of a probe config (``suite``, ``personas``)."""
    personas = getattr(cfg, "personas", None)
    return load_memory(str(cfg.suite), None if personas is None else list(personas))   # [] is refused there


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def build_prompt(tokenizer, suite: MemorySuite, persona: Persona, target: int, seed: int = 0,
                 values: dict[str, str] | None = None, n_filler: int | None = None, chat_template: bool = True,
                 template_kwargs: dict | None = None) -> MemoryPrompt:
    """Render and tokenise ``persona``'s prompt with a memory of at least ``target`` tokens.

    Filler lines (:func:`kvnotes.scenarios.memory.filler_lines`) are added until facts and filler reach
    ``target`` tokens, unless ``n_filler`` fixes their number (an edited memory keeps its base's
    filler so only the edited fact's tokens differ).

    Args:
        values: fact id -> value (an edit).

    Raises:
        KvnotesError: ``target`` < 1, or a chat template that alters the user message.
    """
    if target < 1:
        raise KvnotesError(f"memory length must be >= 1 token, got {target}")
    fact_tokens = sum(len(_ids(tokenizer, f.render((values or {}).get(f.id)) + "\n")) for f in persona.facts)
    if n_filler is None:
        stream = filler_lines(suite, persona.id, max(8, target // 6))
        lengths = [len(x) for x in tokenizer([s + "\n" for s in stream], add_special_tokens=False)["input_ids"]]
        total, n_filler = fact_tokens, 0
        while total < target:
            if n_filler == len(lengths):                        # lines shorter than 6 tokens: draw more
                stream = filler_lines(suite, persona.id, 2 * len(stream))
                lengths = [len(x) for x in tokenizer([s + "\n" for s in stream], add_special_tokens=False)["input_ids"]]
            total += lengths[n_filler]
            n_filler += 1
    lines = memory_lines(persona, filler_lines(suite, persona.id, n_filler), values)
    memory = "".join(line + "\n" for line, _ in lines)
    head = suite.header + "\n"
    prefix_ids = None
    queries, excluded = {}, []
    for q in persona.queries:
        user = head + memory + suite.question.format(question=q.question)
        text, at = render_text(tokenizer, user, suite.answer_prefix, chat_template, None, template_kwargs)
        cut, end = at + len(head), at + len(head) + len(memory)
        if prefix_ids is None:
            prefix_ids = tokenize(tokenizer, text[:cut])[0]
        suffix_text = text[end:]
        suffix = _ids(tokenizer, suffix_text)
        firsts, reason = {}, None
        for key, cont in suite.candidates(q).items():
            ids = _ids(tokenizer, suffix_text + cont)
            if len(ids) <= len(suffix) or not torch.equal(ids[:len(suffix)], suffix):
                reason = "candidate_merges_with_answer_prefix"
                break
            firsts[key] = int(ids[len(suffix)])
        if reason is None and len(set(firsts.values())) < len(firsts):
            reason = "candidates_share_first_token"
        if reason:
            excluded.append({"query": q.id, "reason": reason})
            continue
        queries[q.id] = TokQuery(q.id, suffix, firsts, q.answer, tuple(q.uses))
    assert prefix_ids is not None
    entries = tuple(_ids(tokenizer, line + "\n") for line, _ in lines)
    return MemoryPrompt(persona.id, target, prefix_ids, entries, tuple(f for _, f in lines), n_filler, queries,
                        tuple(excluded))


def first_tokens(tokenizer, ctx, cands: dict[str, str]) -> dict[str, int]:
    """Candidate key -> its first token after an :class:`kvnotes.context.EditableContext`'s prompt
    (``cands``: key -> continuation text), as the context's own ``decide`` reads it."""
    n = ctx.layout.length
    return {k: int(tokenize(tokenizer, ctx.text + c)[0][n]) for k, c in cands.items()}


@torch.no_grad()
def read(model, cache: AllSlotCache, pos: int, suffix: torch.Tensor) -> torch.Tensor:
    """Decision log-probs after ``suffix`` on ``cache``.

    Args:
        cache: an all-slot cache of ``B`` rows over at least ``[0, pos)``; it is not modified (the
            forward runs on a view of ``[0, pos)``).
        pos: position of the suffix's first token.
        suffix: ``[q]`` ids, the same for every row.

    Returns:
        fp32 log-softmax ``[B, vocab]`` at the suffix's last position.
    """
    work = cache.truncate(pos)
    B = work.layers[0].keys.shape[0]
    q = int(suffix.shape[0])
    ids = suffix.view(1, -1).expand(B, -1).to(model.device)
    positions = torch.arange(pos, pos + q, device=model.device).unsqueeze(0).expand(B, -1)
    mask = torch.ones(B, pos + q, dtype=torch.long, device=model.device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=work, use_cache=True,
                logits_to_keep=1)
    return torch.log_softmax(out.logits[:, -1].float(), -1).cpu()


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), wall seconds)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def decision(lp: torch.Tensor, query: TokQuery) -> dict:
    """What one run decides on ``query``: vocabulary top-1 id, whether it is the expected answer's
    first token (``correct``), the candidate with the highest log-prob (``choice``) and the expected
    answer's log-prob (nats). ``lp``: fp32 ``[vocab]`` log-probs."""
    keys = list(query.firsts)
    scores = lp[torch.tensor([query.firsts[k] for k in keys])]
    top1 = int(lp.argmax())
    return {"top1": top1, "correct": top1 == query.answer_first, "choice": keys[int(scores.argmax())],
            "answer_logprob": float(lp[query.answer_first])}


def compare(full: torch.Tensor, arm: torch.Tensor, query: TokQuery) -> dict:
    """An arm's decision against the full prefill's on one query (module docstring, "Decisions"):
    ``kl`` = KL(full || arm) in nats, ``top1_agree``, ``correct``, ``choice``, ``answer_logprob``."""
    kl = float(kl_nats(full, arm))
    d = decision(arm, query)
    return {"kl": max(kl, 0.0), "top1_agree": d["top1"] == int(full.argmax()), "correct": d["correct"],
            "choice": d["choice"], "answer_logprob": d["answer_logprob"]}


def reference(full: torch.Tensor, prompt: MemoryPrompt, query: TokQuery, **extra) -> dict:
    """The identifying columns and the full prefill's decision of one row (``owned``: its vocabulary
    top-1 is the expected answer's first token)."""
    d = decision(full, query)
    return {"persona": prompt.persona, "query": query.id, "length": prompt.target,
            "memory_tokens": int(prompt.memory.shape[0]), "prompt_tokens": prompt.start + int(prompt.memory.shape[0])
            + int(query.suffix.shape[0]), "cross": query.cross, "answer": query.answer, "full_top1": d["top1"],
            "owned": d["correct"], "full_choice": d["choice"], "full_answer_logprob": d["answer_logprob"],
            "arms": {}, **extra}


def arm_summary(rows: list[dict], arm: str, n_boot: int, seed: int) -> dict:
    """Decision agreement (owned rows), top-1 agreement (all rows), correctness of arm and full, and
    KL summarised over persona clusters (:func:`kvnotes.harness.stats.summarize`: scenario =
    persona, instance = query)."""
    owned = [r for r in rows if r["owned"]]
    kl = [r["arms"][arm]["kl"] for r in rows]
    return {"n": len(rows), "n_owned": len(owned),
            "decision_agreement": proportion(sum(r["arms"][arm]["top1_agree"] for r in owned), len(owned)),
            "top1_agreement": proportion(sum(r["arms"][arm]["top1_agree"] for r in rows), len(rows)),
            "accuracy": proportion(sum(r["arms"][arm]["correct"] for r in rows), len(rows)),
            "accuracy_full": proportion(sum(r["owned"] for r in rows), len(rows)),
            "kl": summarize(kl, [r["persona"] for r in rows], [r["query"] for r in rows], n_boot, seed)}


def paired_tests(rows: list[dict], arm: str, alpha: float, margin_accuracy: float, margin_kl: float) -> dict:
    """Exact McNemar (arm vs full correctness) and the two TOSTs (module docstring) over ``rows``,
    clusters = personas. A test that cannot run (no rows, one cluster) gives ``{"error": reason}``."""
    a = [bool(r["arms"][arm]["correct"]) for r in rows]
    b = [bool(r["owned"]) for r in rows]
    clusters = [r["persona"] for r in rows]
    out = {}
    for name, fn in (("mcnemar", lambda: mcnemar_exact(a, b)),
                     ("tost_accuracy", lambda: tost([float(x) for x in a], [float(x) for x in b], margin_accuracy,
                                                    clusters, alpha)),
                     ("tost_kl", lambda: tost([r["arms"][arm]["kl"] for r in rows], [0.0] * len(rows), margin_kl,
                                              clusters, alpha))):
        try:
            out[name] = fn()
        except KvnotesError as exc:
            out[name] = {"error": str(exc)}
    return out


def adjust(tests: dict[str, dict], alpha: float) -> dict:
    """Benjamini-Hochberg over every test of each kind in ``tests`` (``{cell: paired_tests(...)}``):
    adds ``q`` and ``reject_bh`` to each test that ran and returns ``{kind: bh(...) | {cells}}``."""
    out = {}
    for kind in ("mcnemar", "tost_accuracy", "tost_kl"):
        cells = [c for c, t in tests.items() if "p" in t.get(kind, {})]
        if not cells:
            continue
        res = bh([tests[c][kind]["p"] for c in cells], alpha)
        for c, q, rej in zip(cells, res["q"], res["reject"], strict=True):
            tests[c][kind].update(q=q, reject_bh=rej)
        out[kind] = res | {"cells": cells}
    return out


def prefill(model, ids: torch.Tensor) -> tuple[AllSlotCache, float]:
    """The all-slot cache of ``ids`` ``[n]`` and the wall seconds it took."""
    return timed(AllSlotCache.prefill, model, ids)


class MemoryRow(TypedDict):
    """One query of one persona at one length (:func:`reference`); ``arms`` maps an arm to
    :func:`compare`'s columns (plus arm-specific ones)."""

    persona: str
    query: str
    length: int
    memory_tokens: int
    prompt_tokens: int
    cross: bool
    answer: str
    full_top1: int
    owned: bool
    full_choice: str
    full_answer_logprob: float
    arms: dict[str, dict[str, Any]]


class MemoryResult(TypedDict):
    """Keys every memory probe returns (``rows`` of :class:`MemoryRow`, ``aggregates``, ``tests`` of
    :func:`paired_tests` per cell with BH in ``bh``, ``exclusions`` / ``excluded`` of unreadable
    queries, ``settings`` the statistical parameters as run)."""

    rows: list[MemoryRow]
    aggregates: dict[str, Any]
    exclusions: dict[str, int]
    excluded: list[dict[str, Any]]
    tests: dict[str, dict[str, Any]]
    bh: dict[str, Any]
    settings: dict[str, Any]


def settings(cfg, suite: MemorySuite, **extra) -> dict:
    """The parameters a memory record states: suite, personas, lengths, test level and margins."""
    return {"suite": suite.source, "suite_id": suite.id, "personas": [p.id for p in suite.personas],
            "lengths": [int(x) for x in cfg.lengths], "seed": int(cfg.seed), "alpha": float(cfg.alpha),
            "margin_accuracy": float(cfg.margin_accuracy), "margin_kl": float(cfg.margin_kl),
            "tests": "mcnemar: exact, arm vs full correctness; tost_accuracy: arm - full correctness within "
                     "+-margin_accuracy over persona means; tost_kl: mean KL(full||arm) within +-margin_kl nats over "
                     "persona means; BH over the cells of each kind", **extra}


def excluded_rows(prompt: MemoryPrompt) -> list[dict]:
    """Exclusion rows (``persona``, ``query``, ``length``, ``reason``) of a prompt's unreadable queries."""
    return [{"persona": prompt.persona, "length": prompt.target, **e} for e in prompt.excluded]


def bos_sink(tokenizer, prompt: MemoryPrompt) -> torch.Tensor | None:
    """The BOS token the memory is precompiled behind (``[1]``), or None when the prompt has none."""
    bos = tokenizer.bos_token_id
    return prompt.prefix[:1] if bos is not None and int(prompt.prefix[0]) == bos else None
