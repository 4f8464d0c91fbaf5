"""Serving traces for the prefix-cache experiment (paper "Models Take Notes at Prefill", §systems
claim: an appended erratum keeps a serving engine's automatic prefix cache aligned, an in-place
rewrite invalidates every block after the field).

This module builds the multi-turn request traces from the scenario files, the harness's own
full-prefill reference decisions (transformers, same weights) and the aggregates. It never imports
an engine: ``kvnotes serve-bench`` (:mod:`kvnotes.cli.serve_bench`) serves the traces on vLLM and hands the served results back.

Trace layout. Every prompt of a session shares a long *shared document*: the filler sentences of
the suite's scenario files, shuffled by a seeded generator and repeated to ``doc_tokens`` tokens.
The document is split at the field *position*: the part before the field goes into the system
message (shared by every session), the part after it extends the instance's filler, so the field
stands ``early`` (document after it), ``middle`` or ``late`` (document before it) in the same
total length. A session is one scenario instance; its field takes the scenario's values in turn
(turn 0 the first value, turn ``k`` the ``k``-th, cycling) and every turn asks the decision. Arms:

- ``in_place``: the field rewritten where it stands (:func:`kvnotes.harness.edit_prompts.render_layout`, default
  order);
- ``erratum``: the turn-0 prompt kept and one erratum line per update appended before the request
  (:data:`kvnotes.harness.edit_prompts.ERRATUM_TEMPLATE`, placement ``before_request``; updates accumulate);
- ``hoist``: the context line (with the field) moved just before the request
  (:data:`kvnotes.harness.edit_prompts.HOISTED_ORDER`);
- ``cold``: the ``in_place`` prompts served with prefix caching defeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from tqdm import tqdm

from kvnotes.errors import KvnotesError
from kvnotes.harness.stats import proportion
from kvnotes.harness.tokens import Prompt, build_prompt, continuation_ids
from kvnotes.harness.edit_prompts import DEFAULT_ORDER, HOISTED_ORDER, erratum_text, render_layout
from kvnotes.records.presentation import Presentation
from kvnotes.records.tables import serving_table
from kvnotes.scenarios.instances import Instance, draw_instances

ARMS = ("in_place", "erratum", "hoist", "cold")
#: Fraction of the shared document placed before the field.
POSITIONS = {"early": 0.0, "middle": 0.5, "late": 1.0}
SYSTEM_HEADER = "You are a careful assistant. Reference notes:"
CANDIDATE_MERGES = "candidate_merges_with_prompt"


@dataclass(frozen=True)
class Request:
    """One served prompt of a trace.

    Attributes:
        arm, position: the arm (:data:`ARMS`) and the field position (:data:`POSITIONS`).
        session: the session id (the scenario instance id); ``turn``: 0 for the first prompt.
        value: the field value this turn asks about; ``expected``: its outcome's candidate text.
        ids: prompt token ids (what the engine is given, BOS included once).
        field_token: token index of the field value in this prompt (the stale value for ``erratum``).
        candidates: outcome -> first token id of its candidate, tokenised in context.
        expected_token: first token id of the expected candidate.
        plan, salt: how the request is sent through kvnotes' KV connector
            (:func:`kvnotes.serving.store.plan_request`: its ``kv_transfer_params`` and ``cache_salt``),
            or None (a plain request; ``salt`` alone: a full prefill, the prefix cache defeated).
    """

    arm: str
    position: str
    session: str
    scenario: str
    family: str
    turn: int
    value: str
    expected: str
    ids: tuple[int, ...]
    field_token: int
    candidates: dict[str, int] = field(hash=False)
    expected_token: int
    plan: dict | None = field(default=None, hash=False, compare=False)
    salt: str | None = None

    @property
    def key(self) -> tuple:
        return (self.arm, self.position, self.session, self.turn)


def shared_document(scenarios, tokenizer, n_tokens: int, seed: int) -> list[str]:
    """Filler sentences of the scenario files (unique, file order), shuffled with a seeded
    ``numpy`` generator and cycled until they hold at least ``n_tokens`` tokens.

    Raises:
        KvnotesError: the scenarios have no filler sentences.
    """
    pool = list(dict.fromkeys(s for sc in scenarios for s in sc.filler))
    if not pool:
        raise KvnotesError("the selected scenarios have no filler sentences to build a shared document from")
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < n_tokens:
        for i in rng.permutation(len(pool)):
            out.append(pool[i])
            total += len(tokenizer(" " + pool[i], add_special_tokens=False)["input_ids"])
            if total >= n_tokens:
                break
    return out


def place(instance: Instance, document: list[str], position: str) -> Instance:
    """The instance with the shared document split around its field: the part before the field in
    the system message, the rest appended to the instance's filler.

    Raises:
        KvnotesError: unknown position.
    """
    if position not in POSITIONS:
        raise KvnotesError(f"unknown field position '{position}' (known: {', '.join(POSITIONS)})")
    cut = round(POSITIONS[position] * len(document))
    before, after = document[:cut], document[cut:]
    system = " ".join([SYSTEM_HEADER, *before])
    return replace(instance, scenario=replace(instance.scenario, system=system),
                   filler=tuple(instance.filler) + tuple(after))


def _prompt(tokenizer, inst: Instance, value: str, variant: str, order, notice=None,
            template_kwargs=None) -> Prompt:
    user, chars, prefix = render_layout(inst, value, variant, order, notice, "before_request")
    return build_prompt(tokenizer, user, chars, prefix, True, inst.scenario.system, template_kwargs)


def session_values(scenario, turns: int) -> list[str]:
    """The field value of each turn: the scenario's values in file order, cycling."""
    values = list(scenario.values)
    return [values[t % len(values)] for t in range(turns)]


def pick_sessions(scenarios, n_sessions: int, seed: int) -> list[Instance]:
    """``n_sessions`` instances, alternating between families and, within a family, between its
    scenarios (file order); a scenario's ``k``-th use takes its instance ``k``."""
    by_family: dict[str, list] = {}
    for sc in scenarios:
        by_family.setdefault(sc.family, []).append(sc)
    order = []
    for i in range(max(len(v) for v in by_family.values())):
        order.extend(v[i] for v in by_family.values() if i < len(v))
    uses = [order[i % len(order)] for i in range(n_sessions)]
    counts: dict[str, int] = {}
    for sc in uses:
        counts[sc.id] = counts.get(sc.id, 0) + 1
    drawn = {sc.id: draw_instances(sc, counts[sc.id], seed) for sc in order if sc.id in counts}
    seen: dict[str, int] = {}
    out = []
    for sc in uses:
        out.append(drawn[sc.id][seen.get(sc.id, 0)])
        seen[sc.id] = seen.get(sc.id, 0) + 1
    return out


def build_trace(tokenizer, scenarios, n_sessions: int, turns: int, doc_tokens: int, positions, arms,
                seed: int = 0, variant: str = "direct",
                template_kwargs: dict | None = None) -> tuple[list[Request], list[dict]]:
    """Every request of every (arm, position) for the sessions of :func:`pick_sessions`.

    Returns:
        (requests ordered by arm, position, turn, session; exclusions ``{session, arm, position,
        turn, reason}`` for prompts whose candidate merges with the prompt's last token).
    """
    document = shared_document(scenarios, tokenizer, doc_tokens, seed)
    sessions = pick_sessions(scenarios, n_sessions, seed)
    requests, excluded = [], []
    for arm in arms:
        if arm not in ARMS:
            raise KvnotesError(f"unknown arm '{arm}' (known: {', '.join(ARMS)})")
        for pos in positions:
            rows = []
            for base in sessions:
                inst, sc = place(base, document, pos), base.scenario
                values = session_values(sc, turns)
                for t, value in enumerate(values):
                    if arm == "erratum" and t > 0:
                        notice = "\n".join(erratum_text(inst, v) for v in values[1:t + 1])
                        prompt = _prompt(tokenizer, inst, values[0], variant, DEFAULT_ORDER, notice, template_kwargs)
                    else:
                        order = HOISTED_ORDER if arm == "hoist" else DEFAULT_ORDER
                        prompt = _prompt(tokenizer, inst, value, variant, order, None, template_kwargs)
                    cands = {o: continuation_ids(tokenizer, prompt, c) for o, c in sc.candidates.items()}
                    expected = sc.outcome(value)
                    if any(c is None for c in cands.values()):
                        excluded.append({"session": base.id, "arm": arm, "position": pos, "turn": t,
                                         "reason": CANDIDATE_MERGES})
                        continue
                    rows.append(Request(arm, pos, base.id, sc.id, sc.family, t, value, sc.candidates[expected],
                                        tuple(int(i) for i in prompt.ids), prompt.field[0],
                                        {o: c[0] for o, c in cands.items()}, cands[expected][0]))
            requests.extend(sorted(rows, key=lambda r: (r.turn, r.session)))
    return requests, excluded


@torch.no_grad()
def full_prefill_logprobs(model, ids) -> torch.Tensor:
    """The harness's reference: log-softmax (fp32) of a full forward of ``ids`` at the last position.

    Args:
        ids: prompt token ids, length ``T``.

    Returns:
        ``[vocab]`` log-probabilities of the next token.
    """
    x = torch.as_tensor(list(ids), dtype=torch.long, device=model.device).view(1, -1)
    pos = torch.arange(x.shape[1], device=model.device).view(1, -1)
    logits = model(input_ids=x, position_ids=pos, logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@torch.no_grad()
def _continued_logprobs(model, cache, start: int, ids: tuple[int, ...]) -> torch.Tensor:
    """Forward ``ids[start:]`` at positions ``start ..`` on ``cache`` (over ``ids[:start]``, extended
    in place); the fp32 log-softmax at the last position, ``[vocab]``."""
    x = torch.as_tensor(list(ids[start:]), dtype=torch.long, device=model.device).view(1, -1)
    pos = torch.arange(start, len(ids), device=model.device).view(1, -1)
    logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


#: The reference methods of :func:`reference_decisions`.
REFERENCES = ("full", "reuse")
#: ``reuse``: shortest common prefix (tokens) worth continuing from instead of a full prefill.
MIN_REUSE_TOKENS = 64


def reference_decisions(model, requests: list[Request], keep_full: set | None = None,
                        progress: bool = False, method: str = "full") -> tuple[dict, dict]:
    """The harness's reference of every distinct prompt: top-1 token and candidate log-probs.

    Args:
        keep_full: request keys whose whole ``[vocab]`` log-probs are also returned (the engine
            cross-check); these are always full prefills (:func:`full_prefill_logprobs`).
        progress: show a ``tqdm`` bar over the requests.
        method: ``full``: a full prefill of every prompt; ``reuse``: prompts are taken per (field
            position, session), and one that shares at least :data:`MIN_REUSE_TOKENS` leading tokens
            with the session's turn 0 or its arm's previous prompt continues that prompt's
            transformers ``DynamicCache`` from the longest common prefix (a view of its first
            positions; causal attention gives the same numbers to float rounding). Erratum turns
            extend turn 0 by a few lines, so a long document costs one full prefill per session
            instead of one per turn; in-place turns still prefill from the field. Models with
            sliding-window layers always take ``full``.

    Returns:
        (prompt ids -> ``{top1, cand_logprobs: {outcome: nats}}``, key -> ``[vocab]`` tensor).

    Raises:
        KvnotesError: an unknown ``method``.
    """
    from transformers import DynamicCache

    if method not in REFERENCES:
        raise KvnotesError(f"unknown reference method '{method}' (known: {', '.join(REFERENCES)})")
    text = model.config.get_text_config()
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
        method = "full"
    ref, full = {}, {}
    keep_full = keep_full or set()
    group, pool = None, {}                 # one (position, session) at a time: its turn 0 and each arm's latest
    for r in tqdm(sorted(requests, key=lambda r: (r.position, r.session, r.arm, r.turn)), desc="harness references",
                  disable=not progress):
        if (r.position, r.session) != group:
            group, pool = (r.position, r.session), {}
        if r.ids in ref and r.key not in keep_full:
            continue
        if r.key in keep_full or method == "full":
            lp = full_prefill_logprobs(model, r.ids)
        else:
            src = max(pool.values(), key=lambda e: _common_prefix(e[0], r.ids), default=None)
            n = min(_common_prefix(src[0], r.ids), len(r.ids) - 1) if src else 0
            cache = DynamicCache()
            if n >= MIN_REUSE_TOKENS:                        # views of the source prompt's first n positions
                for i, layer in enumerate(src[1].layers):   # (DynamicCache.crop's argument differs across
                    cache.update(layer.keys[:, :, :n], layer.values[:, :, :n], i)   # transformers 5.x releases)
            else:
                n = 0
            lp = _continued_logprobs(model, cache, n, r.ids)
            pool[r.arm] = (r.ids, cache)
            if r.turn == 0:
                pool.setdefault("turn0", (r.ids, cache))
        ref[r.ids] = {"top1": int(lp.argmax()), "cand_logprobs": {o: float(lp[t]) for o, t in r.candidates.items()}}
        if r.key in keep_full:
            full[r.key] = lp
    return ref, full


def percentile(values, q: float) -> float | None:
    """``numpy.percentile`` (linear interpolation) or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def first_token_kl(full: torch.Tensor, served: dict[int, float]) -> float:
    """KL(full prefill || served) of the next-token distribution, nats.

    Args:
        full: ``[vocab]`` log-probabilities of the harness's full prefill.
        served: token id -> served log-probability, for the whole vocabulary (tokens the engine did
            not return count as probability 0, which makes the KL infinite where the full prefill
            gives them mass).
    """
    lq = torch.full_like(full, float("-inf"))
    idx = torch.tensor(list(served), dtype=torch.long)
    lq[idx] = torch.tensor(list(served.values()), dtype=full.dtype)
    p = full.exp()
    keep = p > 0
    return float((p[keep] * (full[keep] - lq[keep])).sum())


def summarize_run(rows: list[dict], wall_s: float) -> dict:
    """Aggregates of one (arm, position, rate) run from its per-request rows.

    Rows need ``sent`` (bool), ``n_prompt``, ``n_cached`` (vLLM ``num_cached_tokens``), ``ttft_s``,
    ``turn``, ``owned``, ``served_correct``, ``agree`` and ``finish_s`` / ``send_s`` (seconds since
    the run started).

    Returns:
        ``{n_sent, n_not_sent, hit_rate, hit_rate_updates, ttft_p50_s, ttft_p90_s, ttft_updates_p50_s,
        ttft_updates_p90_s, throughput_rps, prompt_tokens_per_s, correct_owned, correct_all,
        agreement, n_owned, paths, kl_first_token_p50, kl_first_token_max}``: hit rates are cached /
        prompt tokens summed over requests (``updates``: turns >= 1 only); shares are
        :func:`kvnotes.harness.stats.proportion` dicts with Wilson intervals; ``paths`` counts the
        connector's provenance labels (rows' ``path``, when served with it); the KL quantiles are
        over the rows that have ``kl_first_token``.
    """
    sent = [r for r in rows if r["sent"]]
    upd = [r for r in sent if r["turn"] > 0]

    def hit(rs):
        n = sum(r["n_prompt"] for r in rs)
        return sum(r["n_cached"] for r in rs) / n if n else None

    owned = [r for r in sent if r["owned"]]
    span = (max(r["finish_s"] for r in sent) - min(r["send_s"] for r in sent)) if sent else 0.0
    ttft = [r["ttft_s"] for r in sent]
    ttft_u = [r["ttft_s"] for r in upd]
    paths: dict[str, int] = {}
    for r in sent:
        if r.get("path"):
            paths[r["path"]] = paths.get(r["path"], 0) + 1
    kl = [r["kl_first_token"] for r in sent if r.get("kl_first_token") is not None]
    return {
        "n_sent": len(sent), "n_not_sent": len(rows) - len(sent), "wall_s": wall_s,
        "hit_rate": hit(sent), "hit_rate_updates": hit(upd),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_updates_p50_s": percentile(ttft_u, 50), "ttft_updates_p90_s": percentile(ttft_u, 90),
        "throughput_rps": len(sent) / span if span > 0 else None,
        "prompt_tokens_per_s": sum(r["n_prompt"] for r in sent) / span if span > 0 else None,
        "n_owned": len(owned),
        "correct_owned": proportion(sum(r["served_correct"] for r in owned), len(owned)),
        "correct_all": proportion(sum(r["served_correct"] for r in sent), len(sent)),
        "agreement": proportion(sum(r["agree"] for r in sent), len(sent)),
        "paths": paths, "kl_first_token_p50": percentile(kl, 50),
        "kl_first_token_max": float(max(kl)) if kl else None,
    }


SUMMARY_KEYS = ("n_sent", "n_not_sent", "hit_rate", "hit_rate_updates", "engine_hit_rate", "ttft_p50_s",
                "ttft_p90_s", "ttft_updates_p50_s", "ttft_updates_p90_s", "throughput_rps", "prompt_tokens_per_s",
                "n_owned", "correct_owned", "correct_all", "agreement", "first_request_cached_tokens", "reset_ok",
                "paths", "kl_first_token_p50", "kl_first_token_max")
#: The connector arms' baselines (the same prompts by a full prefill) and the TTFT they are compared on.
FULL_BASELINE = {"composed": ("composed_cold", "ttft_p90_s"), "edited": ("cold", "ttft_updates_p90_s")}


def aggregate(runs: list[dict]) -> dict:
    """The measured table: ``by_run[arm][position][rate]`` = the run's summary (:data:`SUMMARY_KEYS`),
    ``p90_ttft_ratio_vs_in_place[arm][position][rate]`` = in-place p90 TTFT of the update turns
    divided by the arm's (> 1: the arm answers faster than the in-place rewrite), and
    ``p90_ttft_speedup_vs_full[arm][position][rate]`` for the connector arms: their baseline's p90
    TTFT over theirs (:data:`FULL_BASELINE`: ``composed`` on all its requests, ``edited`` on the
    update turns, the ones it serves with a plan)."""
    table: dict = {}
    for r in runs:
        table.setdefault(r["arm"], {}).setdefault(r["position"], {})[str(r["rate"])] = \
            {k: r.get(k) for k in SUMMARY_KEYS}
    ratio: dict = {}
    base = table.get("in_place", {})
    for arm, by_pos in table.items():
        for pos, by_rate in by_pos.items():
            for rate, s in by_rate.items():
                ref = base.get(pos, {}).get(rate, {}).get("ttft_updates_p90_s")
                mine = s.get("ttft_updates_p90_s")
                if ref and mine:
                    ratio.setdefault(arm, {}).setdefault(pos, {})[rate] = ref / mine
    speedup: dict = {}
    for arm, (base_arm, key) in FULL_BASELINE.items():
        for pos, by_rate in table.get(arm, {}).items():
            for rate, s in by_rate.items():
                ref = table.get(base_arm, {}).get(pos, {}).get(rate, {}).get(key)
                if ref and s.get(key):
                    speedup.setdefault(arm, {}).setdefault(pos, {})[rate] = ref / s[key]
    return {"by_run": table, "p90_ttft_ratio_vs_in_place": ratio, "p90_ttft_speedup_vs_full": speedup,
            "full_baseline": {arm: list(v) for arm, v in FULL_BASELINE.items()}}


#: How the serving benchmark's records are shown (they name this module under ``presentation``).
PRESENTATION = Presentation(plot="kvnotes.plots.serving:plot_serving", table=serving_table)
