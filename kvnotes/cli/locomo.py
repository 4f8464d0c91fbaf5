#!/usr/bin/env python
"""LoCoMo question answering with transplanted conversation memory against a full prefill.

    kvnotes locomo --data locomo10.json [--model smollm2-135m] [--max-questions 50] [--json out.json]

The dataset is not shipped: pass a copy of LoCoMo's ``data/locomo10.json``
(https://github.com/snap-research/locomo; format in :mod:`kvnotes.scenarios.locomo`). Everything runs offline.

Per conversation, each session's text is precompiled once as a chunk behind the conversation's
header (the sink: the chunk's keys are at the positions they take after the header). For each
question, two arms answer the same token sequence ``[header, session_1 .. session_N, question]``:

- ``composed``: the session chunks spliced in order with :func:`kvnotes.ops.compose.compose` (keys
  rotated into place, ``--seam`` tokens of each recomputed), the question computed live;
- ``full``: one full prefill of the same tokens.

Both decode greedily (:func:`kvnotes.kv.generate.generate`) until a newline, an end token or
``--max-new-tokens``. Answers are scored against the gold answer by SQuAD token F1 and normalised
containment (:mod:`kvnotes.scenarios.locomo`); the arms are compared on the first-step next-token
log-probs (KL(full || composed) in nats), on whether they give the same answer, by an exact McNemar
test on containment-correctness and by a TOST on F1 over conversation clusters
(:mod:`kvnotes.harness.paired`). The first session's chunk sits where it was precompiled, so with
one session the composed arm equals the full prefill up to float error; later sessions were
precompiled without the sessions before them, which is what the comparison measures.

Context: when a conversation does not fit ``--max-context`` (default: the model's
``max_position_embeddings``) with the question and the answer budget, only its latest sessions that
fit are kept and a line on stderr says how many.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvnotes import CONF_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


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
    """The printed report of :func:`run_locomo_qa`'s result."""
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


def main() -> None:
    """Answer the questions and print the summary (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model, a count below its least value, malformed
            categories) before the model loads; a malformed LoCoMo file, a question that does not fit
            are one line too (exit status 2).
    """
    from kvnotes.cli.errors import conf_name, float_at_least, int_at_least
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    add_machine_flags(ap)
    ap.add_argument("--data", required=True, help="a LoCoMo JSON file (data/locomo10.json of snap-research/locomo)")
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"),
                    help="conf/model entry (default smollm2-135m)")
    ap.add_argument("--max-questions", type=int_at_least("--max-questions", 1), default=None,
                    help="most questions in all (default every one)")
    ap.add_argument("--max-new-tokens", type=int_at_least("--max-new-tokens", 1), default=32,
                    help="most answer tokens per arm")
    ap.add_argument("--categories", default=",".join(map(str, DEFAULT_CATEGORIES)),
                    help="question categories, comma-separated (default 1,2,3,4; 5 is adversarial)")
    ap.add_argument("--max-context", type=int_at_least("--max-context", 1), default=None,
                    help="most prompt + answer tokens (default: the model's max_position_embeddings)")
    ap.add_argument("--seam", type=int_at_least("--seam", 0), default=0, help="chunk tokens recomputed at each seam")
    ap.add_argument("--no-rotate", action="store_true", help="the control: chunk keys keep their precompiled positions")
    ap.add_argument("--margin", type=float_at_least("--margin", 0.0, strict=True), default=0.05,
                    help="declared TOST margin on the F1 difference")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf

    from kvnotes.harness.runconfig import USER_ERRORS
    from kvnotes.models.loading import load_model
    from kvnotes.scenarios.locomo import load_locomo

    try:
        categories = tuple(int(c) for c in args.categories.split(","))
    except ValueError:
        raise KvnotesError(f"--categories: expected comma-separated integers, got '{args.categories}'") from None
    try:
        samples = load_locomo(args.data)
        conf = CONF_DIR / "model" / f"{args.model}.yaml"
        if not conf.is_file():
            raise FileNotFoundError(f"no model config {conf}")
        bundle = load_model(OmegaConf.load(conf), args.device)
        result = run_locomo_qa(bundle.model, bundle.tokenizer, samples, args.max_questions, args.max_new_tokens,
                               categories, args.max_context, not args.no_rotate, args.seam, args.margin)
    except (*USER_ERRORS, FileNotFoundError, ValueError) as exc:
        print(f"kvnotes: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    print(format_summary(result, args.model))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "data": str(args.data), "command": " ".join(sys.argv),
                                               **result}, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
