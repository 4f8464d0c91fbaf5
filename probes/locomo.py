"""``locomo``: LoCoMo question answering with transplanted conversation memory against a full prefill.

Specification: ``docs/probes/locomo.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import Count, Counts, NonNegative, PositiveFloat, one_of
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.registry import Conformance
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import TypedDict

# ---- LoCoMo QA: a conversation's sessions transplanted as precompiled KV, against a full prefill

#: The conversation header (the live prefix every session chunk is precompiled behind).
HEADER = "A conversation between {a} and {b} over several sessions.\n\n"


#: Separator after each session's text.
SESSION_SEP = "\n\n"


#: The question as appended after the sessions; the answer is read from what the model writes next.
QUESTION = "Question: {q}\nShort answer:"


#: Categories scored by default (5 is adversarial: its gold is "not mentioned", not a fact).
DEFAULT_CATEGORIES = (1, 2, 3, 4)


def _encode(tokenizer, text: str, special: bool = False) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=special), dtype=torch.long)


def _answer_text(tokenizer, ids: Sequence[int]) -> str:
    """The first line of the decoded chain, stripped."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True).strip()
    return text.split("\n")[0].strip()


def _kept_sessions(lengths: Sequence[int], budget: int) -> int:
    """How many of the latest sessions fit ``budget`` tokens (sessions are kept whole)."""
    total, k = 0, 0
    for n in reversed(lengths):
        if total + n > budget:
            break
        total, k = total + n, k + 1
    return k


def _arm(tokenizer, gold: str, chain) -> dict:
    from kvnotes.scenarios.locomo import contains, token_f1

    answer = _answer_text(tokenizer, chain.ids)
    return {"answer": answer, "f1": token_f1(answer, gold), "contains": contains(answer, gold),
            "stopped": chain.stopped, "new_tokens": chain.length}


@torch.no_grad()
def run_locomo_qa(model, tokenizer, samples, max_questions: int | None = None, max_new_tokens: int = 32,
                  categories: Sequence[int] = DEFAULT_CATEGORIES, max_context: int | None = None,
                  rotate: bool = True, seam: int = 0, margin: float = 0.05, stop_ids: Sequence[int] | None = None,
                  log: Callable[[str], None] | None = None) -> dict:
    """Answer LoCoMo questions from composed session caches and from a full prefill.

    Args:
        model: a causal LM (``eval()``; any architecture :func:`kvnotes.ops.compose.compose` takes).
        tokenizer: its tokenizer (``encode(text, add_special_tokens=)``, ``decode(ids,
            skip_special_tokens=)``).
        samples: :class:`kvnotes.scenarios.locomo.LocomoSample` list (:func:`kvnotes.scenarios.locomo.load_locomo`).
        max_questions: most questions in all (in file order); None for every question.
        max_new_tokens: most answer tokens per arm.
        categories: question categories kept.
        max_context: most tokens of a prompt plus its answer; default the model's
            ``max_position_embeddings``.
        rotate: rotate the chunks' keys into place (False: the no-rotate control).
        seam: tokens of each chunk recomputed against the real prefix (seam repair).
        margin: the declared TOST margin on the per-question F1 difference (composed - full).
        stop_ids: end tokens; default :func:`kvnotes.kv.generate.stop_tokens` of the tokenizer.
        log: where truncation messages go (default stderr).

    Returns:
        ``{"records": [...], "summary": {...}}``: one record per question (``sample_id``,
        ``qa_index``, ``category``, ``question``, ``gold``, ``sessions_kept``, ``prompt_tokens``,
        ``composed`` and ``full`` each ``{answer, f1, contains, stopped, new_tokens}``,
        ``first_step`` ``{kl, max_abs_diff, top1_agree}`` on the first answer token's log-probs,
        ``same_answer``) and the summary of :func:`summarize_qa`.

    Raises:
        KvnotesError: from :func:`kvnotes.ops.compose.compose` (a rope type without delta rotation).
    """
    from kvnotes.kv import cache as kvcache
    from kvnotes.kv.generate import generate, stop_tokens, text_marker
    from kvnotes.ops.chunk import precompile
    from kvnotes.ops.compose import compose, decision_metrics
    from kvnotes.scenarios.locomo import render_session

    log = log or (lambda msg: print(msg, file=sys.stderr))
    config = model.config.get_text_config(decoder=True)
    max_context = int(max_context or config.max_position_embeddings)
    stops = stop_tokens(tokenizer) if stop_ids is None else list(stop_ids)
    newline = text_marker(tokenizer, "\n")
    records: list[dict] = []
    for sample in samples:
        qas = [(i, qa) for i, qa in enumerate(sample.qa) if qa.category in categories]
        if max_questions is not None:
            qas = qas[:max(0, max_questions - len(records))]
        if not qas:
            continue
        conv = sample.conversation
        header = _encode(tokenizer, HEADER.format(a=conv.speaker_a, b=conv.speaker_b), special=True)
        sessions = list(conv.sessions.values())
        texts = [_encode(tokenizer, render_session(s) + SESSION_SEP) for s in sessions]
        chunks: dict[int, object] = {}                     # precompiled once per session, when first used
        warned = False
        for qi, qa in qas:
            q_ids = _encode(tokenizer, QUESTION.format(q=qa.question))
            budget = max_context - len(header) - len(q_ids) - max_new_tokens
            k = _kept_sessions([len(t) for t in texts], budget)
            if k == 0:
                log(f"locomo: sample {sample.sample_id} question {qi}: not even the last session fits the "
                    f"context of {max_context} tokens; skipped")
                continue
            if k < len(sessions) and not warned:
                log(f"locomo: sample {sample.sample_id}: {len(sessions)} sessions, "
                    f"{sum(len(t) for t in texts)} tokens; kept the last {k} session(s) to fit the context of "
                    f"{max_context} tokens (--max-context)")
                warned = True
            kept = range(len(sessions) - k, len(sessions))
            for j in kept:
                if j not in chunks:
                    chunks[j] = precompile(model, texts[j], sink_ids=header)
            ids = torch.cat([header, *(texts[j] for j in kept), q_ids])
            d = len(ids) - 1                                # the last question token is fed to generate
            composed, _ = compose(model, [header, *(chunks[j] for j in kept), q_ids[:-1]], rotate=rotate,
                                  seam=seam, static=False)
            full = kvcache.prefill(model, ids[:d])
            first = {arm: generate(model, c, ids[d], d, 0).logprobs for arm, c in (("composed", composed),
                                                                                   ("full", full))}
            chains = {arm: generate(model, c, ids[d], d, max_new_tokens, newline, stops).chains[0]
                      for arm, c in (("composed", composed), ("full", full))}
            m = decision_metrics(first["full"], first["composed"])
            arms = {arm: _arm(tokenizer, qa.gold, chains[arm]) for arm in ("composed", "full")}
            records.append({
                "sample_id": sample.sample_id, "qa_index": qi, "category": qa.category, "question": qa.question,
                "gold": qa.gold, "sessions_kept": [sessions[j].index for j in kept], "prompt_tokens": len(ids),
                **arms,
                "first_step": {"kl": float(m["kl"][0]), "top1_agree": bool(m["top1_agree"][0]),
                               "max_abs_diff": float((first["full"] - first["composed"]).abs().max())},
                "same_answer": arms["composed"]["answer"] == arms["full"]["answer"]})
        if max_questions is not None and len(records) >= max_questions:
            break
    config_out = {"max_new_tokens": max_new_tokens, "categories": list(categories), "max_context": max_context,
                  "rotate": rotate, "seam": seam, "margin": margin}
    return {"records": records, "summary": summarize_qa(records, margin), "config": config_out}


def summarize_qa(records: Sequence[dict], margin: float = 0.05) -> dict:
    """The arms' scores and their paired comparison.

    Returns:
        ``{n_questions, n_samples, arms: {composed, full}: {f1_mean, contains: {k, n, p, ci}},
        same_answer: {k, n, p, ci}, first_step_kl: summarize(...) (nats, clusters = samples),
        mcnemar: mcnemar_exact(composed contains, full contains) or None, f1_tost: tost(composed f1,
        full f1, margin, clusters = samples) or {"skipped": reason}}``.
    """
    from kvnotes.errors import KvnotesError
    from kvnotes.harness.paired import mcnemar_exact, tost
    from kvnotes.harness.stats import proportion, summarize

    n = len(records)
    out: dict = {"n_questions": n, "n_samples": len({r["sample_id"] for r in records})}
    out["arms"] = {arm: {"f1_mean": (sum(r[arm]["f1"] for r in records) / n) if n else None,
                         "contains": proportion(sum(r[arm]["contains"] for r in records), n)}
                   for arm in ("composed", "full")}
    out["same_answer"] = proportion(sum(r["same_answer"] for r in records), n)
    clusters = [r["sample_id"] for r in records]
    out["first_step_kl"] = summarize([r["first_step"]["kl"] for r in records], clusters,
                                     [r["qa_index"] for r in records])
    out["mcnemar"] = mcnemar_exact([r["composed"]["contains"] for r in records],
                                   [r["full"]["contains"] for r in records]) if n else None
    try:
        out["f1_tost"] = tost([r["composed"]["f1"] for r in records], [r["full"]["f1"] for r in records], margin,
                              clusters=clusters)
    except KvnotesError as exc:
        out["f1_tost"] = {"skipped": str(exc)}
    return out


def format_summary(result: dict, name: str = "model") -> str:
    """The printed report of :func:`kvnotes.probes.locomo.run_locomo_qa`'s result."""
    s, c = result["summary"], result["config"]
    lines = [f"# locomo QA: {name}; {s['n_questions']} question(s) from {s['n_samples']} conversation(s), "
             f"categories {','.join(map(str, c['categories']))}; composed = session chunks "
             f"{'rotated' if c['rotate'] else 'NOT rotated'} into place (seam {c['seam']}) vs full prefill; "
             f"greedy, <= {c['max_new_tokens']} new tokens, context <= {c['max_context']}"]
    if not s["n_questions"]:
        return "\n".join(lines + ["no questions answered"])
    lines.append(f"{'arm':<10} {'F1':>6}   contains (95% Wilson)")
    for arm in ("composed", "full"):
        a = s["arms"][arm]
        ci = a["contains"]["ci"]
        lines.append(f"{arm:<10} {a['f1_mean']:6.3f}   {a['contains']['k']}/{a['contains']['n']} = "
                     f"{a['contains']['p']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]")
    kl = s["first_step_kl"]
    lines.append(f"same answer {s['same_answer']['k']}/{s['same_answer']['n']}; first-step KL(full || composed) "
                 f"mean {kl['mean']:.3g} nats, median {kl['median']:.3g} ({kl['n_scenarios']} conversation cluster(s))")
    mc = s["mcnemar"]
    lines.append(f"exact McNemar on containment: {mc['b']} composed-only right, {mc['c']} full-only right, "
                 f"p = {mc['p']:.3g}")
    t = s["f1_tost"]
    if "skipped" in t:
        lines.append(f"TOST on F1 (margin {c['margin']}): skipped ({t['skipped']})")
    else:
        lines.append(f"TOST on F1 (margin {t['margin']}, {t['n_clusters']} conversation clusters): mean difference "
                     f"{t['mean_diff']:+.3f}, {t['ci_level']:.0%} CI [{t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}], "
                     f"p = {t['p']:.3g}, equivalent: {'yes' if t['equivalent'] else 'no'}")
    return "\n".join(lines)


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "LoCoMo conversations; every non-role word is <unk> to the planted tokenizer"

@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/locomo.yaml`` (see the specification).

    Attributes:
        data: the LoCoMo file; ``scenario.locomo`` sets it (a scenario input of the record).
        max_questions: most questions in all, in file order (None: every one).
        max_new_tokens: most answer tokens per arm.
        categories: question categories scored (5 is adversarial: its gold is "not mentioned").
        max_context: most tokens of a prompt plus its answer (None: the model's ``max_position_embeddings``).
        seam: tokens of each chunk recomputed against the real prefix (seam repair).
        rotate: rotate the chunks' keys into place (false: the no-rotate control).
        margin: the declared TOST margin on the per-question F1 difference (composed - full).
    """

    #: no gated-decision pairs: the LoCoMo file is the data
    pairs: Annotated[str, one_of("none")] = "none"
    data: Optional[str] = None
    max_questions: Optional[Count] = None
    max_new_tokens: Count = 32
    categories: Counts = field(default_factory=lambda: list(DEFAULT_CATEGORIES))
    max_context: Optional[Count] = None
    seam: NonNegative = 0
    rotate: bool = True
    margin: PositiveFloat = 0.05


class Result(TypedDict):
    """What ``run`` returns (record ``result``): one row per question (keys of the records of
    :func:`kvnotes.probes.locomo.run_locomo_qa`), the summary of
    :func:`kvnotes.probes.locomo.summarize_qa` as ``aggregates``, the settings as run."""

    rows: list[dict[str, Any]]
    aggregates: dict[str, Any]
    exclusions: dict[str, int]
    excluded: list[dict[str, Any]]
    config: dict[str, Any]


def run(ctx) -> dict:
    """Answer the questions of the scenario's LoCoMo file on both arms (see the specification).

    Raises:
        KvnotesError: no LoCoMo file (``scenario.locomo``).
        ScenarioError: a malformed LoCoMo file.
    """
    from kvnotes.scenarios.locomo import load_locomo
    from kvnotes.scenarios.schema import resolve_path

    cfg = ctx.cfg
    if not cfg.data:
        raise KvnotesError("probe locomo reads a LoCoMo file: scenario=locomo scenario.locomo=PATH "
                           "(LoCoMo's data/locomo10.json; not shipped)")
    samples = load_locomo(resolve_path(str(cfg.data)))
    res = run_locomo_qa(ctx.bundle.model, ctx.bundle.tokenizer, samples, cfg.max_questions, cfg.max_new_tokens,
                        tuple(cfg.categories), cfg.max_context, cfg.rotate, cfg.seam, cfg.margin)
    return {"rows": res["records"], "aggregates": res["summary"], "exclusions": {}, "excluded": [],
            "config": res["config"]}


def locomo_table(rec: dict) -> str:
    """A locomo record's report (:func:`format_summary`)."""
    res = rec["result"]
    return format_summary({"summary": res["aggregates"], "config": res["config"]}, rec["model"]["name"])


#: How this probe's records are shown (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(table=locomo_table)


#: Not run by the zoo conformance lane: its data is a LoCoMo file the lane does not ship (its splice is
#: compose's, which runs on every entry; tests/probes/test_locomo.py runs it on tiny Llama and Gemma-3
#: models and the embedded one) (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(shapes="none")
