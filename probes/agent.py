"""``agent``: an edit + compose agent loop, judged against a full prefill of the field-rewritten
prompt (paper §5: precompiled chunks; §4: the appended erratum).

Specification: ``docs/probes/agent.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness.chunks import CHUNK_NAMES, CHUNKED_ORDER, SINKS, layout_prompt, prompt_parts, sink_ids
from kvnotes.harness.constraints import Count, NonNegative, one_of, require_field_placement
from kvnotes.harness.edit_prompts import common_prefix_length, erratum_text, render_layout, user_pieces
from kvnotes.harness.kit import ProbeConfig, by_family, exclusion_counts, per_prompt, summary, units
from kvnotes.harness.pairs import transcript_turns
from kvnotes.harness.selection import pair_rng
from kvnotes.harness.protocol import Measure, readout_of, summaries
from kvnotes.harness.reader import PromptReader, Reads, prompt_reader
from kvnotes.harness.timing import timed
from kvnotes.harness.tokens import CANDIDATE_MERGES, Prompt, build_conversation, candidates_after
from kvnotes.harness.registry import Conformance
from kvnotes.kv import cache as kvcache
from kvnotes.kv.decision import kl_nats
from kvnotes.ops import compose as kvcompose
from kvnotes.records.figures import Bars, Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, ExclusionRow, NotRequired, TypedDict
from kvnotes.records.tables import Lines
from kvnotes.scenarios.instances import Instance, draw_instances

# ------ the agent's trajectory: a transcript's turns, the field's value per turn, the update text

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


def transcript_conversation(tok, instance: Instance, value: str, variant: str, layout_turns: int,
                            users: Sequence[str], answers: Sequence[str], chat: bool, template_kwargs: dict) -> Prompt:
    """The conversation of a trajectory on a transcript suite: the transcript of ``instance`` with the
    field set to ``value`` (:func:`kvnotes.scenarios.transcript.render_transcript`, ``layout_turns``
    unrelated exchanges), then for each of ``answers`` the assistant's answer (after the answer
    prefix) and the next user message of ``users`` (``users[0]`` is the transcript's own last user
    message and is not repeated), ending at the answer prefix. The field is the transcript's.

    A later turn only appends to the earlier ones: with a chat template the answer closes the
    assistant's turn; in the plain rendering (a tokenizer without a template), which ends each
    prompt at the bare answer prefix, the answer follows that prefix and the next message is a
    ``User:`` line, as :func:`kvnotes.models.text.render_messages` writes messages."""
    from kvnotes.harness.tokens import prompt_at
    from kvnotes.models.text import render_messages, rendering
    from kvnotes.scenarios.transcript import Message, render_transcript

    messages, where, prefix = render_transcript(instance, value, variant, layout_turns)
    later = list(zip(answers, users[1:], strict=True))
    if rendering(tok, chat) == "chat_template":
        for answer, user in later:
            messages += [Message("assistant", prefix + answer), Message("user", user)]
        text, starts = render_messages(tok, messages, prefix, chat, template_kwargs)
    else:
        text, starts = render_messages(tok, messages, prefix, chat, template_kwargs)
        text += "".join(f"{answer}\nUser: {user}\n{prefix}" for answer, user in later)
    ((m, a, b),) = where[instance.scenario.field_slot]
    return prompt_at(tok, text, (starts[m] + a, starts[m] + b))

#: Exclusion reason: a later conversation re-tokenises earlier turns differently and the model
#: has sliding-window layers, whose cache cannot be cropped back to the common prefix.
NOT_INCREMENTAL = "transcript_not_incremental"
#: Turn scopes of the aggregates.
SCOPES = {"all": lambda t: True, "turn1": lambda t: t == 1, "turn2+": lambda t: t >= 2}
#: With ``scenario.variant=cot`` every side generates its reasoning and decides after the answer marker.
SUPPORTS_COT = True
#: The three readings of each decision.
SIDES = ("agent", "oracle", "transcript")
#: Exclusion reasons (cot) of a trajectory ended by the agent's chain missing its answer marker.
AGENT_UNREACHED = ("agent_no_marker", "agent_truncated_in_think")


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "multi-turn tool transcripts; the planted tokenizer reads every non-role word as <unk>"

@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/agent.yaml`` (the defaults are here; the YAML sets what differs; see the specification)."""

    #: decisions per trajectory (the field value changes every turn)
    turns: Count = 4
    #: chunk tokens recomputed against the real prefix at turn 1
    seam: NonNegative = 4
    #: precompile chunks behind: none | bos (the prompt's first token) | prefix (the live prefix)
    sink: Annotated[str, one_of(*SINKS)] = "bos"
    #: ``scenario.variant=cot``: most tokens generated per chain
    cot_max_new_tokens: NonNegative = 40

    def check_run(self, run) -> None:
        """The agent lays out its transcript itself (the chunked order).

        Raises:
            KvnotesError: ``scenario.field_placement`` other than ``first``.
        """
        require_field_placement(run, "agent", "lays out its transcript's lines in its own chunked order")


class TurnRow(TypedDict):
    """One decision of a trajectory (see the specification)."""

    trajectory: str
    scenario: str
    family: str
    instance: str
    turn: int
    value: str
    expected: str
    expected_first_token: int | None
    answer: str
    agent_top1: int
    oracle_top1: int | None
    transcript_top1: int | None
    oracle_owned: bool | None
    agent_correct: bool | None
    oracle_correct: bool | None
    transcript_correct: bool | None
    agree_oracle: bool | None
    agree_transcript: bool | None
    kl_oracle: float | None
    kl_transcript: float | None
    conversation_tokens: int
    reused_tokens: int
    agent_ms: float
    oracle_ms: float
    transcript_ms: float
    precompile_ms: float
    # scenario.variant=cot only: the chains, the text that closed the turn, the decoding times
    answer_text: NotRequired[str]
    expected_first_tokens: NotRequired[dict[str, int | None]]
    agent_chain: NotRequired[dict[str, Any]]
    oracle_chain: NotRequired[dict[str, Any]]
    transcript_chain: NotRequired[dict[str, Any]]
    agent_reached: NotRequired[bool]
    oracle_reached: NotRequired[bool]
    transcript_reached: NotRequired[bool]
    agent_generate_ms: NotRequired[float]
    oracle_generate_ms: NotRequired[float]
    transcript_generate_ms: NotRequired[float]


class Result(BaseResult):
    """What ``run`` returns (record ``result``): one row per turn, aggregates per family."""

    rows: list[TurnRow]
    excluded: list[ExclusionRow]


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats of two ``[vocab]`` log-prob vectors (:func:`kvnotes.kv.decision.kl_nats`)."""
    return float(kl_nats(p_log, q_log))


@torch.no_grad()
def run_trajectory(model, tok, instance: Instance, values: list[str], variant: str, seam: int, sink: str,
                   chat: bool, template_kwargs: dict, reader: PromptReader,
                   layout_turns: int | None = None) -> tuple[list[dict], dict | None]:
    """Run one trajectory (see the specification).

    Args:
        reader: the run's readout of whole prompts (:func:`kvnotes.harness.reader.prompt_reader`):
            every side's decision is read at the conversation's end (direct) or after the side's
            generated chain (``scenario.variant=cot``).
        layout_turns: the unrelated exchanges of a transcript suite (``scenario.transcript.turns``);
            None for the one-message layout.

    Returns:
        (one row per turn (:class:`TurnRow`), None) for a completed trajectory, else (rows kept,
        ``{"reason": ...}``): ``chunk_boundary_inside_token`` (:mod:`kvnotes.harness.chunks`),
        ``candidate_merges_with_prompt`` (the expected candidate's tokens merge with the answer prefix,
        nothing generated between) or ``transcript_not_incremental``, with no rows; under the
        generated readout also ``agent_no_marker`` / ``agent_truncated_in_think`` (the agent's chain
        missed its marker) or ``agent_candidate_merges_with_prompt`` (every candidate merges with the
        agent's chain), with the rows of the earlier turns and the exclusion's ``turn`` (and
        ``agent_chain``).

    Raises:
        ValueError: a generated readout of ``max_new_tokens > 0`` without a marker test.
    """
    sc = instance.scenario
    first_user, field_chars, prefix = render_layout(instance, values[0], variant, CHUNKED_ORDER)
    made = layout_prompt(tok, instance, values[0], CHUNKED_ORDER, CHUNK_NAMES, variant, None, chat, template_kwargs,
                         layout_turns)
    if isinstance(made, str):
        return [], {"reason": made}
    prompt1, spans = made
    sink_tokens = sink_ids(prompt1.ids, sink, spans[0][0])
    pre_ms, chunks = timed(lambda: [kvcompose.precompile(model, prompt1.ids[a:b], sink_tokens) for a, b in spans])
    sliding = kvcompose.has_sliding_layers(model)
    full = per_prompt(reader.read_prompt, 2 * len(values))       # the oracle's and the transcript's reads
    candidates = list(dict.fromkeys(sc.candidates.values()))
    users, answers, rows = [first_user], [], []
    cache, cached = None, None
    for t, value in enumerate(values, start=1):
        if t > 1:
            users.append(update_text(instance, value, variant))
        conv = (build_conversation(tok, users, answers, field_chars, prefix, chat, sc.system, template_kwargs)
                if layout_turns is None else
                transcript_conversation(tok, instance, values[0], variant, layout_turns, users, answers, chat,
                                        template_kwargs))
        if t == 1:
            assert torch.equal(conv.ids, prompt1.ids), "turn 1 must be the chunked prompt"
            oracle_prompt = prompt1
        else:
            made = layout_prompt(tok, instance, value, CHUNKED_ORDER, CHUNK_NAMES, variant, None, chat, template_kwargs,
                                 layout_turns)
            if isinstance(made, str):
                return [], {"reason": made}
            oracle_prompt = made[0]
        expected = sc.candidates[sc.outcome(value)]
        # --- the agent: compose (turn 1) or forward only what is new, over what the readout feeds
        fed = reader.fed(conv.ids)
        if t == 1:
            parts = prompt_parts(fed.view(1, -1), spans, chunks)
            ms, (cache, logits) = timed(lambda: kvcompose.compose(model, parts, True, seam, static=False))
            agent = reader.read(cache, None, conv.ids, logits=logits, label="agent")
            reuse = 0
        else:
            reuse = min(common_prefix_length(cached, fed), len(fed) - 1)
            if reuse < len(cached):
                if sliding:
                    return [], {"reason": NOT_INCREMENTAL}
                cache.crop(reuse)
            ms, lp = timed(lambda: kvcache.continuation_logprobs(model, cache, fed[reuse:], reuse, last_only=True))
            agent = reader.read(cache, lp[:, -1], conv.ids, label="agent")
        cached = fed
        if not agent.reached(0):
            return rows, agent.chain_columns(0, unreached="reason", chain="agent_chain") | {"turn": t}
        sides = {"agent": Reading(agent, conv, tok, candidates)}
        if not agent.chain_ids(0) and sides["agent"].cands[expected] is None:
            return [], {"reason": CANDIDATE_MERGES}
        sides |= {"oracle": Reading(full(oracle_prompt.ids), oracle_prompt, tok, candidates),
                  "transcript": Reading(full(conv.ids), conv, tok, candidates)}
        row = _turn_columns(reader, sides, expected)
        if "reason" in row:
            return rows, row | {"turn": t}
        answers.append(row.get("answer_text", row["answer"]))
        rows.append({"trajectory": instance.id, "scenario": sc.id, "family": sc.family, "instance": instance.id,
                     "turn": t, "value": value, "expected": expected} | row
                    | {"conversation_tokens": len(conv.ids), "reused_tokens": reuse, "agent_ms": ms,
                       "precompile_ms": pre_ms if t == 1 else 0.0})
    return rows, None


class Reading:
    """One side's reading of a decision: its :class:`kvnotes.harness.reader.Reads` (one row), fp32
    ``[vocab]`` log-probs ``lp``, and the candidates' ids after its prompt and chain (``cands``; None:
    the chain missed its marker), with the chain's text."""

    def __init__(self, reads: Reads, prompt: Prompt, tok, candidates: list[str]):
        self.reads, self.lp = reads, reads.logprobs[0]
        self.text, self.cands = (candidates_after(tok, prompt, reads.chain_ids(0), candidates) if reads.reached(0)
                                 else ("", None))


def _chain_columns(reader, sides: dict[str, Reading], first: dict, answer: str) -> dict:
    """What only chains have: the agent's answer as the conversation carries it (its chain's text,
    then the answer), each side's first token of the expected candidate after its own chain, and per
    side its chain, whether it reached its marker and its decoding time."""
    out = {"answer_text": sides["agent"].text + answer, "expected_first_tokens": first}
    for k, r in sides.items():
        out |= r.reads.chain_columns(0, chain=f"{k}_chain", reached=f"{k}_reached", decode_ms=f"{k}_generate_ms")
    return out


def _chain_summary(rows: list[dict], excluded: list[dict], max_new_tokens: int) -> dict:
    """What only chains have, over the run: the chains' token cap, the chains that missed their
    marker (agent: trajectories its chain ended, also in the exclusions; oracle / transcript: kept
    turns) and the turns whose expected candidate merges with a side's chain."""
    return {"cot_max_new_tokens": max_new_tokens,
            "n_unreached": {"agent": sum(r["reason"] in AGENT_UNREACHED for r in excluded),
                            **{k: sum(not r[f"{k}_reached"] for r in rows) for k in ("oracle", "transcript")}},
            "n_candidate_merges": {k: sum(r[f"{k}_reached"] and r["expected_first_tokens"][k] is None for r in rows)
                                   for k in SIDES}}


#: What only a chain has, measured under the generated readout.
CHAINS = Measure("chains", _chain_columns, readouts=("generated",), summary=_chain_summary)


def _turn_columns(reader, sides: dict[str, Reading], expected: str) -> dict:
    """A turn's readout columns from its three readings (:class:`TurnRow`): top-1s, correctness against
    each side's first token of ``expected``, the agent's agreement with and KL from the sides that
    reached their marker, and what only chains have (:data:`CHAINS`). ``{"reason": ...}`` when every
    candidate merges with the agent's chain."""
    agent = sides["agent"]
    first = {k: r.cands[expected][0] if r.cands is not None and r.cands[expected] is not None else None
             for k, r in sides.items()}
    usable = {c: ids for c, ids in agent.cands.items() if ids is not None}
    if not usable:
        return {"reason": f"agent_{CANDIDATE_MERGES}"} | agent.reads.chain_columns(0, chain="agent_chain")
    answer = max(usable, key=lambda c: float(agent.lp[usable[c][0]]))
    reached = {k: r.cands is not None for k, r in sides.items()}
    top = {k: int(r.lp.argmax()) if reached[k] else None for k, r in sides.items()}
    correct = {k: top[k] == first[k] if top[k] is not None and first[k] is not None else None for k in SIDES}
    row = {"expected_first_token": first["agent"], "answer": answer, **{f"{k}_top1": v for k, v in top.items()},
           "oracle_owned": correct["oracle"], **{f"{k}_correct": v for k, v in correct.items()},
           **{f"agree_{k}": top["agent"] == top[k] if reached[k] else None for k in SIDES[1:]},
           **{f"kl_{k}": _kl(sides[k].lp, agent.lp) if reached[k] else None for k in SIDES[1:]},
           "oracle_ms": sides["oracle"].reads.prefill_ms, "transcript_ms": sides["transcript"].reads.prefill_ms}
    return row | CHAINS.of(reader, sides, first, answer)


def _share(rows: list[dict], key: str, n_boot: int, seed: int) -> dict:
    """Share of rows with ``key`` true, over the rows where it is not None (a side whose chain
    missed its marker): ``k`` and a :func:`kvnotes.harness.kit.summary` of the indicator."""
    rows = [r for r in rows if r[key] is not None]
    return {"k": sum(bool(r[key]) for r in rows)} | summary(rows, lambda r: float(r[key]), n_boot, seed)


def _times(rows: list[dict]) -> dict:
    tot = {k: float(sum(r[f"{k}_ms"] for r in rows)) for k in ("agent", "oracle", "transcript", "precompile")}
    out = {f"{k}_ms_total": v for k, v in tot.items()} | {
        "ratio_oracle_over_agent": tot["oracle"] / tot["agent"] if tot["agent"] else None,
        "ratio_transcript_over_agent": tot["transcript"] / tot["agent"] if tot["agent"] else None,
        "agent_ms_median": float(np.median([r["agent_ms"] for r in rows])) if rows else None,
        "oracle_ms_median": float(np.median([r["oracle_ms"] for r in rows])) if rows else None}
    if rows and "agent_generate_ms" in rows[0]:            # cot: the decoding, apart
        gen = {k: float(sum(r[f"{k}_generate_ms"] for r in rows)) for k in SIDES}
        both = {k: tot[k] + gen[k] for k in SIDES}
        out |= {f"{k}_generate_ms_total": v for k, v in gen.items()} | {
            "ratio_oracle_over_agent_with_generate": both["oracle"] / both["agent"] if both["agent"] else None,
            "ratio_transcript_over_agent_with_generate":
                both["transcript"] / both["agent"] if both["agent"] else None}
    return out


def aggregate(rows: list[dict], families: list[str], n_boot: int, seed: int) -> dict:
    """Per family (and ``all``) and turn scope (:data:`SCOPES`): see the specification. Comparisons
    that are None (a side whose chain missed its marker) are left out of their metric."""
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
                "kl_oracle": summary([r for r in rs if r["kl_oracle"] is not None], "kl_oracle", n_boot, seed),
                "kl_transcript": summary([r for r in rs if r["kl_transcript"] is not None], "kl_transcript", n_boot,
                                         seed),
                "time": _times(rs)}
    return out


def run(ctx) -> dict:
    """Agent trajectories on every instance of the loaded scenarios; see the specification."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    if ctx.scenario_cfg is None:
        raise KvnotesError("probe agent needs the scenario config (it renders its own conversations)")
    turns, seam, sink = cfg.turns, cfg.seam, cfg.sink
    tk = dict(ctx.template_kwargs)              # the model's chat-template arguments, thinking switch applied
    scenario = ctx.scenario
    chat, variant = scenario.chat_template, scenario.variant
    instances = [inst for sc in ctx.pairs.scenarios if variant in sc.variants
                 for inst in draw_instances(sc, scenario.n_instances, scenario.seed)]
    if not instances:
        raise KvnotesError(f"probe agent: no scenario of the selection has the '{variant}' variant")
    layout_turns = transcript_turns(ctx.scenario_cfg)
    first = layout_prompt(tok, instances[0], next(iter(instances[0].scenario.values)), CHUNKED_ORDER, CHUNK_NAMES,
                          variant, None, chat, tk, layout_turns)
    if not isinstance(first, str):
        kvcompose.full_logits(model, first[0].ids)           # untimed warm-up
    rows, excluded = [], []
    for inst in units(ctx, instances, "agent"):
        values = trajectory_values(inst, turns, ctx.seed)
        with ctx.timer("trajectories"):
            got, why = run_trajectory(model, tok, inst, values, variant, seam, sink, chat, tk,
                                      prompt_reader(ctx, inst.scenario), layout_turns)
        rows.extend(got)
        if why is not None:
            excluded.append({"pair": inst.id, "scenario": inst.scenario.id, "family": inst.scenario.family,
                             "instance": inst.id} | why)
    families = sorted({s.family for s in ctx.pairs.scenarios})
    with ctx.timer("statistics"):
        agg = aggregate(rows, families, cfg.n_boot, ctx.seed)
    aggregates = {"turns": turns, "seam": seam, "sink": sink, "n_trajectories": len({r["trajectory"] for r in rows}),
                  "n_excluded": len(excluded), "families": families, "by_family": agg,
                  "device": model.device.type, "readout": readout_of(ctx)}
    aggregates |= summaries(readout_of(ctx), (CHAINS,), rows, excluded, cfg.cot_max_new_tokens)
    return {"rows": rows, "aggregates": aggregates, "exclusions": exclusion_counts(excluded), "excluded": excluded}


#: The accuracy and agreement columns of the agent's per-family figures.
_AGENT = "[agent_accuracy,transcript_accuracy,oracle_accuracy,agreement_oracle_owned]"

# ---------------------------------------------------------------------------------------------
# presentation


def fmt_share(s: dict) -> str:
    """``k/n = mean [interval] (method)`` of a share aggregate; ``-`` without rows."""
    if not s.get("n"):
        return "-"
    ci = s.get("ci_mean")
    method = {"cluster_bootstrap": "", "t_over_scenario_means": " t", "t_over_instance_means": " ti"}.get(
        s.get("ci_method") or "", "")
    # a share lies in [0, 1]: t-intervals over 2-4 cluster means are clipped to it for display
    interval = f" [{max(ci[0], 0.0):.2f}, {min(ci[1], 1.0):.2f}]{method}" if ci else ""
    return f"{s['k']}/{s['n']} = {s['mean']:.2f}{interval}"


SCOPE_LABELS = (("all", "all turns"), ("turn1", "turn 1"), ("turn2+", "turns 2+"))


def agent_table(record: dict) -> str:
    """The per-family, per-turn table of an ``agent`` record."""
    w = Lines()
    agg = record["result"]["aggregates"]
    w(f"## {record['model']['name']} · agent · {record['scenario']['name']} · {agg['turns']} turns, seam "
          f"{agg['seam']}, sink {agg['sink']} · {agg['n_trajectories']} trajectories, excluded "
          f"{record['result']['exclusions'] or 0}\n")
    w("| family | turns | agent correct | oracle correct | transcript correct | agent = oracle (oracle owns) "
          "| agent = transcript | KL(oracle‖agent) | time oracle / agent | time transcript / agent |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for fam, scopes in agg["by_family"].items():
        for scope, label in SCOPE_LABELS:
            a = scopes[scope]
            if not a["n_turns"]:
                continue
            t = a["time"]
            kl = a["kl_oracle"]["mean"]
            w(f"| {fam} | {label} | {fmt_share(a['agent_accuracy'])} | {fmt_share(a['oracle_accuracy'])} | "
                  f"{fmt_share(a['transcript_accuracy'])} | {fmt_share(a['agreement_oracle_owned'])} | "
                  f"{fmt_share(a['agreement_transcript'])} | {'-' if kl is None else f'{kl:.3f}'} | "
                  f"{t['ratio_oracle_over_agent']:.2f} | {t['ratio_transcript_over_agent']:.2f} |")
    w("\nIntervals: means of the 0/1 indicators, 95%: cluster bootstrap with >= 5 scenarios, `t` over "
          "scenario means (2-4), `ti` over instance means (1 scenario); clipped to [0, 1]. Times: sums over the turns "
          f"(device {agg['device']}); chunk precompile excluded "
          f"({agg['by_family']['all']['all']['time']['precompile_ms_total'] / 1e3:.1f} s in all).")
    return w.text()


def turn_agreement(res: dict) -> dict:
    """Per turn, the share of rows whose agent agrees with the oracle and with the transcript, for a
    :class:`Curves` over turns."""
    rows = res.get("rows", [])
    turns = sorted({r["turn"] for r in rows})
    return {"all": {name: {"x": turns, "y": [sum(bool(r[key]) for r in rows if r["turn"] == t)
                                            / max(1, sum(r["turn"] == t for r in rows)) for t in turns]}
                    for key, name in (("agree_oracle", "agent = oracle"), ("agree_transcript", "agent = transcript"))}
            } if turns else {}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Bars("family-turn1", f"by_family/@/turn1/{_AGENT}", "turn 1: accuracy and agreement per family (95% "
         "interval)", "share of decisions"),
    Bars("family-turns2", f"by_family/@/turn2+/{_AGENT}", "turns 2+: accuracy and agreement per family (95% "
         "interval)", "share of decisions"),
    Reshaped(Curves("agent-turns", "@/*", "agent: agreement per turn", "turn", "share of rows", xy=("x", "y")),
             turn_agreement)),
    table=agent_table)


#: The zoo conformance lane's settings for it (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.turns=2",))
