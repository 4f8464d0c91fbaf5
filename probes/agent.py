"""``agent``: an edit + compose agent loop, judged against a full prefill of the field-rewritten
prompt (paper §5: precompiled chunks; §4: the appended erratum).

For each instance of every scenario, a *trajectory* of ``turns`` field values is drawn (seeded by
the run seed and the instance id; every turn changes the value) and run as one multi-turn
conversation, the way an agent with a KV cache would:

- **turn 1**: the chunked prompt of :mod:`kvnotes.harness.chunks` (``rule``, ``filler`` | ``context``
  holding the field, ``request``, ``decision``). The rule and filler are precompiled once per
  instance (behind ``sink``; the time is reported apart as ``precompile_ms``) and spliced with
  their keys rotated to their positions and the first ``seam`` tokens recomputed
  (:func:`kvnotes.ops.compose.compose`); the live part is forwarded on top.
- the agent's **answer** closes the turn: the scenario candidate its decision prefers (highest
  first-token log-prob among the candidates), written after the answer prefix.
- **turn t >= 2**: a user message with a state update (the erratum of
  :mod:`kvnotes.harness.edit_prompts` stating the turn's value) and the request and decision lines. It is
  appended incrementally: only the tokens after the longest common token prefix with the cached
  conversation are forwarded (:func:`kvnotes.kv.cache.continuation_logprobs`).

Every decision (vocabulary top-1 at the decision position) is compared with

- the **oracle**: a full prefill of the single-turn chunked prompt with the field *rewritten* to
  the turn's value (what the conversation should now decide; never the agent's own tokens);
- the **transcript**: a full prefill of the agent's own conversation tokens (no composition, no
  reuse): agent vs transcript isolates the composition error, transcript vs oracle how well the
  model follows the state update;
- the **expected outcome**: the scenario's candidate for the turn's value (its first token).

Times (:func:`kvnotes.harness.timing.elapsed_ms`, ``torch.utils.benchmark``; wall time, the device synchronised): ``agent_ms``
is the compose call (turn 1) or the incremental forward (later turns); ``oracle_ms`` and
``transcript_ms`` are full prefills computing only the last position's logits. A prompt met twice in
a trajectory (the turn-1 transcript is the turn-1 oracle prompt; a value that comes back) is
prefilled once (:func:`kvnotes.harness.kit.per_prompt`) and keeps that prefill's time. One untimed full
prefill warms the model up first.

Aggregates per family and ``all``, over all turns and over turn 1 and turns 2+ apart: accuracy of
the agent, the oracle and the transcript (share whose top-1 is the expected candidate's first
token), agreement of the agent with the oracle on turns whose oracle owns its decision, agreement
with the transcript, KL(oracle || agent) and KL(transcript || agent) in nats (means with the
interval that fits the number of scenario clusters, :func:`kvnotes.harness.stats.summarize`; turns of one
trajectory are one instance cluster), and the time totals with the ratios oracle / agent and
transcript / agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from kvnotes.kv import cache as kvcache
from kvnotes.ops import compose as kvcompose
from kvnotes.harness.chunks import CHUNK_NAMES, CHUNKED_ORDER, SINKS, layout_prompt, prompt_parts, sink_ids
from kvnotes.harness.edit_prompts import common_prefix_length, erratum_text, render_layout, user_pieces
from kvnotes.errors import KvnotesError
from kvnotes.harness.kit import ProbeConfig, by_family, exclusion_counts, per_prompt, progress, summary
from kvnotes.records.schema import BaseResult, ExclusionRow, TypedDict
from kvnotes.harness.selection import pair_rng
from kvnotes.harness.timing import elapsed_ms
from kvnotes.harness.tokens import CANDIDATE_MERGES, build_conversation, continuation_ids
from scenarios.instances import Instance, draw_instances

#: Exclusion reason: a later conversation re-tokenises earlier turns differently and the model
#: has sliding-window layers, whose cache cannot be cropped back to the common prefix.
NOT_INCREMENTAL = "transcript_not_incremental"
#: Turn scopes of the aggregates.
SCOPES = {"all": lambda t: True, "turn1": lambda t: t == 1, "turn2+": lambda t: t >= 2}


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/agent.yaml`` (defaults there; see the module docstring)."""

    turns: int = 4
    seam: int = 4
    sink: str = "bos"
    template_kwargs: Any = None


class TurnRow(TypedDict):
    """One decision of a trajectory (see the module docstring)."""

    trajectory: str
    scenario: str
    family: str
    instance: str
    turn: int
    value: str
    expected: str
    expected_first_token: int
    answer: str
    agent_top1: int
    oracle_top1: int
    transcript_top1: int
    oracle_owned: bool
    agent_correct: bool
    oracle_correct: bool
    transcript_correct: bool
    agree_oracle: bool
    agree_transcript: bool
    kl_oracle: float
    kl_transcript: float
    conversation_tokens: int
    reused_tokens: int
    agent_ms: float
    oracle_ms: float
    transcript_ms: float
    precompile_ms: float


class Result(BaseResult):
    """What ``run`` returns (record ``result``): one row per turn, aggregates per family."""

    rows: list[TurnRow]
    excluded: list[ExclusionRow]


def trajectory_values(instance: Instance, turns: int, seed: int) -> list[str]:
    """``turns`` field values of the instance's scenario: the first drawn at random, each next one
    drawn among the values other than the previous (a ``numpy`` generator seeded by the run seed
    and the instance id, :func:`kvnotes.harness.selection.pair_rng`)."""
    values = list(instance.scenario.values)
    rng = pair_rng(seed, instance.id)
    out = [values[int(rng.integers(len(values)))]]
    for _ in range(turns - 1):
        others = [v for v in values if v != out[-1]]
        out.append(others[int(rng.integers(len(others)))])
    return out


def update_text(instance: Instance, value: str, variant: str) -> str:
    """The user message of a later turn: the state update for ``value``, then the request and
    decision lines of the scenario."""
    pieces, _, _ = user_pieces(instance, value, variant)
    return "\n".join(p for p in (erratum_text(instance, value), pieces["request"], pieces["decision"]) if p)


def _timed(fn):
    box = []
    ms = elapsed_ms(lambda: box.append(fn()))
    return ms, box[0]


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats of two ``[vocab]`` log-prob vectors (:func:`kvnotes.ops.compose.decision_metrics`)."""
    return float(kvcompose.decision_metrics(p_log[None], q_log[None])["kl"][0])


@torch.no_grad()
def run_trajectory(model, tok, instance: Instance, values: list[str], variant: str, seam: int, sink: str,
                   chat: bool, template_kwargs: dict) -> list[dict] | str:
    """Run one trajectory (see the module docstring).

    Returns:
        one row per turn (:class:`TurnRow`), or an exclusion reason: ``chunk_boundary_inside_token``
        (:mod:`kvnotes.harness.chunks`), ``candidate_merges_with_prompt`` (the expected candidate's tokens
        merge with the answer prefix) or ``transcript_not_incremental``.
    """
    sc = instance.scenario
    first_user, field_chars, prefix = render_layout(instance, values[0], variant, CHUNKED_ORDER)
    made = layout_prompt(tok, instance, values[0], CHUNKED_ORDER, CHUNK_NAMES, variant, None, chat, template_kwargs)
    if isinstance(made, str):
        return made
    prompt1, spans = made
    sink_tokens = sink_ids(prompt1.ids, sink, spans[0][0])
    pre_ms, chunks = _timed(lambda: [kvcompose.precompile(model, prompt1.ids[a:b], sink_tokens)
                                           for a, b in spans])
    sliding = kvcompose.has_sliding_layers(model)
    full = per_prompt(lambda ids: _timed(lambda: kvcompose.full_logits(model, ids)), 2 * len(values))
    users, answers, rows = [first_user], [], []
    cache, cached = None, None
    for t, value in enumerate(values, start=1):
        if t > 1:
            users.append(update_text(instance, value, variant))
        conv = build_conversation(tok, users, answers, field_chars, prefix, chat, sc.system, template_kwargs)
        if t == 1:
            assert torch.equal(conv.ids, prompt1.ids), "turn 1 must be the chunked prompt"
            oracle_ids = prompt1.ids
        else:
            made = layout_prompt(tok, instance, value, CHUNKED_ORDER, CHUNK_NAMES, variant, None, chat, template_kwargs)
            if isinstance(made, str):
                return made
            oracle_ids = made[0].ids
        cands = {c: continuation_ids(tok, conv, c) for c in dict.fromkeys(sc.candidates.values())}
        expected = sc.candidates[sc.outcome(value)]
        if cands[expected] is None:
            return CANDIDATE_MERGES
        # --- the agent: compose (turn 1) or forward only what is new
        if t == 1:
            parts = prompt_parts(conv.ids.view(1, -1), spans, chunks)
            ms, (cache, logits) = _timed(lambda: kvcompose.compose(model, parts, True, seam, static=False))
            agent = torch.log_softmax(logits[0], -1)
            reuse = 0
        else:
            reuse = min(common_prefix_length(cached, conv.ids), len(conv.ids) - 1)
            if reuse < len(cached):
                if sliding:
                    return NOT_INCREMENTAL
                cache.crop(reuse)
            ms, lp = _timed(lambda: kvcache.continuation_logprobs(model, cache, conv.ids[reuse:], reuse,
                                                                         last_only=True))
            agent = lp[0, -1]
        cached = conv.ids
        oracle_ms, oracle_logits = full(oracle_ids)
        transcript_ms, transcript_logits = full(conv.ids)
        oracle = torch.log_softmax(oracle_logits[0], -1)
        transcript = torch.log_softmax(transcript_logits[0], -1)
        first = cands[expected][0]
        top = {k: int(v.argmax()) for k, v in (("agent", agent), ("oracle", oracle), ("transcript", transcript))}
        answer = max((c for c, ids in cands.items() if ids is not None), key=lambda c: float(agent[cands[c][0]]))
        answers.append(answer)
        rows.append({"trajectory": instance.id, "scenario": sc.id, "family": sc.family, "instance": instance.id,
                     "turn": t, "value": value, "expected": expected, "expected_first_token": first,
                     "answer": answer, **{f"{k}_top1": v for k, v in top.items()},
                     "oracle_owned": top["oracle"] == first,
                     **{f"{k}_correct": v == first for k, v in top.items()},
                     "agree_oracle": top["agent"] == top["oracle"],
                     "agree_transcript": top["agent"] == top["transcript"],
                     "kl_oracle": _kl(oracle, agent), "kl_transcript": _kl(transcript, agent),
                     "conversation_tokens": len(conv.ids), "reused_tokens": reuse, "agent_ms": ms,
                     "oracle_ms": oracle_ms, "transcript_ms": transcript_ms,
                     "precompile_ms": pre_ms if t == 1 else 0.0})
    return rows


def _share(rows: list[dict], key: str, n_boot: int, seed: int) -> dict:
    """Share of rows with ``key`` true: ``k`` and a :func:`kvnotes.harness.kit.summary` of the indicator."""
    return {"k": sum(bool(r[key]) for r in rows)} | summary(rows, lambda r: float(r[key]), n_boot, seed)


def _times(rows: list[dict]) -> dict:
    tot = {k: float(sum(r[f"{k}_ms"] for r in rows)) for k in ("agent", "oracle", "transcript", "precompile")}
    return {f"{k}_ms_total": v for k, v in tot.items()} | {
        "ratio_oracle_over_agent": tot["oracle"] / tot["agent"] if tot["agent"] else None,
        "ratio_transcript_over_agent": tot["transcript"] / tot["agent"] if tot["agent"] else None,
        "agent_ms_median": float(np.median([r["agent_ms"] for r in rows])) if rows else None,
        "oracle_ms_median": float(np.median([r["oracle_ms"] for r in rows])) if rows else None}


def aggregate(rows: list[dict], families: list[str], n_boot: int, seed: int) -> dict:
    """Per family (and ``all``) and turn scope (:data:`SCOPES`): see the module docstring."""
    out = {}
    for fam, frows in by_family(rows, families).items():
        out[fam] = {}
        for scope, keep in SCOPES.items():
            rs = [r for r in frows if keep(r["turn"])]
            owned = [r for r in rs if r["oracle_owned"]]
            out[fam][scope] = {
                "n_turns": len(rs), "n_trajectories": len({r["trajectory"] for r in rs}),
                **{f"{k}_accuracy": _share(rs, f"{k}_correct", n_boot, seed) for k in ("agent", "oracle", "transcript")},
                "agreement_oracle_owned": _share(owned, "agree_oracle", n_boot, seed),
                "agreement_transcript": _share(rs, "agree_transcript", n_boot, seed),
                "kl_oracle": summary(rs, "kl_oracle", n_boot, seed),
                "kl_transcript": summary(rs, "kl_transcript", n_boot, seed),
                "time": _times(rs)}
    return out


def run(ctx) -> dict:
    """Agent trajectories on every instance of the loaded scenarios; see the module docstring."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    if ctx.scenario_cfg is None:
        raise KvnotesError("probe agent needs the scenario config (it renders its own conversations)")
    turns, seam, sink = int(cfg.get("turns", 4)), int(cfg.get("seam", 4)), str(cfg.get("sink", "bos"))
    if turns < 1:
        raise KvnotesError(f"probe agent: turns must be >= 1 (got {turns})")
    if sink not in SINKS:
        raise KvnotesError(f"unknown compose sink '{sink}' (known: {', '.join(SINKS)})")
    tk = cfg.get("template_kwargs")
    tk = OmegaConf.to_container(tk) if tk is not None and not isinstance(tk, dict) else (tk or {})
    chat = bool(ctx.scenario_cfg.get("chat_template", True))
    variant = ctx.scenario_cfg.get("variant", "direct")
    seed = int(ctx.scenario_cfg.seed)
    instances = [inst for sc in ctx.pairs.scenarios if variant in sc.variants
                 for inst in draw_instances(sc, int(ctx.scenario_cfg.n_instances), seed)]
    if not instances:
        raise KvnotesError(f"probe agent: no scenario of the selection has the '{variant}' variant")
    first = layout_prompt(tok, instances[0], next(iter(instances[0].scenario.values)), CHUNKED_ORDER, CHUNK_NAMES,
                          variant, None, chat, tk)
    if not isinstance(first, str):
        kvcompose.full_logits(model, first[0].ids)           # untimed warm-up
    rows, excluded = [], []
    for inst in tqdm(instances, desc="agent", disable=not progress(ctx)):
        values = trajectory_values(inst, turns, ctx.seed)
        with ctx.timer("trajectories"):
            got = run_trajectory(model, tok, inst, values, variant, seam, sink, chat, tk)
        if isinstance(got, str):
            excluded.append({"pair": inst.id, "scenario": inst.scenario.id, "family": inst.scenario.family,
                             "instance": inst.id, "reason": got})
        else:
            rows.extend(got)
    families = sorted({s.family for s in ctx.pairs.scenarios})
    with ctx.timer("statistics"):
        agg = aggregate(rows, families, int(cfg.get("n_boot", 2000)), ctx.seed)
    aggregates = {"turns": turns, "seam": seam, "sink": sink, "n_trajectories": len({r["trajectory"] for r in rows}),
                  "n_excluded": len(excluded), "families": families, "by_family": agg,
                  "device": model.device.type}
    return {"rows": rows, "aggregates": aggregates, "exclusions": exclusion_counts(excluded), "excluded": excluded}
