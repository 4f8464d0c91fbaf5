"""Rendering a prompt through the model's chat template and tokenising it once with character
offsets (docs/design.md §3-4): the tokenizer-level machinery shared by the harness
(:mod:`kvnotes.harness.tokens`, which adds scenarios' field spans) and the editable-context API
(:mod:`kvnotes.context`).

A prompt is rendered once as text (through the model's chat template when it has one), tokenised
once with ``return_offsets_mapping``, and spans are located from character offsets, never by
searching for re-tokenised sub-lists. Special tokens appear exactly once: when the rendered text
already starts with the BOS string the tokenizer is told not to add another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvnotes.errors import KvnotesError

__all__ = ["rendering", "render_text", "render_conversation", "render_messages", "tokenize", "char_span_to_tokens", "THINK_OPEN",
           "THINK_CLOSE", "thinking_kwargs", "Segment", "Layout", "render_segments",
           "candidate_first_tokens"]

#: The think block of thinking chat templates (Qwen3): the reasoning sits between the tags, the
#: answer after the closing one.
THINK_OPEN, THINK_CLOSE = "<think>\n", "</think>"


def thinking_kwargs(template_kwargs: dict | None, thinking: bool | None) -> dict:
    """The chat-template arguments with a model config's ``thinking`` switch applied: ``None`` leaves
    them as they are; true/false sets ``enable_thinking`` (Qwen3's name)."""
    out = dict(template_kwargs or {})
    if thinking is not None:
        out["enable_thinking"] = bool(thinking)
    return out


def rendering(tokenizer, chat_template: bool = True) -> str:
    """How :func:`render_text` renders prompts for this tokenizer: ``"chat_template"`` when
    ``chat_template`` is requested and the tokenizer has one, else ``"plain"`` (base models such as
    Gemma-3-270M ship without a chat template). Records store it next to the scenario."""
    return "chat_template" if chat_template and getattr(tokenizer, "chat_template", None) else "plain"


def render_text(tokenizer, user_text: str, answer_prefix: str, chat_template: bool = True,
                system: str | None = None, template_kwargs: dict | None = None) -> tuple[str, int]:
    """Render a prompt and return ``(text, char offset of user_text inside it)``.

    With ``chat_template`` and a tokenizer that has one, the user message goes through
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` and the answer prefix is
    appended as the start of the assistant turn (``template_kwargs`` go to the template, e.g.
    ``enable_thinking=False`` for Qwen3); otherwise the plain text is
    ``user_text + "\\n" + answer_prefix``. This is :func:`render_conversation` with one user turn.

    Raises:
        KvnotesError: the chat template altered the user message so it cannot be located.
    """
    return render_conversation(tokenizer, [user_text], [], answer_prefix, chat_template, system, template_kwargs)


def render_conversation(tokenizer, users: Sequence[str], answers: Sequence[str], answer_prefix: str,
                        chat_template: bool = True, system: str | None = None,
                        template_kwargs: dict | None = None) -> tuple[str, int]:
    """Render a multi-turn conversation that ends at the answer prefix of its last user turn.

    Turn ``i`` is the user message ``users[i]``, answered (for every turn but the last) by the
    assistant message ``answer_prefix + answers[i]``. With a chat template the messages go through
    ``apply_chat_template(..., add_generation_prompt=True)`` and ``answer_prefix`` is appended
    (with ``enable_thinking=True`` inside an opened think block, :data:`THINK_OPEN`, so the reply
    reasons first and answers after :data:`THINK_CLOSE`);
    the plain rendering joins ``user, answer_prefix + answer`` lines and ends with
    ``users[-1] + "\\n" + answer_prefix``. One user turn gives exactly :func:`render_text`'s prompt.

    Returns:
        ``(text, char offset of users[0] inside it)``.

    Raises:
        ValueError: ``len(answers) != len(users) - 1``.
        KvnotesError: the chat template altered the first user message so it cannot be located.
    """
    if len(answers) != len(users) - 1:
        raise ValueError(f"{len(users)} user turns need {len(users) - 1} answers, got {len(answers)}")
    if rendering(tokenizer, chat_template) == "chat_template":
        messages = [{"role": "system", "content": system}] if system else []
        for i, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answer_prefix + answers[i]})
        text = _chat_text(tokenizer, messages, answer_prefix, template_kwargs)
    else:
        turns = [f"{u}\n{answer_prefix}{a}" for u, a in zip(users, answers)]
        text = "\n".join([*turns, users[-1]]) + "\n" + answer_prefix
    start = text.find(users[0])
    if start < 0 or text.find(users[0], start + 1) >= 0:
        raise KvnotesError("the chat template changed the user message; cannot locate the field (set scenario.chat_template=false)")
    return text, start


def _chat_text(tokenizer, messages: list[dict], answer_prefix: str, template_kwargs: dict | None) -> str:
    """``messages`` through the chat template with the generation prompt, then the answer prefix
    (inside an opened think block when ``enable_thinking`` is set and the template left it closed)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    thinking = bool((template_kwargs or {}).get("enable_thinking")) and not text.rstrip().endswith("<think>")
    return text + (THINK_OPEN if thinking else "") + answer_prefix


def render_messages(tokenizer, messages: Sequence, answer_prefix: str, chat_template: bool = True,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """Render a transcript of messages (each with ``role`` and ``content``: ``system``, ``user``,
    ``assistant``, ``tool``) that ends at the answer prefix of the assistant's next turn.

    With a chat template the messages go through ``apply_chat_template(...,
    add_generation_prompt=True)`` as :func:`render_conversation` does; the plain rendering is one
    ``Role: content`` line per message, then ``answer_prefix``.

    Returns:
        ``(text, char offset of each message's content inside it)``.

    Raises:
        KvnotesError: the chat template altered a message so that it cannot be located.
    """
    if rendering(tokenizer, chat_template) == "chat_template":
        text = _chat_text(tokenizer, [{"role": m.role, "content": m.content} for m in messages], answer_prefix,
                          template_kwargs)
    else:
        text = "\n".join(f"{m.role.capitalize()}: {m.content}" for m in messages) + "\n" + answer_prefix
    starts, cursor = [], 0
    for m in messages:
        start = text.find(m.content, cursor)
        if start < 0:
            raise KvnotesError(f"the chat template changed a {m.role} message; cannot locate it "
                               f"(set scenario.chat_template=false)")
        starts.append(start)
        cursor = start + len(m.content)
    return text, starts


def tokenize(tokenizer, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise ``text`` once with offsets, adding the BOS token only if the text lacks it.

    Returns:
        (ids ``[T]``, offsets ``[T, 2]``).

    Raises:
        KvnotesError: the result starts with two BOS tokens.
    """
    bos = tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long)
    bos_id = tokenizer.bos_token_id
    if bos_id is not None and len(ids) > 1 and ids[0] == bos_id and ids[1] == bos_id:
        raise KvnotesError("tokenisation produced BOS twice; check the chat template and add_special_tokens")
    return ids, offsets


def char_span_to_tokens(offsets: torch.Tensor, start: int, end: int) -> tuple[int, int]:
    """Token span ``[a, b)`` of the tokens whose character offsets overlap ``[start, end)``.

    Tokens with empty offsets (special tokens) never overlap.

    Raises:
        KvnotesError: no token overlaps the span.
    """
    s, e = offsets[:, 0], offsets[:, 1]
    hit = ((s < end) & (e > start) & (e > s)).nonzero().flatten()
    if len(hit) == 0:
        raise KvnotesError(f"no token covers characters [{start}, {end})")
    return int(hit[0]), int(hit[-1]) + 1


SegmentKind = Literal["text", "field", "chunk", "erratum", "request"]


@dataclass(frozen=True)
class Segment:
    """One piece of the user message: ``text`` as rendered (a field segment holds the value the
    cache was built with); ``name`` is the field's name (field and erratum segments)."""

    kind: SegmentKind
    text: str
    name: str | None = None


@dataclass(frozen=True)
class Layout:
    """The rendered, tokenised prompt of a list of segments.

    Attributes:
        text: the full rendered text (chat template and answer prefix included).
        ids: ``[T]`` token ids.
        fields: field name -> token span ``(a, b)``.
        pieces: ``(kind, start, end, chunk text)`` token ranges in order; kind ``"live"`` or
            ``"chunk"`` (one ``"live"`` piece covering everything when there are no chunks).
    """

    text: str
    ids: torch.Tensor
    fields: dict[str, tuple[int, int]]
    pieces: tuple[tuple[str, int, int, str], ...]

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


def render_segments(tokenizer, segments: Sequence[Segment], answer_prefix: str = "", chat_template: bool = True,
                    system: str | None = None, template_kwargs: dict | None = None) -> Layout:
    """Render a user message made of ``segments`` once (:func:`render_text`), tokenise it and locate
    each field's token span and each chunk's tokens (the editable context's prompt, :mod:`kvnotes.context`).

    Without chunks the text is tokenised once with offsets (:func:`tokenize`). With chunks it is cut at
    each chunk's characters and each piece is tokenised on its own, so a chunk's tokens do not depend
    on its neighbours (a chunk is precompiled once and spliced).

    Returns:
        the :class:`Layout`; a field's span is the tokens overlapping its characters
        (:func:`char_span_to_tokens`).
    """
    user = "".join(s.text for s in segments)
    text, start = render_text(tokenizer, user, answer_prefix, chat_template, system, template_kwargs)
    spans, at = [], start
    for s in segments:
        spans.append((at, at + len(s.text)))
        at += len(s.text)
    cuts = [spans[i] for i, s in enumerate(segments) if s.kind == "chunk"]
    bounds = [0] + [c for span in cuts for c in span] + [len(text)]
    ids_parts, off_parts, pieces = [], [], []
    n = 0
    for j in range(len(bounds) - 1):
        lo, hi = bounds[j], bounds[j + 1]
        if hi <= lo:
            continue
        piece = text[lo:hi]
        if lo == 0:
            ids, offsets = tokenize(tokenizer, piece)
        else:
            enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
            ids = torch.tensor(enc["input_ids"], dtype=torch.long)
            offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).view(-1, 2)
        kind = "chunk" if j % 2 == 1 else "live"
        pieces.append((kind, n, n + len(ids), piece if kind == "chunk" else ""))
        ids_parts.append(ids)
        off_parts.append(offsets + lo * (offsets[:, 1] > offsets[:, 0]).long()[:, None])
        n += len(ids)
    ids, offsets = torch.cat(ids_parts), torch.cat(off_parts)
    fields = {s.name: char_span_to_tokens(offsets, *spans[i]) for i, s in enumerate(segments)
              if s.kind == "field" and s.name is not None}
    return Layout(text, ids, fields, tuple(pieces))


def candidate_first_tokens(tokenizer, text: str, ids: torch.Tensor, candidates: Sequence[str]) -> list[int]:
    """The first token of each candidate continuation of a rendered prompt, tokenised in context
    (``text + candidate``): the token a decision among them reads at the prompt's end.

    Args:
        text: the rendered prompt.
        ids: ``[T]`` its token ids (:func:`tokenize` of ``text``).

    Raises:
        KvnotesError: fewer than two candidates, a candidate that merges with the prompt's last
            token, or two candidates with the same first token.
    """
    if len(candidates) < 2:
        raise KvnotesError("a decision needs at least two candidates")
    firsts = []
    n = len(ids)
    for cand in candidates:
        full, _ = tokenize(tokenizer, text + cand)
        if len(full) <= n or not torch.equal(full[:n], ids):
            raise KvnotesError(f"candidate {cand!r} merges with the prompt's last token; start it with a space "
                               f"or end the answer prefix differently")
        firsts.append(int(full[n]))
    if len(set(firsts)) < len(firsts):
        raise KvnotesError(f"candidates {list(candidates)} share a first token; the first token decides")
    return firsts
