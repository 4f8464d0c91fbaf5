"""Chunked prompts for composition (paper §5): the scenario's rule (or table) and its filler as
precompiled chunks, the field, request and decision as the live part.

Layout of the user message (one piece per line)::

    rule            <- chunk 1 (the policy / table)
    filler          <- chunk 2 (a document; absent when the scenario has no filler)
    context         <- live: holds the field
    request         <- live
    decision        <- live

A transcript suite (``scenario.transcript``, :mod:`kvnotes.scenarios.transcript`) has the layout of
an agent's context: the tool results of the unrelated exchanges are the precompiled chunks
(``tool_1``, ``tool_2``, ...: retrieved documents an agent would cache), and the system policy, the
record's exchange (whose tool result holds the field), every user and assistant turn and the last
user message are live (:func:`transcript_layout`). The layout whose field lies inside a chunk makes
the record's tool result a chunk too (``record``).

The full-prefill reference uses exactly this layout and these tokens, so the composed and the full
runs differ only in how the chunks' K/V were computed. The pieces come from the standard rendering
(:func:`kvnotes.scenarios.instances.render_user_text_spans`, one piece per line), so slot filling and the
field's character span are those of every other probe; the prompt is rendered, tokenised and its
spans located from character offsets by :mod:`kvnotes.harness.tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.errors import KvnotesError
from kvnotes.ops import compose as kvcompose
from kvnotes.harness.pairs import PairSet, _tokenized, transcript_turns
from kvnotes.harness.tokens import TokenizedPair, align_field_pair, build_prompt, char_span_to_tokens
from kvnotes.scenarios.instances import Instance, build_pairs, render_user_text_spans
from kvnotes.scenarios.schema import load_suite

#: Exclusion reason: a token straddles a chunk's first or last character, so the chunk has no
#: token span of its own.
CHUNK_BOUNDARY = "chunk_boundary_inside_token"
#: Names of the chunks, in prompt order.
CHUNK_NAMES = ("rule", "filler")
#: What a chunk can be precompiled behind (:func:`sink_ids`).
SINKS = ("none", "bos", "prefix")


@dataclass(frozen=True)
class ChunkedPair(TokenizedPair):
    """A token-aligned old/new pair in the chunked layout.

    Attributes:
        chunks: token spans ``(a, b)`` of the precompiled chunks in order (identical in old and
            new; all before the field).
        chunk_names: their names (``rule``, ``filler``).
        standalone: per chunk, whether its tokens equal the chunk text tokenised on its own (what a
            chunk store would hold); the probe uses the prompt's own tokens either way.
    """

    chunks: tuple[tuple[int, int], ...] = ()
    chunk_names: tuple[str, ...] = ()
    standalone: tuple[bool, ...] = ()


def render_chunked_user_text(instance: Instance, value: str, variant: str = "direct"
                             ) -> tuple[str, tuple[int, int], list[tuple[str, tuple[int, int]]], str]:
    """Render the chunked user message of ``instance`` with the field set to ``value``.

    Returns:
        (user text, character span of the field, ``[(chunk name, character span)]`` in order,
        answer prefix).

    Raises:
        KvnotesError: a rendered piece spans several lines (the pieces cannot be separated).
    """
    sc = instance.scenario
    text, spans, prefix = render_user_text_spans(instance, value, variant)
    given = {"context": sc.context, "filler": " ".join(instance.filler), "rule": sc.rule, "request": sc.request,
             "decision": sc.variants[variant].decision}
    names = [n for n in instance.order if given[n]]
    lines = text.split("\n")
    if len(lines) != len(names):
        raise KvnotesError(f"{sc.source}: a scenario piece spans several lines; it cannot be split into chunks")
    piece = dict(zip(names, lines))
    (fa, fb), = spans[sc.field_slot]
    if fb > len(piece["context"]):
        raise KvnotesError(f"{sc.source}: the field is not in the context line")
    order = [n for n in ("rule", "filler", "context", "request", "decision") if n in piece]
    out, pos, field = [], 0, None
    chunks: list[tuple[str, tuple[int, int]]] = []
    for n in order:
        if n in CHUNK_NAMES:
            chunks.append((n, (pos, pos + len(piece[n]))))
        if n == "context":
            field = (pos + fa, pos + fb)
        out.append(piece[n])
        pos += len(piece[n]) + 1
    if field is None:
        raise KvnotesError(f"{sc.source}: the scenario has no context line to hold the field")
    return "\n".join(out), field, chunks, prefix


def transcript_layout(tokenizer, instance: Instance, value: str, variant: str = "direct", turns: int = 6,
                      field_chunk: bool = False, notice: str | None = None, chat_template: bool = True,
                      template_kwargs: dict | None = None):
    """A transcript prompt (:func:`kvnotes.scenarios.transcript.render_transcript`, the notice, if any,
    before the request) with its precompiled chunks: each unrelated exchange's tool result and, with
    ``field_chunk``, the record's tool result, which holds the field.

    A chunk is the tokens that lie wholly inside its message's content, so a token that a chat
    template merges across the content's edge stays live.

    Returns:
        ``(prompt, chunk token spans in prompt order, chunk names)``: ``tool_<k>`` for the k-th
        unrelated exchange, ``record`` for the record's result; or the exclusion reason
        ``chunk_boundary_inside_token`` when a content has no token of its own.
    """
    from kvnotes.harness.tokens import prompt_at
    from kvnotes.models.text import render_messages
    from kvnotes.scenarios.transcript import render_transcript

    messages, where, prefix = render_transcript(instance, value, variant, turns, notice=notice)
    text, starts = render_messages(tokenizer, messages, prefix, chat_template, template_kwargs)
    ((fm, fa, fb),) = where[instance.scenario.field_slot]
    prompt = prompt_at(tokenizer, text, (starts[fm] + fa, starts[fm] + fb))
    begins, ends = prompt.offsets[:, 0], prompt.offsets[:, 1]
    spans, names = [], []
    for i, m in enumerate(messages):
        if m.role != "tool" or (i == fm and not field_chunk):
            continue
        ca, cb = starts[i], starts[i] + len(m.content)
        inside = ((begins >= ca) & (ends <= cb) & (ends > begins)).nonzero().flatten()
        if not len(inside):
            return CHUNK_BOUNDARY
        spans.append((int(inside[0]), int(inside[-1]) + 1))
        names.append("record" if i == fm else f"tool_{sum(n != 'record' for n in names) + 1}")
    return prompt, tuple(spans), tuple(names)


def _tokenize_chunked_transcript(tokenizer, spec, chat_template: bool, template_kwargs: dict | None,
                                 turns: int) -> ChunkedPair | str:
    """:func:`tokenize_chunked_pair` for a transcript suite (:func:`transcript_layout`)."""
    made = [transcript_layout(tokenizer, spec.instance, value, spec.variant, turns, False, None, chat_template,
                              template_kwargs) for value in (spec.old, spec.new)]
    if any(isinstance(m, str) for m in made):
        return CHUNK_BOUNDARY
    (old, spans, names), (new, new_spans, _) = made                       # type: ignore[misc]
    aligned = align_field_pair(tokenizer, spec, old, new)
    if isinstance(aligned, str):
        return aligned
    if spans != new_spans:
        return CHUNK_BOUNDARY
    standalone = tuple(tokenizer(old.text[int(old.offsets[a, 0]):int(old.offsets[b - 1, 1])],
                                 add_special_tokens=False)["input_ids"] == old.ids[a:b].tolist() for a, b in spans)
    return ChunkedPair(spec, old, new, *aligned, chunks=spans, chunk_names=names, standalone=standalone)


def tokenize_chunked_pair(tokenizer, spec, chat_template: bool = True,
                          template_kwargs: dict | None = None, turns: int | None = None) -> ChunkedPair | str:
    """Render and tokenise both prompts of a pair in the chunked layout (``turns``: as an agent
    transcript, :func:`transcript_layout`) and check alignment.

    Returns:
        a :class:`ChunkedPair`, or an exclusion reason: those of :func:`kvnotes.harness.tokens.align`, or
        ``chunk_boundary_inside_token``.

    Raises:
        KvnotesError: the two field values give identical tokens; from
            :func:`render_chunked_user_text`.
    """
    if turns is not None:
        return _tokenize_chunked_transcript(tokenizer, spec, chat_template, template_kwargs, turns)
    sc = spec.instance.scenario
    prompts = []
    chunk_spans: list[tuple[tuple[int, int], ...]] = []
    for value in (spec.old, spec.new):
        user, field, chunks, prefix = render_chunked_user_text(spec.instance, value, spec.variant)
        prompt = build_prompt(tokenizer, user, field, prefix, chat_template, sc.system, template_kwargs)
        start = prompt.field_chars[0] - field[0]          # offset of the user text in the rendered text
        spans = []
        for _, (ca, cb) in chunks:
            a, b = char_span_to_tokens(prompt.offsets, start + ca, start + cb)
            if int(prompt.offsets[a, 0]) < start + ca or int(prompt.offsets[b - 1, 1]) > start + cb:
                return CHUNK_BOUNDARY
            spans.append((a, b))
        prompts.append(prompt)
        chunk_spans.append(tuple(spans))
    old, new = prompts
    aligned = align_field_pair(tokenizer, spec, old, new)
    if isinstance(aligned, str):
        return aligned
    if chunk_spans[0] != chunk_spans[1]:
        return CHUNK_BOUNDARY
    text, _, named_chunks, _ = render_chunked_user_text(spec.instance, spec.old, spec.variant)
    standalone = []
    for (a, b), (_, (ca, cb)) in zip(chunk_spans[0], named_chunks):
        alone = tokenizer(text[ca:cb], add_special_tokens=False)["input_ids"]
        standalone.append(list(alone) == old.ids[a:b].tolist())
    return ChunkedPair(spec, old, new, *aligned, chunks=chunk_spans[0],
                       chunk_names=tuple(n for n, _ in named_chunks), standalone=tuple(standalone))


def chunked_pairs(tokenizer, scenario_cfg: Any, template_kwargs: dict | None = None) -> PairSet:
    """The :class:`kvnotes.harness.pairs.PairSet` of a scenario config in the chunked layout (same suite,
    instances and pairs as :func:`kvnotes.harness.pairs.prepare_pairs`), exclusions counted by reason.

    Raises:
        KvnotesError: invalid scenario files or an empty selection.
    """
    scenarios = load_suite(list(scenario_cfg.paths), scenario_cfg.get("families"), scenario_cfg.get("ids"))
    specs = build_pairs(scenarios, int(scenario_cfg.n_instances), int(scenario_cfg.seed),
                        scenario_cfg.get("variant", "direct"), placement=scenario_cfg.get("field_placement", "first"))
    return _tokenized(PairSet([], [], scenarios), specs, tokenize_chunked_pair, tokenizer, scenario_cfg,
                      template_kwargs, turns=transcript_turns(scenario_cfg))


#: Line order of the layout whose field lies inside a precompiled chunk (the record chunk).
FIELD_CHUNK_ORDER = ("rule", "context", "filler", "request", "decision")
#: Line order of the chunked layout (rule and filler chunks, then the live field and question).
CHUNKED_ORDER = ("rule", "filler", "context", "request", "decision")


def layout_prompt(tokenizer, instance: Instance, value: str, order, chunk_names, variant: str = "direct",
                  notice: str | None = None, chat_template: bool = True, template_kwargs: dict | None = None,
                  turns: int | None = None):
    """A prompt in the line ``order`` of :func:`kvnotes.harness.edit_prompts.render_layout` (optionally with a
    notice line before the request), with the token spans of the lines named in ``chunk_names``.

    With ``turns`` the prompt is the suite's agent transcript (:func:`transcript_layout`): its chunks
    are the unrelated exchanges' tool results, and the record's tool result too when ``chunk_names``
    names the ``context`` line (:data:`FIELD_CHUNK_ORDER`'s field chunk); ``order`` is then not used.

    Returns:
        ``(prompt, chunk token spans)``, or the exclusion reason ``chunk_boundary_inside_token``.
    """
    from kvnotes.harness.edit_prompts import render_layout, user_pieces

    if turns is not None:
        made = transcript_layout(tokenizer, instance, value, variant, turns, "context" in chunk_names, notice,
                                 chat_template, template_kwargs)
        return made if isinstance(made, str) else made[:2]

    user, field, prefix = render_layout(instance, value, variant, order, notice)
    prompt = build_prompt(tokenizer, user, field, prefix, chat_template, instance.scenario.system, template_kwargs)
    start = prompt.field_chars[0] - field[0]
    pieces, _, _ = user_pieces(instance, value, variant)
    spans, pos = [], 0
    for name in order:
        if name == "request" and notice is not None:
            pos += len(notice) + 1
        if not pieces[name]:
            continue
        if name in chunk_names:
            a, b = char_span_to_tokens(prompt.offsets, start + pos, start + pos + len(pieces[name]))
            if int(prompt.offsets[a, 0]) < start + pos or int(prompt.offsets[b - 1, 1]) > start + pos + len(pieces[name]):
                return CHUNK_BOUNDARY
            spans.append((a, b))
        pos += len(pieces[name]) + 1
    return prompt, tuple(spans)


def prompt_parts(ids: torch.Tensor, spans, chunks: list) -> list:
    """The ``parts`` of :func:`kvnotes.ops.compose.compose` for a prompt: live token slices of ``ids``
    (``[B, T]``) interleaved with ``chunks`` (one per token span in ``spans``, in order)."""
    parts, pos = [], 0
    for (a, b), chunk in zip(spans, chunks, strict=True):
        if a > pos:
            parts.append(ids[:, pos:a])
        parts.append(chunk)
        pos = b
    parts.append(ids[:, pos:])
    return parts


def sink_ids(ids: torch.Tensor, sink: str, first_chunk: int) -> torch.Tensor | None:
    """The sink tokens a chunk is precompiled behind: none, the prompt's first token, or the whole
    live prefix before the first chunk.

    Raises:
        KvnotesError: unknown sink name.
    """
    if sink == "none":
        return None
    if sink == "bos":
        return ids[:1]
    if sink == "prefix":
        return ids[:first_chunk]
    raise KvnotesError(f"unknown compose sink '{sink}' (known: {', '.join(SINKS)})")


def precompiled(model, ids: torch.Tensor, sink: torch.Tensor | None, memo: dict | None) -> kvcompose.Chunk:
    """:func:`kvnotes.ops.compose.precompile` of chunk ``ids`` ``[n]`` behind ``sink`` ``[k]`` (or
    none), memoised in ``memo`` by their tokens (the chunks an instance's prompts and edit arms
    share are prefilled once; a :class:`~kvnotes.ops.compose.Chunk` is never changed by its users)."""
    if memo is None:
        return kvcompose.precompile(model, ids, sink)
    key = (tuple(ids.tolist()), None if sink is None else tuple(sink.tolist()))
    if key not in memo:
        memo[key] = kvcompose.precompile(model, ids, sink)
    return memo[key]
