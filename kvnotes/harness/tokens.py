"""Scenario prompts: rendering, tokenisation and field-span location (docs/design.md §3-4), on the
tokenizer-level machinery of :mod:`kvnotes.models.text`.

A prompt is rendered once as text (through the model's chat template when it has one), tokenised
once with ``return_offsets_mapping``, and the field span is located from character offsets, never
by searching for re-tokenised sub-lists. Special tokens appear exactly once: when the rendered text
already starts with the BOS string the tokenizer is told not to add another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvnotes.errors import KvnotesError
# Rendering and tokenisation live with the tokenizer-level machinery; re-exported for the probes.
from kvnotes.models.text import (char_span_to_tokens, render_conversation, render_messages, render_text,  # noqa: F401
                                 rendering, tokenize)
from kvnotes.scenarios.instances import PairSpec, PolaritySpec, render_user_text_spans
from kvnotes.scenarios.transcript import render_transcript

# Exclusion reasons for pairs that cannot be compared token by token.
UNEQUAL_FIELD_LENGTH = "unequal_field_length"
MISALIGNED_TOKENS = "misaligned_tokens"
SAME_FIRST_TOKEN = "same_candidate_first_token"
CANDIDATE_MERGES = "candidate_merges_with_prompt"
UNEQUAL_TRIGGER_LENGTH = "unequal_trigger_length"
TRIGGER_NOT_UNIQUE = "trigger_slot_not_unique"


@dataclass(frozen=True)
class Prompt:
    """A rendered, tokenised prompt.

    Attributes:
        text: the full rendered text (chat template + answer prefix).
        ids: token ids, shape ``[T]`` (long).
        offsets: ``[T, 2]`` character offsets of each token in ``text``.
        field_chars: character span of the field value in ``text``.
        field: token span ``(a, b)`` of the field: tokens overlapping ``field_chars``.
    """

    text: str
    ids: torch.Tensor
    offsets: torch.Tensor
    field_chars: tuple[int, int]
    field: tuple[int, int]

    @property
    def decision(self) -> int:
        """Decision position ``d``: the last prompt token, whose next-token distribution is read."""
        return len(self.ids) - 1


@dataclass(frozen=True)
class TokenizedPair:
    """A token-aligned old/new pair: identical outside the field span ``[a, b)``.

    Attributes:
        spec: the rendered pair (instance, values, candidates).
        old, new: the two prompts (same length ``T``; ``decision == T - 1``).
        cand_old, cand_new: continuation token ids of each candidate, tokenised in context.
    """

    spec: PairSpec
    old: Prompt
    new: Prompt
    cand_old: tuple[int, ...]
    cand_new: tuple[int, ...]

    @property
    def field(self) -> tuple[int, int]:
        return self.old.field

    @property
    def decision(self) -> int:
        return self.old.decision

    @property
    def downstream(self) -> tuple[int, int]:
        """Downstream positions ``[b, d)``: after the field, before the decision position."""
        return self.field[1], self.decision

    @property
    def downstream_ids(self) -> list[int]:
        """Token ids of the downstream ``[b, d)`` (the old and new prompts share them: they differ in
        the field only); what positions are aligned by across instances
        (:func:`kvnotes.harness.selection.align_positions`)."""
        b, d = self.downstream
        return self.old.ids[b:d].tolist()


def build_prompt(tokenizer, user_text: str, field_chars: tuple[int, int], answer_prefix: str,
                 chat_template: bool = True, system: str | None = None,
                 template_kwargs: dict | None = None) -> Prompt:
    """Render, tokenise and locate the field span of one prompt."""
    return build_conversation(tokenizer, [user_text], [], field_chars, answer_prefix, chat_template, system,
                              template_kwargs)


def build_conversation(tokenizer, users: Sequence[str], answers: Sequence[str], field_chars: tuple[int, int],
                       answer_prefix: str, chat_template: bool = True, system: str | None = None,
                       template_kwargs: dict | None = None) -> Prompt:
    """Render (:func:`render_conversation`), tokenise and locate the field span of a conversation;
    ``field_chars`` is the field's character span inside ``users[0]``."""
    text, start = render_conversation(tokenizer, users, answers, answer_prefix, chat_template, system, template_kwargs)
    return prompt_at(tokenizer, text, (start + field_chars[0], start + field_chars[1]))


def continuation_ids(tokenizer, prompt: Prompt, continuation: str) -> tuple[int, ...] | None:
    """Token ids of ``continuation`` tokenised in context: tokenise prompt+continuation and take the
    tokens after the prompt's. Returns None when the continuation merges with the prompt's last
    token (the prompt's tokens are not a prefix)."""
    ids, _ = tokenize(tokenizer, prompt.text + continuation)
    n = len(prompt.ids)
    if len(ids) <= n or not torch.equal(ids[:n], prompt.ids):
        return None
    return tuple(int(t) for t in ids[n:])


def align(tokenizer, spec, old: Prompt, new: Prompt, unequal_reason: str) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """Check that two prompts differ only inside their ``field`` span and tokenise the candidates.

    Returns:
        ``(cand_old ids, cand_new ids)`` tokenised in context, or an exclusion reason:
        ``unequal_reason`` (spans or prompts of different lengths), ``misaligned_tokens`` (tokens
        outside the span differ), ``candidate_merges_with_prompt`` or ``same_candidate_first_token``.
    """
    (a0, b0), (a1, b1) = old.field, new.field
    if len(old.ids) != len(new.ids) or (b0 - a0) != (b1 - a1):
        return unequal_reason
    if a0 != a1 or not torch.equal(old.ids[:a0], new.ids[:a0]) or not torch.equal(old.ids[b0:], new.ids[b1:]):
        return MISALIGNED_TOKENS
    c_old, c_new = continuation_ids(tokenizer, old, spec.cand_old), continuation_ids(tokenizer, old, spec.cand_new)
    if c_old is None or c_new is None:
        return CANDIDATE_MERGES
    if c_old[0] == c_new[0]:
        return SAME_FIRST_TOKEN
    return c_old, c_new


def render_prompt(tokenizer, instance, value: str, variant: str = "direct", chat_template: bool = True,
                  template_kwargs: dict | None = None, turns: int | None = None,
                  **edits) -> tuple[str, dict[str, list[tuple[int, int]]], str]:
    """Render the prompt of ``instance`` with the field set to ``value``: the flat layout (one user
    message, :func:`kvnotes.scenarios.instances.render_user_text_spans`), or with ``turns`` a
    multi-turn agent transcript (:func:`kvnotes.scenarios.transcript.render_transcript`, which
    also takes ``edits``: ``notice``, ``placement``, ``hoist``; the flat layout's edited prompts are
    :func:`kvnotes.harness.edit_prompts.render_layout`'s).

    Returns:
        (the rendered text, slot name -> character spans of its values in that text, answer prefix).

    Raises:
        ValueError: ``edits`` without ``turns``.
    """
    if edits and turns is None:
        raise ValueError("render_prompt: notice, placement and hoist are transcript options (turns)")
    if turns is None:
        user, spans, prefix = render_user_text_spans(instance, value, variant)
        text, start = render_conversation(tokenizer, [user], [], prefix, chat_template, instance.scenario.system,
                                          template_kwargs)
        return text, {k: [(start + a, start + b) for a, b in v] for k, v in spans.items()}, prefix
    messages, where, prefix = render_transcript(instance, value, variant, turns, **edits)
    text, starts = render_messages(tokenizer, messages, prefix, chat_template, template_kwargs)
    return text, {k: [(starts[i] + a, starts[i] + b) for i, a, b in v] for k, v in where.items()}, prefix


def prompt_at(tokenizer, text: str, chars: tuple[int, int]) -> Prompt:
    """Tokenise a rendered prompt and locate the token span of the characters ``chars``."""
    ids, offsets = tokenize(tokenizer, text)
    return Prompt(text, ids, offsets, chars, char_span_to_tokens(offsets, *chars))


def tokenize_pair(tokenizer, spec: PairSpec, chat_template: bool = True,
                  template_kwargs: dict | None = None, turns: int | None = None) -> TokenizedPair | str:
    """Tokenise a pair and check alignment (``turns``: render as a transcript, :func:`render_prompt`).

    Returns:
        a :class:`TokenizedPair`, or an exclusion reason string: ``unequal_field_length`` (the two
        values tokenise to different lengths), ``misaligned_tokens`` (tokens outside the field span
        differ), ``candidate_merges_with_prompt`` or ``same_candidate_first_token``.
    """
    prompts = []
    for value in (spec.old, spec.new):
        text, spans, _ = render_prompt(tokenizer, spec.instance, value, spec.variant, chat_template, template_kwargs,
                                       turns)
        (field,) = spans[spec.instance.scenario.field_slot]      # exactly once: schema validation
        prompts.append(prompt_at(tokenizer, text, field))
    old, new = prompts
    aligned = align_field_pair(tokenizer, spec, old, new)
    if isinstance(aligned, str):
        return aligned
    return TokenizedPair(spec, old, new, *aligned)


def align_field_pair(tokenizer, spec: PairSpec, old: Prompt, new: Prompt) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """:func:`align` for the two prompts of a field pair, after refusing prompts whose tokens are
    identical (the two field values tokenise alike: the pair cannot change anything).

    Raises:
        KvnotesError: identical prompts.
    """
    if old.ids.shape == new.ids.shape and torch.equal(old.ids, new.ids):
        raise KvnotesError(f"{spec.instance.scenario.source}: field values '{spec.old}' and '{spec.new}' "
                           f"give identical tokens; the pair cannot change anything")
    return align(tokenizer, spec, old, new, UNEQUAL_FIELD_LENGTH)


@dataclass(frozen=True)
class PolarityPair(TokenizedPair):
    """A token-aligned polarity pair (field fixed, rule trigger flipped; docs/design.md §5).

    The two prompts differ only in the trigger span, so the inherited :attr:`field` — the span in
    which old and new differ, which all cache machinery patches — is the *trigger* span ``[t0, t1)``
    and :attr:`downstream` is ``[t1, d)`` (the notes after the trigger). The scenario's field value,
    identical in both prompts and before the trigger, is at :attr:`value_field`.

    Attributes:
        value_field: token span ``(a, b)`` of the (shared) field value.
    """

    value_field: tuple[int, int] = (0, 0)

    @property
    def trigger(self) -> tuple[int, int]:
        """Token span ``[t0, t1)`` of the trigger word(s): the only tokens that differ."""
        return self.field


def tokenize_polarity_pair(tokenizer, spec: PolaritySpec, chat_template: bool = True,
                           template_kwargs: dict | None = None, turns: int | None = None) -> PolarityPair | str:
    """Tokenise a polarity pair (normal vs inverted trigger, same field value) and check alignment.

    Spans come from character offsets of the rendered slots (:func:`render_prompt`; ``turns``:
    render as a transcript), never from searching token sub-lists.

    Returns:
        a :class:`PolarityPair`, or an exclusion reason string: ``trigger_slot_not_unique`` (the
        polarity slot occurs other than once), ``unequal_trigger_length`` (the trigger words
        tokenise to different lengths), ``misaligned_tokens`` (tokens outside the trigger differ),
        ``candidate_merges_with_prompt`` or ``same_candidate_first_token``.

    Raises:
        KvnotesError: the two trigger words give identical tokens.
    """
    sc = spec.instance.scenario
    prompts, value_chars = [], []
    for inst in (spec.instance, spec.inverted):
        text, spans, _ = render_prompt(tokenizer, inst, spec.value, spec.variant, chat_template, template_kwargs, turns)
        trig = spans.get(sc.polarity_slot, [])
        if len(trig) != 1:
            return TRIGGER_NOT_UNIQUE
        prompts.append(prompt_at(tokenizer, text, trig[0]))
        (value,) = spans[sc.field_slot]
        value_chars.append(value)
    old, new = prompts
    if torch.equal(old.ids, new.ids):
        raise KvnotesError(f"{sc.source}: polarity words '{sc.polarity_values['normal']}' and "
                           f"'{sc.polarity_values['inverted']}' give identical tokens")
    aligned = align(tokenizer, spec, old, new, UNEQUAL_TRIGGER_LENGTH)
    if isinstance(aligned, str):
        return aligned
    value_field = char_span_to_tokens(old.offsets, *value_chars[0])
    if value_field != char_span_to_tokens(new.offsets, *value_chars[1]):
        return MISALIGNED_TOKENS
    return PolarityPair(spec, old, new, *aligned, value_field)


def candidates_after(tok, prompt: Prompt, chain_ids: Sequence[int], candidates) -> tuple[str, dict]:
    """The candidates' token ids in context after ``prompt`` followed by a generated chain.

    Args:
        prompt: the prompt the chain was generated from.
        chain_ids: the generated token ids (decoded without special tokens).
        candidates: candidate strings.

    Returns:
        (the chain's text, ``{candidate: ids tuple, or None when it merges with prompt + chain}``,
        :func:`kvnotes.harness.tokens.continuation_ids`). An empty chain tokenises after ``prompt``
        itself.
    """
    text = tok.decode(list(chain_ids), skip_special_tokens=True) if len(chain_ids) else ""
    where = prompt
    if text:
        ids, offsets = tokenize(tok, prompt.text + text)
        where = Prompt(prompt.text + text, ids, offsets, prompt.field_chars, prompt.field)
    return text, {c: continuation_ids(tok, where, c) for c in candidates}


def token_name(tokenizer, token_id: int) -> str:
    """The tokenizer's name of ``token_id``, or ``<id N>`` for an id it does not have (a random-weight
    model of a full-size shape has its own vocabulary size, wider than the tokenizer that renders
    its prompts: ``model.random_init``)."""
    name = tokenizer.convert_ids_to_tokens(token_id)
    return name if name is not None else f"<id {token_id}>"
