"""Prompt-level edits of a scenario: an erratum notice inserted into the user message, the hoisted
layout (field just before the decision block), and the token alignment of an edited prompt with the
cached one (longest common token prefix).

The user message of an instance is the lines ``context, filler, rule, request, decision``
(:func:`kvnotes.scenarios.instances.render_user_text`). An edit changes the text, so the reusable part of
the old prompt's KV cache is its longest common *token* prefix with the edited prompt
(:func:`common_prefix_length`); everything after it must be forwarded.

- **erratum** (paper "Models Take Notes at Prefill", erratum edit): the old prompt is kept and a
  correction ``[STATE UPDATE] {field} has changed to {value}; ...``
  (:data:`kvnotes.context.ERRATUM_TEMPLATE`, re-exported here; ``{field}`` is the scenario's domain)
  is inserted at a *placement*: ``before_request`` (default: after context, filler and rule, before the
  request + decision block), ``after_context`` or ``before_decision``.
- **hoist**: the restructuring baseline: the context line (which holds the field) is moved to just
  before the request + decision block (``filler, rule, context, request, decision``), so a change of
  the field only invalidates the tokens from the field onward.
- controls: a *wrong* erratum restating the old value, and an irrelevant notice trimmed to the
  erratum's token length (:func:`length_matched_notice`).

On a transcript suite (``scenario.transcript``; ``turns`` here) the same edits are made to the agent
transcript (:func:`kvnotes.scenarios.transcript.render_transcript`): the notice is a line of the last
user message (before the request or the decision prompt) or of the record's tool result
(``after_context``), and the hoisted layout moves the record's exchange to just before the last user
message (:func:`prompt_in_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvnotes.context import ERRATUM_TEMPLATE, EditableContext
from kvnotes.errors import KvnotesError
from kvnotes.harness.tokens import Prompt, build_prompt, prompt_at, render_prompt
from kvnotes.scenarios.instances import Instance, render_user_text
from kvnotes.scenarios.transcript import NOTICE_PLACEMENTS
#: Source text of the length-matched irrelevant notice (trimmed word by word to the erratum's length).
IRRELEVANT_TEXT = ("[NOTICE] The office printer on the second floor has been serviced and the kitchen "
                   "will be cleaned on Friday afternoon; visitors should sign in at the front desk and "
                   "collect a badge before entering the building, and parking remains free all week.")
#: Where an inserted notice goes in the user message (the same names in a transcript:
#: :data:`kvnotes.scenarios.transcript.NOTICE_PLACEMENTS`).
PLACEMENTS = NOTICE_PLACEMENTS
#: Line order of the default layout and of the hoisted layout.
DEFAULT_ORDER = ("context", "filler", "rule", "request", "decision")
HOISTED_ORDER = ("filler", "rule", "context", "request", "decision")


def erratum_text(instance: Instance, value: str, template: str = ERRATUM_TEMPLATE) -> str:
    """The erratum notice for ``value`` (``{field}`` = the scenario's domain, e.g. "customer home city").

    Raises:
        KvnotesError: the template has a slot other than ``{field}`` and ``{value}``.
    """
    try:
        return template.format(field=instance.scenario.domain, value=value)
    except (KeyError, IndexError, ValueError) as exc:
        raise KvnotesError(f"erratum template: only {{field}} and {{value}} can be filled ({exc})") from None


def user_pieces(instance: Instance, value: str, variant: str = "direct") -> tuple[dict[str, str], int, str]:
    """The filled lines of the user message, checked against :func:`render_user_text`.

    Returns:
        (piece name -> filled text (empty pieces included as ""), offset of the field value inside
        the context line, answer prefix).

    Raises:
        KvnotesError: a piece spans several lines, or the pieces do not reproduce the rendered text.
    """
    sc = instance.scenario
    values = dict(instance.slots) | {sc.field_slot: value}
    if sc.polarity_slot:
        values[sc.polarity_slot] = sc.polarity_values[instance.polarity]
    var = sc.variants[variant]
    pieces = {"context": sc.context.format(**values), "filler": " ".join(instance.filler),
              "rule": sc.rule.format(**values), "request": sc.request.format(**values),
              "decision": var.decision.format(**values)}
    text, (fa, _), prefix = render_user_text(instance, value, variant)
    joined = "\n".join(p for p in (pieces[k] for k in instance.order) if p)
    if joined != text or any("\n" in p for p in pieces.values()):
        raise KvnotesError(f"{sc.source}: cannot split the user message into single-line pieces for editing")
    return pieces, fa, prefix


def render_layout(instance: Instance, value: str, variant: str = "direct", order=None,
                  notice: str | None = None, placement: str = "before_request") -> tuple[str, tuple[int, int], str]:
    """Render the user message with the lines in ``order`` and an optional notice line.

    Args:
        order: a permutation of :data:`DEFAULT_ORDER`; None: the instance's own (its field placement).
        notice: a line inserted at ``placement`` (:data:`PLACEMENTS`), or None.

    Returns:
        (user text, character span of the field value in it, answer prefix).

    Raises:
        KvnotesError: unknown placement.
    """
    if placement not in PLACEMENTS:
        raise KvnotesError(f"unknown erratum placement '{placement}' (known: {', '.join(PLACEMENTS)})")
    pieces, fa, prefix = user_pieces(instance, value, variant)
    names = list(instance.order if order is None else order)
    if notice is not None:
        at = {"before_request": names.index("request"), "before_decision": names.index("decision"),
              "after_context": names.index("context") + 1}[placement]
        names.insert(at, "notice")
        pieces = pieces | {"notice": notice}
    lines, offset, field_start = [], 0, None
    for name in names:
        if not pieces[name]:
            continue
        if name == "context":
            field_start = offset + fa
        lines.append(pieces[name])
        offset += len(pieces[name]) + 1
    if field_start is None:
        raise KvnotesError(f"{instance.scenario.source}: the scenario has no context line to hold the field")
    return "\n".join(lines), (field_start, field_start + len(value)), prefix


@dataclass(frozen=True)
class EditedPrompt:
    """An edited prompt aligned with the cached (old) prompt.

    Attributes:
        prompt: the edited prompt (its ``decision`` is its last token).
        reuse: length of the longest common token prefix with the cached prompt: positions
            ``[0, reuse)`` of the old cache are reused, ``[reuse, decision)`` must be forwarded.
    """

    prompt: Prompt
    reuse: int


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token id tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def prompt_in_layout(tokenizer, instance: Instance, value: str, variant: str = "direct", order=DEFAULT_ORDER,
                     notice: str | None = None, placement: str = "before_request", chat_template: bool = True,
                     template_kwargs: dict | None = None, turns: int | None = None) -> Prompt:
    """Render and tokenise a prompt in the line ``order`` with an optional notice
    (:func:`render_layout`); with ``turns``, the suite's agent transcript
    (:func:`kvnotes.scenarios.transcript.render_transcript`) with the notice at the same
    ``placement``, the hoisted order moving the record's exchange to just before the last user message.

    Raises:
        KvnotesError: an unknown placement; with ``turns``, an order other than the default or the
            hoisted one.
    """
    if turns is None:
        user, chars, prefix = render_layout(instance, value, variant, order, notice, placement)
        return build_prompt(tokenizer, user, chars, prefix, chat_template, instance.scenario.system, template_kwargs)
    if tuple(order) not in (DEFAULT_ORDER, HOISTED_ORDER) or placement not in PLACEMENTS:
        raise KvnotesError(f"a transcript's edited prompt takes the default or the hoisted order and a placement "
                           f"of {', '.join(PLACEMENTS)}")
    text, spans, _ = render_prompt(tokenizer, instance, value, variant, chat_template, template_kwargs, turns,
                                   notice=notice, placement=placement, hoist=tuple(order) == HOISTED_ORDER)
    (field,) = spans[instance.scenario.field_slot]
    return prompt_at(tokenizer, text, field)


def edited_prompt(tokenizer, instance: Instance, value: str, cached: Prompt, variant: str = "direct",
                  order=DEFAULT_ORDER, notice: str | None = None, placement: str = "before_request",
                  chat_template: bool = True, template_kwargs: dict | None = None,
                  turns: int | None = None) -> EditedPrompt:
    """Render and tokenise an edited prompt (:func:`prompt_in_layout`) and align it with ``cached``.

    The reuse length never exceeds ``cached.decision``: the decision token itself is always fed.

    Raises:
        KvnotesError: from :func:`prompt_in_layout`.
    """
    prompt = prompt_in_layout(tokenizer, instance, value, variant, order, notice, placement, chat_template,
                              template_kwargs, turns)
    reuse = min(common_prefix_length(cached.ids, prompt.ids), cached.decision, prompt.decision)
    return EditedPrompt(prompt, reuse)


def length_matched_notice(tokenizer, n_tokens: int, text: str = IRRELEVANT_TEXT) -> str:
    """The longest word prefix of ``text`` whose token count (no special tokens) is closest to
    ``n_tokens``: an irrelevant notice of the erratum's length, as a control."""
    words = text.split(" ")
    best, best_gap = words[0], None
    for i in range(1, len(words) + 1):
        cand = " ".join(words[:i])
        gap = abs(len(tokenizer(cand, add_special_tokens=False)["input_ids"]) - n_tokens)
        if best_gap is None or gap < best_gap:
            best, best_gap = cand, gap
    return best


def notice_tokens(tokenizer, notice: str) -> int:
    """Token count of a notice tokenised alone (no special tokens)."""
    return len(tokenizer(notice, add_special_tokens=False)["input_ids"])


def hoisted_pair(tokenizer, instance: Instance, old: str, new: str, variant: str = "direct",
                 chat_template: bool = True, template_kwargs: dict | None = None,
                 turns: int | None = None) -> tuple[Prompt, EditedPrompt]:
    """The hoist baseline: the old value rendered in the hoisted layout (the cache one would have
    stored had the prompt been structured that way) and the new value in the same layout, aligned
    with it (reuse ends at the field); ``turns``: as :func:`edited_prompt`."""
    cached = prompt_in_layout(tokenizer, instance, old, variant, HOISTED_ORDER, chat_template=chat_template,
                              template_kwargs=template_kwargs, turns=turns)
    return cached, edited_prompt(tokenizer, instance, new, cached, variant, HOISTED_ORDER,
                                 chat_template=chat_template, template_kwargs=template_kwargs, turns=turns)


def editable_context(model, tokenizer, instance: Instance, value: str, variant: str = "direct",
                     chat_template: bool = True, template_kwargs: dict | None = None):
    """An :class:`kvnotes.context.EditableContext` holding a scenario instance's prompt with the field
    at ``value``: the context line split around the field (a field named ``"field"``, labelled with
    the scenario's domain, so the API's erratum is the harness's), filler and rule as text, and the
    request and decision lines as the request (errata go before it: the ``before_request``
    placement). Not prefilled. Its rendered prompt is the harness's (:func:`user_pieces`).

    Raises:
        KvnotesError: from :func:`user_pieces`.
    """
    pieces, fa, prefix = user_pieces(instance, value, variant)
    ctx = EditableContext(model, tokenizer, prefix, chat_template=chat_template, template_kwargs=template_kwargs)
    line = pieces["context"]
    ctx.add_text(line[:fa]).add_field("field", value, label=instance.scenario.domain)
    body = "\n".join(p for p in (pieces["filler"], pieces["rule"]) if p)
    ctx.add_text(line[fa + len(value):] + ("\n" + body if body else ""))
    ctx.add_request("".join("\n" + p for p in (pieces["request"], pieces["decision"]) if p))
    return ctx
