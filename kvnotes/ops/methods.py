"""The edit methods, each declared once (:data:`METHODS`), and the rankings of ranked methods
(:data:`RANKINGS`). The ``edit`` probe (``probes/edit.py``), the editable context's modes
(:mod:`kvnotes.context`), the serving-path runner (:class:`kvnotes.ops.edit_runner.EditRunner`) and
the benchmark (``kvnotes bench edit``) all read this registry; ``docs/extending/edit-method.md``
says how to add a method.

An edit method turns the *stale* cache of the old prompt over ``[0, d)`` into (an approximation of)
the new prompt's cache. Each :class:`EditMethod` is made of at most these steps, in this order:

1. ``reprefill``: the new prompt ``[0, d)`` forwarded from scratch (:func:`kvnotes.ops.edit.full`);
2. ``refresh``: the field span ``[a, b)`` recomputed against the unchanged prefix ``[0, a)`` and
   written in place (:func:`kvnotes.ops.edit.refresh_field`);
3. ``prompt``: an edited prompt (an erratum inserted, a hoisted layout) forwarded from its longest
   common token prefix with the cached prompt, ``[reuse, end)`` (:func:`kvnotes.ops.edit.extend_from`).
   The step names the prompt; each consumer renders the prompts it knows (:meth:`EditSource.prompt`);
4. ``ranked``: ``K`` downstream positions ``[b, d)`` taken from a ranking (:data:`RANKINGS`), truly
   recomputed (:func:`kvnotes.ops.edit.selective`) or, for an upper bound, copied from the full
   re-prefill (:func:`kvnotes.ops.edit.oracle_copy`).

The steps say what a method does (:func:`apply` on an :class:`EditSource`; one forward on a kept
cache for the runner, :meth:`EditMethod.keep` and :meth:`EditMethod.positions`) and what it
recomputes (the cost model, :meth:`EditMethod.cost`). Imports nothing from the harness.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit
from kvnotes.ops.edit import Edited

Span = tuple[int, int]
#: The cost of a ranking that forwards nothing.
FREE: dict[str, Any] = {"tokens": 0, "flops": 0.0, "seconds": 0.0}
#: The reference every method is compared with (the full re-prefill).
REFERENCE = "full"


@dataclass(frozen=True)
class Cost:
    """What an operation cost (an edit or a prefill of :class:`kvnotes.context.EditableContext`):
    ``tokens`` forwarded through every layer (a ranking's partial forwards in full-token
    equivalents), forward ``flops`` (:func:`kvnotes.ops.edit.forward_flops`) and wall ``seconds``."""

    tokens: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.tokens + other.tokens, self.flops + other.flops, self.seconds + other.seconds)


@dataclass(frozen=True)
class Geometry:
    """Where an edit works, in token positions.

    Attributes:
        field: the field span ``(a, b)`` of the cached prompt.
        decision: ``d``: the stale cache covers ``[0, d)``; the decision token is fed at ``d``.
        reuse: (a method with a prompt step) the edited prompt's longest common token prefix with
            the cached prompt: positions ``[0, reuse)`` are kept.
        end: (a method with a prompt step) the edited prompt's decision position.
    """

    field: Span
    decision: int
    reuse: int | None = None
    end: int | None = None

    def prompt_span(self) -> Span:
        """``(reuse, end)``: the positions a prompt step forwards.

        Raises:
            ValueError: the geometry has no edited prompt.
        """
        if self.reuse is None or self.end is None:
            raise ValueError("a prompt step needs the edited prompt's reuse and end positions")
        return self.reuse, self.end


@dataclass(frozen=True)
class Recompute:
    """What an edit recomputes: ``spans`` of positions ``(start, end)`` forwarded through every layer
    (each causal within itself) against ``cached`` cached positions they attend to."""

    spans: tuple[Span, ...]
    cached: int

    @property
    def tokens(self) -> int:
        """Positions recomputed (the cost in tokens)."""
        return sum(e - s for s, e in self.spans)

    @property
    def pairs(self) -> int:
        """(query, key) pairs of the spans' causal forwards (:func:`kvnotes.ops.edit.span_pairs`)."""
        return sum(edit.span_pairs(s, e) for s, e in self.spans)

    def flops(self, config) -> float:
        """Forward FLOPs of the spans (:func:`kvnotes.ops.edit.forward_flops`)."""
        return edit.forward_flops(config, self.tokens, self.pairs)


@dataclass(frozen=True)
class EditMethod:
    """One edit method (module docstring).

    Attributes:
        name: its name in records, tables and the benchmark.
        summary: what it does, in one line.
        operation: the :mod:`kvnotes.ops.edit` function that makes its last step (None: no step).
        reprefill, refresh, prompt, ranked: its steps; ``prompt`` names the edited prompt a consumer
            renders for it (``"erratum"``, ``"hoist"``, ...).
        recomputes: its K/V come from forwards of the model (False: the stale cache kept, or K/V
            copied from the full re-prefill).
        controls: the methods that control it: the same step with content that must not move the
            decision (the probe reports whether they do).
        mode: its name as an :meth:`kvnotes.context.EditableContext.edit` mode (None: not a mode).
        upper_bound: it reads what only the reference computes: an upper bound, never a method.
        label: the record name of a ranked variant (``{ranking}``, ``{k}`` filled).
    """

    name: str
    summary: str
    operation: Callable[..., Edited] | None
    reprefill: bool = False
    refresh: bool = False
    prompt: str | None = None
    ranked: bool = False
    recomputes: bool = True
    controls: tuple[str, ...] = ()
    mode: str | None = None
    upper_bound: bool = False
    label: str = ""

    def cost(self, g: Geometry, k: int = 0) -> Recompute:
        """The cost model: the spans this method forwards at geometry ``g`` and the cached positions
        they attend to (one forward of them all is the least work an edit can do). ``k`` ranked
        positions are counted at their earliest, ``[b, b + k)`` (the operation reports the positions
        its ranking chose; the ranking's own work is not counted); copied positions forward nothing.

        Raises:
            ValueError: a prompt step on a geometry without an edited prompt.
        """
        a, b = g.field
        if self.reprefill:
            return Recompute(((0, g.decision),), 0)
        spans = [(a, b)] if self.refresh else []
        if self.prompt is not None:
            spans.append(g.prompt_span())
        if self.ranked and self.recomputes:
            spans.append((b, b + k))
        if self.prompt is not None:
            cached = g.prompt_span()[0]
        elif self.refresh and not (self.ranked and self.recomputes):
            cached = a
        else:
            cached = g.decision
        return Recompute(tuple(spans), cached)

    def keep(self, g: Geometry) -> int:
        """Cached positions an edit made in one forward keeps (:class:`kvnotes.ops.edit_runner.EditRunner`):
        the edited prompt's common prefix for a prompt step, else the whole stale cache ``[0, d)``."""
        return g.prompt_span()[0] if self.prompt is not None else g.decision

    def positions(self, g: Geometry, picks: Sequence[int] = ()) -> list[int]:
        """Positions an edit made in one forward recomputes: the field span (refresh), the prompt span,
        then ``picks`` (ranked).

        Raises:
            ValueError: a method that is not one forward on a kept cache (a re-prefill, a copy, no edit).
        """
        if self.reprefill or not self.recomputes:
            raise ValueError(f"edit method {self.name!r} is not a forward on a kept cache")
        out = list(range(*g.field)) if self.refresh else []
        if self.prompt is not None:
            out += range(*g.prompt_span())
        return out + [int(p) for p in picks] if self.ranked else out

    def variant(self, ranking: str, k: int) -> str:
        """The record name of a ranked variant, e.g. ``selective_attention@8``."""
        return self.label.format(ranking=ranking, k=k)


#: Every edit method by name, in record order (:func:`register`).
METHODS: dict[str, EditMethod] = {}


def register(method: EditMethod) -> EditMethod:
    """Add ``method`` to :data:`METHODS` (the one place a method is declared).

    Raises:
        ValueError: a name or mode already registered, or a ranked method without a ``label``.
    """
    if method.name in METHODS or (method.mode and any(m.mode == method.mode for m in METHODS.values())):
        raise ValueError(f"edit method {method.name!r} (mode {method.mode!r}) is already registered")
    if method.ranked and not method.label:
        raise ValueError(f"ranked edit method {method.name!r} needs a label for its variants")
    METHODS[method.name] = method
    return method


register(EditMethod("stale", "no edit: the stale cache as it is", None, recomputes=False, mode="stale"))
register(EditMethod("refresh_field", "the field recomputed in place against the unchanged prefix; downstream stays "
                    "stale", edit.refresh_field, refresh=True, mode="in_place"))
register(EditMethod("erratum", "a correction line inserted before the decision block, forwarded from the common "
                    "token prefix", edit.extend_from, prompt="erratum", controls=("wrong_erratum", "irrelevant_notice"),
                    mode="erratum"))
register(EditMethod("field_plus_erratum", "the field refresh, then the erratum", edit.extend_from, refresh=True,
                    prompt="erratum", mode="field_plus_erratum"))
register(EditMethod("hoist", "the new prompt in the hoisted layout (field just before the decision block), forwarded "
                    "from the field on", edit.extend_from, prompt="hoist"))
register(EditMethod("selective", "the field refresh, then the top-K downstream positions of a ranking truly "
                    "recomputed in one forward", edit.selective, refresh=True, ranked=True, mode="selective",
                    label="selective_{ranking}@{k}"))
register(EditMethod("full", "re-prefill of the new prompt: the reference", edit.full, reprefill=True, mode="full"))
register(EditMethod("wrong_erratum", "control: an erratum restating the old value", edit.extend_from,
                    prompt="wrong_erratum"))
register(EditMethod("irrelevant_notice", "control: an irrelevant notice of the erratum's length", edit.extend_from,
                    prompt="irrelevant_notice"))
register(EditMethod("oracle_copy", "UPPER BOUND: the field refresh, then K/V of the top-K downstream positions copied "
                    "from the full re-prefill", edit.oracle_copy, refresh=True, ranked=True, recomputes=False,
                    upper_bound=True, label="oracle_copy@{k}"))


def controls() -> tuple[str, ...]:
    """The methods that control another (:attr:`EditMethod.controls`), in registry order."""
    named = {c for m in METHODS.values() for c in m.controls}
    return tuple(n for n in METHODS if n in named)


def modes() -> tuple[str, ...]:
    """The :class:`kvnotes.context.EditableContext` modes of the registry, in registry order (a
    ranked one is written ``mode@K`` or ``mode@P%``)."""
    return tuple(m.mode for m in METHODS.values() if m.mode)


def for_mode(mode: str) -> EditMethod:
    """The method whose :attr:`EditMethod.mode` is ``mode``.

    Raises:
        KeyError: no such mode.
    """
    for method in METHODS.values():
        if method.mode == mode:
            return method
    raise KeyError(mode)


def parse_mode(mode: str, also: Sequence[str] = ()) -> tuple[str, int | float | None]:
    """``"selective@16"`` -> ``("selective", 16)`` (positions); ``"selective@25%"`` ->
    ``("selective", 0.25)`` (a share of the downstream positions); another mode of the registry or
    of ``also`` -> ``(mode, None)``.

    Raises:
        KvnotesError: an unknown mode, or a ranked mode without ``@K`` / ``@P%`` (K >= 0, 0 <= P <= 100).
    """
    ranked = [m.mode for m in METHODS.values() if m.mode and m.ranked]
    for name in ranked:
        hit = re.fullmatch(rf"{re.escape(name)}@(\d+)(%?)", mode)
        if hit and (not hit.group(2) or int(hit.group(1)) <= 100):
            return name, int(hit.group(1)) / 100 if hit.group(2) else int(hit.group(1))
    plain = [m for m in modes() if m not in ranked] + list(also)
    if mode not in plain:
        raise KvnotesError(f"unknown edit mode {mode!r}; choose one of {', '.join(plain)} or "
                           + " or ".join(f"{r}@K / {r}@P%" for r in ranked))
    return mode, None


# ------------------------------------------------------------------------------------- rankings

@dataclass(frozen=True)
class Ranking:
    """A ranking of the downstream positions ``[b, d)`` for a ranked method.

    Attributes:
        name: its name (``selective_<name>@K``).
        summary: what it ranks by, in one line.
        rank: ``rank(source) -> (positions in ranked order, cost {tokens, flops, seconds})``.
        forwards: it runs the model (its cost is not zero).
        seeded: it needs the source's random generator (:meth:`EditSource.rng`).
    """

    name: str
    summary: str
    rank: Callable[[EditSource], tuple[list[int], dict]]
    forwards: bool = False
    seeded: bool = False


#: Every ranking by name (:func:`register_ranking`).
RANKINGS: dict[str, Ranking] = {}


def register_ranking(ranking: Ranking) -> Ranking:
    """Add ``ranking`` to :data:`RANKINGS`.

    Raises:
        ValueError: a name already registered.
    """
    if ranking.name in RANKINGS:
        raise ValueError(f"ranking {ranking.name!r} is already registered")
    RANKINGS[ranking.name] = ranking
    return ranking


register_ranking(Ranking("last", "nearest the decision first", lambda s: (edit.rank_last(s.downstream), dict(FREE))))
register_ranking(Ranking("attention", "the decision row's attention on the stale cache (1 token)",
                         lambda s: edit.rank_attention(s.model, s.stale, s.token, s.downstream), forwards=True))
register_ranking(Ranking("kv_deviation", "CacheBlend: layer-1 K/V deviation after the field refresh (2 of L layers)",
                         lambda s: edit.rank_kv_deviation(s.model, s.refreshed, s.new_ids, s.downstream),
                         forwards=True))
register_ranking(Ranking("random", "a seeded permutation",
                         lambda s: (edit.rank_random(s.downstream, s.rng()), dict(FREE)), seeded=True))


# --------------------------------------------------------------------------------------- making

@dataclass(frozen=True)
class Prompted:
    """An edited prompt aligned with a cached one: positions ``[0, reuse)`` of ``cache`` are kept,
    ``ids[reuse:end]`` forwarded, and the decision token is ``ids[end]``.

    Attributes:
        cache: the all-slot cache the edit extends (covering at least ``[0, reuse)``).
        ids: ``[>= end + 1]`` token ids of the edited prompt.
        reuse: the longest common token prefix with the cached prompt.
        end: the edited prompt's decision position.
    """

    cache: AllSlotCache
    ids: torch.Tensor
    reuse: int
    end: int


class EditSource:
    """What the methods read to make one edit. The field refresh and the full re-prefill are computed
    on first use and shared by every method that needs them (:meth:`fresh` for a copy that computes
    them again, as a benchmark must per call).

    Args:
        model: the causal LM.
        stale: the all-slot cache of the old prompt over ``[0, d)``.
        new_ids: ``[>= d + 1]`` token ids of the new prompt (token-aligned with the old one).
        field: the field span ``(a, b)``.
        decision: ``d``.
        token: the decision token fed at ``d``.
        prompts: the edited prompts this source offers, by name (a subclass may render them on
            demand: override :meth:`prompt` and :meth:`prompt_names`).
    """

    model: Any
    stale: AllSlotCache
    new_ids: torch.Tensor
    field: Span
    decision: int
    token: int

    def __init__(self, model, stale: AllSlotCache, new_ids: torch.Tensor, field: Span, decision: int, token: int,
                 prompts: dict[str, Prompted] | None = None) -> None:
        self.model, self.stale, self.new_ids = model, stale, new_ids
        self.field, self.decision, self.token = (int(field[0]), int(field[1])), int(decision), int(token)
        self.prompts = dict(prompts or {})
        self._refreshed: Edited | None = None
        self._full: Edited | None = None

    @property
    def downstream(self) -> Span:
        """Downstream positions ``[b, d)``."""
        return self.field[1], self.decision

    @property
    def refreshed(self) -> Edited:
        """The field refresh of the stale cache (:func:`kvnotes.ops.edit.refresh_field`; computed once)."""
        if self._refreshed is None:
            self._refreshed = edit.refresh_field(self.model, self.stale, self.new_ids, self.field)
        return self._refreshed

    @property
    def full(self) -> Edited:
        """The full re-prefill of the new prompt (:func:`kvnotes.ops.edit.full`; computed once)."""
        if self._full is None:
            self._full = edit.full(self.model, self.new_ids, self.decision)
        return self._full

    def prompt_names(self) -> tuple[str, ...]:
        """The edited prompts this source offers."""
        return tuple(self.prompts)

    def prompt(self, name: str) -> Prompted:
        """The edited prompt ``name`` of a prompt step.

        Raises:
            KvnotesError: a prompt this source does not offer.
        """
        if name not in self.prompts:
            raise KvnotesError(f"no {name!r} prompt here (offered: {', '.join(self.prompt_names()) or 'none'})")
        return self.prompts[name]

    def rng(self) -> np.random.Generator:
        """The random generator of a seeded ranking.

        Raises:
            KvnotesError: this source has none.
        """
        raise KvnotesError("this edit source has no random generator for a seeded ranking")

    def supports(self, method: EditMethod) -> bool:
        """Whether this source offers everything ``method`` reads."""
        return method.prompt is None or method.prompt in self.prompt_names()

    def geometry(self, method: EditMethod | None = None) -> Geometry:
        """The positions ``method`` works on here (its prompt's common prefix and end for a prompt step)."""
        if method is None or method.prompt is None:
            return Geometry(self.field, self.decision)
        p = self.prompt(method.prompt)
        return Geometry(self.field, self.decision, p.reuse, p.end)

    def fresh(self) -> EditSource:
        """A copy whose field refresh and full re-prefill are computed again on use."""
        out = copy.copy(self)
        out._refreshed = out._full = None
        return out


def apply(method: EditMethod, src: EditSource, k: int = 0,
          ranked: tuple[list[int], dict] | None = None) -> tuple[Edited, int]:
    """Make ``method``'s edit from ``src``, step by step (module docstring).

    Args:
        k: positions a ranked method takes from ``ranked``.
        ranked: ``(positions in ranked order, the ranking's cost)`` (:attr:`Ranking.rank`), for a
            ranked method; the ranking's cost is added to a recompute's.

    Returns:
        (the edited cache and its cost, the decision token to feed at its ``pos``).

    Raises:
        ValueError: a ranked method without ``ranked``.
        KvnotesError: a prompt ``src`` does not offer.
    """
    if method.reprefill:
        return src.full, src.token
    if method.ranked:
        if ranked is None:
            raise ValueError(f"edit method {method.name!r} needs ranked positions")
        order, cost = ranked
        if method.recomputes:
            return edit.selective(src.model, src.refreshed, src.new_ids, order[:k], cost["seconds"], cost["tokens"],
                                  cost["flops"]), src.token
        return edit.oracle_copy(src.refreshed, src.full.cache, order[:k]), src.token
    base = src.refreshed if method.refresh else None
    if method.prompt is None:
        return (base if base is not None else Edited(src.stale, src.decision, 0, 0.0, 0.0)), src.token
    p = src.prompt(method.prompt)
    e = edit.extend_from(src.model, p.cache if base is None else base.cache, p.ids, p.reuse, p.end)
    if base is not None:
        e = Edited(e.cache, e.pos, e.tokens + base.tokens, e.flops + base.flops, e.seconds + base.seconds)
    return e, int(p.ids[p.end])


def run(method: EditMethod, src: EditSource, k: int = 0, ranking: str | None = None) -> tuple[Edited, int]:
    """:func:`apply` with the ranking computed in the same call, after the field refresh (the unit a
    benchmark times: pass ``src.fresh()``).

    Raises:
        KeyError: an unknown ranking for a ranked method.
    """
    if method.refresh:
        _ = src.refreshed
    return apply(method, src, k, RANKINGS[ranking or ""].rank(src) if method.ranked else None)
