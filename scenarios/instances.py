"""Instances (a scenario with concrete surface details) and old/new pairs.

Instances vary real surface content — slot values (names, ids, items) and the choice and order of
filler sentences — drawn from a ``numpy`` generator seeded by ``(suite seed, crc32(scenario id),
instance index)``, so a run is reproducible and independent of Python's ``hash()`` (DESIGN.md §10).
"""

from __future__ import annotations

import string
import zlib
from dataclasses import dataclass

import numpy as np

from scenarios.schema import Scenario


@dataclass(frozen=True)
class Instance:
    """A scenario rendered with concrete surface details.

    Attributes:
        scenario: the scenario.
        index: instance number within the scenario.
        slots: slot name -> the drawn surface string (the field slot is not in here).
        filler: the chosen filler sentences, in order.
        polarity: ``"normal"`` or ``"inverted"`` (the rule's trigger flipped; see schema).
    """

    scenario: Scenario
    index: int
    slots: tuple[tuple[str, str], ...]
    filler: tuple[str, ...]
    polarity: str = "normal"

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


def draw_instances(scenario: Scenario, n: int, seed: int, polarity: str = "normal") -> list[Instance]:
    """Draw ``n`` instances of a scenario.

    List-valued slots are drawn without replacement across instances while options last (then with
    replacement), so instances differ in real surface content, not only in an id string.
    """
    rng = np.random.default_rng([seed, zlib.crc32(scenario.id.encode())])
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
        out.append(Instance(scenario, i, tuple(slots), tuple(scenario.filler[j] for j in chosen), polarity))
    return out


def _fill(text: str, values: dict[str, str], field_slot: str) -> tuple[str, tuple[int, int] | None]:
    """Fill ``{slot}`` placeholders; return the text and the character span of the field value."""
    parts, span, pos = [], None, 0
    for literal, name, _, _ in string.Formatter().parse(text):
        parts.append(literal)
        pos += len(literal)
        if name is not None:
            val = values[name]
            if name == field_slot:
                span = (pos, pos + len(val))
            parts.append(val)
            pos += len(val)
    return "".join(parts), span


def render_user_text(instance: Instance, value: str, variant: str = "direct") -> tuple[str, tuple[int, int], str]:
    """Render the user message of an instance with the field set to ``value``.

    Layout: context (holds the field), filler sentences, rule, request, decision prompt — one per
    line — so the rule always comes after the field.

    Returns:
        (user text, (start, end) character span of the field value in it, answer prefix).
    """
    sc = instance.scenario
    values = dict(instance.slots)
    values[sc.field_slot] = value
    if sc.polarity_slot:
        values[sc.polarity_slot] = sc.polarity_values[instance.polarity]
    var = sc.variants[variant]
    lines, span, offset = [], None, 0
    pieces = [sc.context, " ".join(instance.filler), sc.rule, sc.request, var.decision]
    for piece in pieces:
        if not piece:
            continue
        text, sp = _fill(piece, values, sc.field_slot)
        if sp is not None:
            span = (offset + sp[0], offset + sp[1])
        lines.append(text)
        offset += len(text) + 1
    assert span is not None  # guaranteed by schema validation
    return "\n".join(lines), span, var.answer_prefix


def build_pairs(scenarios: list[Scenario], n_instances: int, seed: int, variant: str = "direct",
                polarity: str = "normal") -> list[PairSpec]:
    """All (instance, old, new) pairs of a suite, in a stable order."""
    pairs = []
    for sc in scenarios:
        if variant not in sc.variants:
            continue
        first_two = list(sc.candidates)[:2]
        for inst in draw_instances(sc, n_instances, seed, polarity):
            for old, new in sc.pairs:
                o_old, o_new = sc.outcome(old, polarity), sc.outcome(new, polarity)
                if o_old == o_new:
                    o_old, o_new = first_two
                pairs.append(PairSpec(inst, old, new, variant, sc.candidates[o_old], sc.candidates[o_new],
                                      sc.expect_flip(old, new)))
    return pairs
