"""Instances (a scenario with concrete surface details) and old/new pairs.

Instances vary real surface content — slot values (names, ids, items) and the choice and order of
filler sentences — drawn from a ``numpy`` generator seeded by ``(suite seed, crc32(scenario id),
instance index)``, so a run is reproducible and independent of Python's ``hash()`` (docs/design.md §10).
"""

from __future__ import annotations

import string
import zlib
from dataclasses import dataclass, replace

import numpy as np

from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios.schema import Scenario


#: Where the field's line sits among the user message's lines (``scenario.field_placement``; the
#: paper's dose-response of the field's position, anchors §7.1): the context line (which holds the
#: field) first, after the filler sentences, or after the rule, just before the request.
FIELD_PLACEMENTS: dict[str, tuple[str, ...]] = {
    "first": ("context", "filler", "rule", "request", "decision"),
    "after_filler": ("filler", "context", "rule", "request", "decision"),
    "before_request": ("filler", "rule", "context", "request", "decision"),
}


@dataclass(frozen=True)
class Instance:
    """A scenario rendered with concrete surface details.

    Attributes:
        scenario: the scenario.
        index: instance number within the scenario.
        slots: slot name -> the drawn surface string (the field slot is not in here).
        filler: the chosen filler sentences, in order.
        polarity: ``"normal"`` or ``"inverted"`` (the rule's trigger flipped; see schema).
        placement: where the field's line sits (:data:`FIELD_PLACEMENTS`).
    """

    scenario: Scenario
    index: int
    slots: tuple[tuple[str, str], ...]
    filler: tuple[str, ...]
    polarity: str = "normal"
    placement: str = "first"

    @property
    def order(self) -> tuple[str, ...]:
        """The user message's pieces in order (:data:`FIELD_PLACEMENTS` of :attr:`placement`)."""
        return FIELD_PLACEMENTS[self.placement]

    @property
    def id(self) -> str:
        suffix = "" if self.polarity == "normal" else f"/{self.polarity}"
        return f"{self.scenario.id}/{self.index}{suffix}"


@dataclass(frozen=True)
class PairSpec:
    """One instance rendered with an old and a new field value (before tokenisation).

    ``cand_old``/``cand_new`` are the continuations compared at the decision position:
    ``score = log p(cand_new) - log p(cand_old)``. For pairs whose outcomes coincide (controls) they
    are the scenario's first two candidates in file order, so the score is still defined.
    """

    instance: Instance
    old: str
    new: str
    variant: str
    cand_old: str
    cand_new: str
    expect_flip: bool

    @property
    def id(self) -> str:
        return f"{self.instance.id}:{self.old}->{self.new}"


def _fill_pattern(pattern: str, rng: np.random.Generator) -> str:
    return "".join(str(rng.integers(0, 10)) if ch == "#" else ch for ch in pattern)


def draw_instances(scenario: Scenario, n: int, seed: int, polarity: str = "normal",
                   placement: str = "first") -> list[Instance]:
    """Draw ``n`` instances of a scenario, its field's line at ``placement`` (:data:`FIELD_PLACEMENTS`;
    the draws do not depend on it, so an instance differs between placements in its layout only).

    List-valued slots are drawn without replacement across instances while options last (then with
    replacement), so instances differ in real surface content, not only in an id string.

    Raises:
        ScenarioError: ``seed`` is negative (``scenario.seed``; numpy seeds are non-negative), or an
            unknown placement.
    """
    if int(seed) < 0:
        raise ScenarioError(f"scenario.seed: must be a non-negative integer, got {seed}")
    if placement not in FIELD_PLACEMENTS:
        raise ScenarioError(f"scenario.field_placement: must be one of {', '.join(FIELD_PLACEMENTS)}, got {placement!r}")
    rng = np.random.default_rng([int(seed), zlib.crc32(scenario.id.encode())])
    orders = {name: rng.permutation(len(opts)) for name, opts in scenario.slots.items() if isinstance(opts, list)}
    out = []
    for i in range(n):
        slots = []
        for name, opts in scenario.slots.items():
            if isinstance(opts, list):
                order = orders[name]
                idx = order[i] if i < len(order) else rng.integers(len(opts))
                slots.append((name, str(opts[idx])))
            else:
                slots.append((name, _fill_pattern(opts, rng)))
        chosen = rng.choice(len(scenario.filler), size=scenario.n_filler, replace=False) if scenario.n_filler else []
        out.append(Instance(scenario, i, tuple(slots), tuple(scenario.filler[j] for j in chosen), polarity, placement))
    return out


def fill_spans(text: str, values: dict[str, str]) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """Fill ``{slot}`` placeholders; return the text and, per slot, the character spans of its values."""
    parts, spans, pos = [], {}, 0
    for literal, name, _, _ in string.Formatter().parse(text):
        parts.append(literal)
        pos += len(literal)
        if name is not None:
            val = values[name]
            spans.setdefault(name, []).append((pos, pos + len(val)))
            parts.append(val)
            pos += len(val)
    return "".join(parts), spans


def slot_values(instance: Instance, value: str) -> dict[str, str]:
    """Every slot's text in ``instance`` with the field set to ``value`` (and the polarity slot, if
    any, to the instance's trigger word)."""
    sc = instance.scenario
    values = dict(instance.slots)
    values[sc.field_slot] = value
    if sc.polarity_slot:
        values[sc.polarity_slot] = sc.polarity_values[instance.polarity]
    return values


def render_user_text_spans(instance: Instance, value: str,
                           variant: str = "direct") -> tuple[str, dict[str, list[tuple[int, int]]], str]:
    """Render the user message like :func:`render_user_text` and locate every slot.

    Returns:
        (user text, slot name -> list of ``(start, end)`` character spans of that slot's value in
        the text, in order of appearance, answer prefix). The field slot and the polarity slot are
        included like any other slot.
    """
    sc = instance.scenario
    values = slot_values(instance, value)
    var = sc.variants[variant]
    lines, spans, offset = [], {}, 0
    named = {"context": sc.context, "filler": " ".join(instance.filler), "rule": sc.rule, "request": sc.request,
             "decision": var.decision}
    for piece in (named[k] for k in instance.order):
        if not piece:
            continue
        text, sp = fill_spans(piece, values)
        for name, found in sp.items():
            spans.setdefault(name, []).extend((offset + s, offset + e) for s, e in found)
        lines.append(text)
        offset += len(text) + 1
    return "\n".join(lines), spans, var.answer_prefix


def slot_char_spans(instance: Instance, value: str, slot: str, variant: str = "direct") -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of a named slot's value in the rendered user text of
    ``instance`` with the field set to ``value`` (empty list when the slot is not used)."""
    return render_user_text_spans(instance, value, variant)[1].get(slot, [])


def render_user_text(instance: Instance, value: str, variant: str = "direct") -> tuple[str, tuple[int, int], str]:
    """Render the user message of an instance with the field set to ``value``.

    Layout: context (holds the field), filler sentences, rule, request, decision prompt — one per
    line — with the context moved after the filler or the rule by the instance's placement
    (:data:`FIELD_PLACEMENTS`).

    Returns:
        (user text, (start, end) character span of the field value in it, answer prefix).
    """
    text, spans, prefix = render_user_text_spans(instance, value, variant)
    field_spans = spans.get(instance.scenario.field_slot)
    assert field_spans and len(field_spans) == 1  # guaranteed by schema validation
    return text, field_spans[0], prefix


def build_pairs(scenarios: list[Scenario], n_instances: int, seed: int, variant: str = "direct",
                polarity: str = "normal", placement: str = "first") -> list[PairSpec]:
    """All (instance, old, new) pairs of a suite, in a stable order, the field's line at
    ``placement`` (:data:`FIELD_PLACEMENTS`)."""
    pairs = []
    for sc in scenarios:
        if variant not in sc.variants:
            continue
        first_two = list(sc.candidates)[:2]
        for inst in draw_instances(sc, n_instances, seed, polarity, placement):
            for old, new in sc.pairs:
                o_old, o_new = sc.outcome(old, polarity), sc.outcome(new, polarity)
                if o_old == o_new:
                    o_old, o_new = first_two
                pairs.append(PairSpec(inst, old, new, variant, sc.candidates[o_old], sc.candidates[o_new],
                                      sc.expect_flip(old, new)))
    return pairs


@dataclass(frozen=True)
class PolaritySpec:
    """One instance rendered with the field fixed and the rule's trigger word flipped (docs/design.md §5,
    ``dissociation``): the *old* prompt uses the ``normal`` trigger, the *new* one the ``inverted``.

    Attributes:
        instance: the instance with ``polarity="normal"`` (:attr:`inverted` gives the other one).
        value: the field value shared by both prompts.
        variant: the decision variant.
        cand_old, cand_new: continuations of the outcome the normal / inverted rule implies for
            ``value``; ``score = log p(cand_new) - log p(cand_old)``.

    ``old``/``new`` are the polarity names and ``expect_flip`` is always True (inverting the gate
    swaps the two outcomes), so the pair rows of :mod:`kvnotes.harness.pairs` apply unchanged.
    """

    instance: Instance
    value: str
    variant: str
    cand_old: str
    cand_new: str
    old: str = "normal"
    new: str = "inverted"
    expect_flip: bool = True

    @property
    def inverted(self) -> Instance:
        return replace(self.instance, polarity="inverted")

    @property
    def id(self) -> str:
        return f"{self.instance.id}:{self.value}:{self.old}->{self.new}"


NO_POLARITY_BLOCK = "no_polarity_block"


def build_polarity_pairs(scenarios: list[Scenario], n_instances: int, seed: int, variant: str = "direct",
                         placement: str = "first") -> tuple[list[PolaritySpec], list[dict]]:
    """Polarity pairs of a suite: for every instance and every field value, the normal vs the
    inverted rule, in a stable order.

    Instances are the same draws as :func:`build_pairs` makes (same seed), so a polarity pair shares
    its surface details with the field pairs of that instance.

    Returns:
        (specs, skipped) where ``skipped`` has one row ``{scenario, family, reason}`` per scenario
        that cannot give polarity pairs: reason ``no_polarity_block`` (the scenario declares no
        ``polarity``) or ``no_variant`` (it lacks ``variant``).
    """
    specs, skipped = [], []
    for sc in scenarios:
        if not sc.polarity_slot:
            skipped.append({"scenario": sc.id, "family": sc.family, "reason": NO_POLARITY_BLOCK})
            continue
        if variant not in sc.variants:
            skipped.append({"scenario": sc.id, "family": sc.family, "reason": "no_variant"})
            continue
        for inst in draw_instances(sc, n_instances, seed, "normal", placement):
            for value in sc.values:
                specs.append(PolaritySpec(inst, value, variant, sc.candidates[sc.outcome(value, "normal")],
                                          sc.candidates[sc.outcome(value, "inverted")]))
    return specs, skipped
