"""An editable cached context: a prompt made of text, named fields and precompiled chunks whose KV
cache is kept and edited instead of recomputed (paper "Models Take Notes at Prefill", §editing and
§composition; its code's ``editkv.EditableContext``, rebuilt on :mod:`kvnotes.ops`).

A person building an agent writes the context once, prefills it, and then changes a field::

    ctx = EditableContext(model, tokenizer, answer_prefix="Answer:")
    ctx.add_text("Order 1042 was placed on 3 May. Order status: ")
    ctx.add_field("status", "shipped", label="the order status")
    ctx.add_request("\\nCan the customer still cancel the order? Answer yes or no.")
    ctx.prefill()
    ctx.decide([" yes", " no"]).top1            # the decision on the cached prompt
    ctx.edit("status", "pending", mode="auto", candidates=[" yes", " no"])

How the prompt is built. The user message is the segments in order (text, field values, chunk
texts, errata), rendered once through the model's chat template and tokenised with character offsets
(:func:`kvnotes.models.text.render_segments`); a field's token span is the tokens overlapping its
characters. A field's label is never rendered: the text around the value is the caller's, so the
paper's double label (``account_role: account_role: admin``) cannot happen. Errata are inserted
before the request (the decision block), the placement the harness measures (``docs/editing.md``).
Chunks are precompiled once (:func:`kvnotes.ops.compose.precompile`, behind the BOS token) and
spliced with their keys rotated to their positions (:func:`kvnotes.ops.compose.compose`).

The cache covers positions ``[0, T - 1)`` of the ``T`` prompt tokens; the last token is fed when a
decision is read (:meth:`EditableContext.decide`) or a reply generated (:meth:`EditableContext.generate`).

Edit modes (:data:`MODES`): the modes of the edit-method registry (:mod:`kvnotes.ops.methods`), each
running its method's steps on this prompt (costs in tokens forwarded through every layer), and ``auto``:

- ``stale``: nothing is recomputed (the control);
- ``in_place`` (``refresh_field``): the field's tokens recomputed against the unchanged prefix and
  written in place; downstream stays stale. A value whose tokens change the prompt's length or
  alignment re-prefills from the first changed token instead (``applied="reprefill_from_field"``);
- ``erratum``: a correction line (:data:`ERRATUM_TEMPLATE`) inserted before the request, forwarded
  from the longest common token prefix; the field's text keeps its old value;
- ``field_plus_erratum``: both;
- ``selective@K`` / ``selective@P%``: ``in_place``, then a true recompute of the ``K`` (P% of the)
  downstream positions whose layer-1 K/V deviate most (CacheBlend's ranking,
  :func:`kvnotes.ops.edit.rank_kv_deviation`);
- ``full``: a re-prefill of the current prompt (every field at its value, no errata): the reference;
- ``auto``: :meth:`EditableContext.diagnose` decides whether the in-place edit suffices (a corrected
  arm, ``check=``: ``selective@50%`` by default, or ``field_plus_erratum`` as in the paper; a rule,
  :func:`verdict`) and applies ``in_place``, or else a re-prefill (``fallback="full"``, the default)
  or the corrected arm (``fallback="corrected"``).

Imports nothing from kvnotes.scenarios, probes or the harness.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv.cache import AllSlotCache
from kvnotes.kv.decision import DEFAULT_MARGIN, RULES, Decision, verdict
from kvnotes.kv.generate import generate as decode
from kvnotes.kv.generate import stop_tokens
from kvnotes.models.text import Layout, Segment, candidate_first_tokens, render_segments
from kvnotes.ops import edit as ops
from kvnotes.ops import methods
from kvnotes.ops.methods import Cost
from kvnotes.ops.chunk import Chunk, precompile
from kvnotes.ops.compose import compose

#: The correction the erratum modes insert, and the erratum edit of the harness
#: (:mod:`kvnotes.harness.edit_prompts`, ``docs/editing.md``); ``{field}`` is the field's label (the
#: scenario's domain in the harness), ``{value}`` its new value.
#: The erratum's default line (the ``override`` wording of :data:`ERRATUM_WORDINGS`).
ERRATUM_TEMPLATE = ("[STATE UPDATE] {field} has changed to {value}; this overrides any earlier value "
                    "and any earlier conclusion.")
#: Wordings of the erratum line (the paper's Figure 3d: none, value, tag, override, re-evaluate;
#: anchors §7.10), ``{field}`` the scenario's domain: the erratum method's template (``probe.erratum_wordings``).
ERRATUM_WORDINGS: dict[str, str] = {
    "none": "{value}", "value": "{field}: {value}", "tag": "[STATE UPDATE] {field}: {value}", "override": ERRATUM_TEMPLATE,
    "reevaluate": ERRATUM_TEMPLATE + " Re-evaluate the request with the new value before answering."}
#: The edit modes of :meth:`EditableContext.edit`: the registry's (:func:`kvnotes.ops.methods.modes`;
#: ``selective`` is written ``selective@K``) and ``auto``.
MODES = (*methods.modes(), "auto")


@dataclass(frozen=True)
class Diagnosis:
    """:meth:`EditableContext.diagnose`'s verdict on one edit.

    Attributes:
        needs_erratum: the in-place edit does not suffice (the paper's name): the corrected arm
            reaches a different owned decision, leading the in-place one by more than ``margin``.
        reason: one line saying why.
        in_place: the decision after the in-place edit.
        corrected: the decision after the corrected arm (``check``: field + erratum by default).
        check: the corrected arm.
        rule: the verdict's rule (:func:`verdict`).
        margin: the margin (nats) used.
        cost: the diagnostic's cost (both edits and both decision reads).
    """

    needs_erratum: bool
    reason: str
    in_place: Decision
    corrected: Decision
    margin: float
    cost: Cost
    check: str = "field_plus_erratum"
    rule: str = "flip"


@dataclass(frozen=True)
class EditReport:
    """What :meth:`EditableContext.edit` did.

    Attributes:
        field: the field's name.
        old, new: its value before and after.
        mode: the mode asked for.
        applied: what was applied: a mode name, ``selective@K``, or ``reprefill_from_field`` (an
            in-place edit whose tokens changed the prompt's length or alignment).
        cost: the edit's cost (the diagnostic's included for ``auto``).
        diagnosis: the :class:`Diagnosis` of an ``auto`` edit, else None.
    """

    field: str
    old: str
    new: str
    mode: str
    applied: str
    cost: Cost
    diagnosis: Diagnosis | None = None


@dataclass(frozen=True)
class _State:
    segments: tuple[Segment, ...]
    layout: Layout
    cache: AllSlotCache


def parse_mode(mode: str) -> tuple[str, int | float | None]:
    """``"selective@16"`` -> ``("selective", 16)`` (positions); ``"selective@25%"`` ->
    ``("selective", 0.25)`` (a share of the downstream positions); other modes -> ``(mode, None)``
    (:func:`kvnotes.ops.methods.parse_mode`).

    Raises:
        KvnotesError: an unknown mode, or ``selective`` without ``@K`` / ``@P%`` (K >= 0, 0 <= P <= 100).
    """
    return methods.parse_mode(mode, also=("auto",))


#: The corrected arms :meth:`EditableContext.diagnose` can compare the in-place edit with: the modes
#: whose method refreshes the field and then does more (an erratum, a ranked recompute).
_CORRECTED = tuple(m.mode for m in methods.METHODS.values() if m.mode and m.refresh and (m.prompt or m.ranked))
CHECKS = tuple(c for m in _CORRECTED for c in ((f"{m}@K", f"{m}@P%") if methods.for_mode(m).ranked else (m,)))
#: What ``auto`` applies when the in-place edit does not suffice.
FALLBACKS = ("full", "corrected")
#: ``auto``'s defaults, from ``kvnotes bench auto`` (``docs/context.md``): a true recompute of half
#: the downstream positions, its log-odds extrapolated to a full recompute (recall 9/9, precision
#: 9/13 on SmolLM2-135M; no false alarm on Gemma-3-270M, whose in-place edits never failed), and a
#: re-prefill when the in-place edit does not suffice. The paper's erratum check found none of
#: SmolLM2-135M's 9 in-place failures.
DEFAULT_CHECK, DEFAULT_RULE, DEFAULT_FALLBACK = "selective@50%", "extrapolate", "full"


def _common_prefix(old: torch.Tensor, new: torch.Tensor) -> int:
    """Length of the longest common prefix of two ``[T]`` id tensors, short of the shorter one's last token."""
    n = min(len(old), len(new)) - 1
    diff = (old[:n] != new[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class EditableContext:
    """A cached prompt of text, named fields and precompiled chunks, edited in place (module docstring).

    Args:
        model: a Hugging Face causal LM (eval mode).
        tokenizer: its tokenizer (a fast tokenizer: offsets are needed).
        answer_prefix: text that starts the assistant's reply (the decision is read after it).
        system: an optional system message (chat templates only).
        chat_template: render through the tokenizer's chat template when it has one (else plain
            ``user + "\\n" + answer_prefix``).
        template_kwargs: passed to the chat template (e.g. ``{"enable_thinking": False}``).
        erratum_template: the correction text (``{field}``, ``{value}``).
        chunk_store: precompiled chunks by text, shared between contexts (a chunk is precompiled
            once); a new dict when None.
        seam: chunk tokens recomputed at each chunk's start when composing (seam repair; 0 none).
    """

    def __init__(self, model, tokenizer, answer_prefix: str = "", *, system: str | None = None,
                 chat_template: bool = True, template_kwargs: dict | None = None,
                 erratum_template: str = ERRATUM_TEMPLATE, chunk_store: dict[str, Chunk] | None = None,
                 seam: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.answer_prefix, self.system = answer_prefix, system
        self.chat_template, self.template_kwargs = chat_template, template_kwargs
        self.erratum_template = erratum_template
        self.chunk_store: dict[str, Chunk] = {} if chunk_store is None else chunk_store
        self.seam = seam
        self._segments: list[Segment] = []
        self._values: dict[str, str] = {}
        self._labels: dict[str, str] = {}
        self._state: _State | None = None

    # ------------------------------------------------------------------------------- building

    def add_text(self, text: str) -> EditableContext:
        """Append plain text to the context (before :meth:`prefill`; afterwards use :meth:`append`)."""
        self._before_prefill("add_text")
        self._segments.append(Segment("text", text))
        return self

    def add_field(self, name: str, value: str, label: str | None = None) -> EditableContext:
        """Append a named field whose ``value`` is rendered as is (write its label in the text around
        it); ``label`` names it in an erratum (default: ``name``).

        Raises:
            KvnotesError: a duplicate name or an empty value.
        """
        self._before_prefill("add_field")
        if name in self._values:
            raise KvnotesError(f"field {name!r} is already in the context")
        self._check_value(name, value)
        self._segments.append(Segment("field", value, name))
        self._values[name], self._labels[name] = value, label or name
        return self

    def add_chunk(self, text: str) -> EditableContext:
        """Append text that is precompiled once (kept in :attr:`chunk_store`) and spliced in with its
        keys rotated to its position, instead of being prefilled with the context."""
        self._before_prefill("add_chunk")
        if not text:
            raise KvnotesError("a chunk needs text")
        self._segments.append(Segment("chunk", text))
        return self

    def add_request(self, text: str) -> EditableContext:
        """Set the request (the decision block), which stays last: errata and appended text go
        before it. At most one."""
        self._before_prefill("add_request")
        if any(s.kind == "request" for s in self._segments):
            raise KvnotesError("the context already has a request")
        self._segments.append(Segment("request", text))
        return self

    # ------------------------------------------------------------------------------- state

    @property
    def fields(self) -> dict[str, str]:
        """Every field's current value (what a full re-prefill would render)."""
        return dict(self._values)

    @property
    def layout(self) -> Layout:
        """The prompt the cache holds (fields at the values it was built with, errata included)."""
        return self._need_state().layout

    @property
    def cache(self) -> AllSlotCache:
        """The all-slot cache over ``[0, T - 1)`` of :attr:`layout`."""
        return self._need_state().cache

    @property
    def text(self) -> str:
        """The rendered prompt the cache holds."""
        return self.layout.text

    def fork(self) -> EditableContext:
        """A copy that shares the cache tensors (edits never modify a cache in place, so the copies
        evolve independently)."""
        other = object.__new__(EditableContext)
        other.__dict__.update(self.__dict__)
        other._segments, other._values, other._labels = list(self._segments), dict(self._values), dict(self._labels)
        return other

    # ------------------------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, compose_chunks: bool = True) -> Cost:
        """Build the cache of the current prompt: every field at its value, no errata. Chunks are
        precompiled (once per text) and spliced when ``compose_chunks``; else everything is
        prefilled (the reference a composed context is compared with).

        Returns:
            the cost (tokens forwarded in this call, chunk precompilation included).

        Raises:
            KvnotesError: an empty context or one whose last token lies in a chunk.
        """
        if not self._segments:
            raise KvnotesError("the context is empty: add text or fields before prefill()")
        segments = tuple(replace(s, text=self._values[s.name]) if s.kind == "field" else s
                         for s in self._segments if s.kind != "erratum")
        layout = self._layout(segments)
        t0 = time.perf_counter()
        T = layout.length
        if compose_chunks and any(p[0] == "chunk" for p in layout.pieces):
            cache, tokens = self._compose(layout)
        else:
            cache, tokens = AllSlotCache.prefill(self.model, layout.ids[:T - 1]), T - 1
        self._segments = list(segments)
        self._state = _State(segments, layout, cache)
        return Cost(tokens, ops.forward_flops(self.model.config, tokens, ops.span_pairs(T - 1 - tokens, T - 1)),
                    time.perf_counter() - t0)

    def _compose(self, layout: Layout) -> tuple[AllSlotCache, int]:
        T = layout.length
        bos = self.tokenizer.bos_token_id
        sink = layout.ids[:1] if bos is not None and int(layout.ids[0]) == bos else None
        if layout.pieces[-1][0] == "chunk":
            raise KvnotesError("the prompt ends inside a chunk; end the context with text or a request")
        parts: list = []
        tokens = 0
        for kind, s, e, text in layout.pieces:
            e = min(e, T - 1)                         # the last token is fed at the decision
            if e <= s:
                continue
            if kind == "live":
                parts.append(layout.ids[s:e])
                tokens += e - s
                continue
            chunk = self.chunk_store.get(text)
            if chunk is None or not torch.equal(chunk.ids, layout.ids[s:e].cpu()):
                chunk = self.chunk_store[text] = precompile(self.model, layout.ids[s:e], sink)
                tokens += e - s + (0 if sink is None else 1)
            parts.append(chunk)
            tokens += min(self.seam, e - s)
        cache, _ = compose(self.model, parts, rotate=True, seam=self.seam, all_slots=True)
        assert isinstance(cache, AllSlotCache)
        return cache, tokens

    # ------------------------------------------------------------------------------- editing

    def edit(self, name: str, value: str, mode: str = "in_place", candidates: Sequence[str] | None = None,
             margin: float = DEFAULT_MARGIN, check: str = DEFAULT_CHECK, rule: str = DEFAULT_RULE,
             fallback: str = DEFAULT_FALLBACK) -> EditReport:
        """Set field ``name`` to ``value`` and update the cache by ``mode`` (module docstring).

        Args:
            candidates: the decision's candidate continuations (``auto`` only).
            margin: the diagnostic's margin in nats (``auto`` only).
            check: the diagnostic's corrected arm (``auto`` only; :meth:`diagnose`), applied when
                the in-place edit does not suffice.
            rule: the diagnostic's rule (``auto`` only; :func:`verdict`).
            fallback: what ``auto`` applies when the in-place edit does not suffice: ``"full"`` (a
                re-prefill, exact) or ``"corrected"`` (the check's own arm, already computed).

        Raises:
            KvnotesError: an unknown field or mode, an empty value, ``auto`` without candidates, or
                :meth:`prefill` not called.
        """
        kind, k = parse_mode(mode)
        state = self._need_state()
        self._check_edit(name, value)
        old = self._values[name]
        diagnosis = None
        method = methods.for_mode(kind) if kind != "auto" else None
        if method is not None and method.reprefill:
            self._values[name] = value
            cost = self.prefill(compose_chunks=False)
            return EditReport(name, old, value, mode, kind, cost)
        if method is not None:
            new, cost, applied = self._apply(method, state, name, value, k)
        else:
            if not candidates:
                raise KvnotesError("edit(mode='auto') needs the decision's candidates (candidates=[...])")
            if fallback not in FALLBACKS:
                raise KvnotesError(f"unknown auto fallback {fallback!r}; choose one of {', '.join(FALLBACKS)}")
            diagnosis, states = self._diagnose(state, name, value, candidates, margin, check, rule)
            if diagnosis.needs_erratum and fallback == "full":
                self._values[name] = value
                cost = diagnosis.cost + self.prefill(compose_chunks=False)
                return EditReport(name, old, value, mode, "full", cost, diagnosis)
            new, applied = states["corrected" if diagnosis.needs_erratum else "in_place"]
            cost = diagnosis.cost
        self._values[name] = value
        self._state = new
        self._segments = list(new.segments)
        return EditReport(name, old, value, mode, applied, cost, diagnosis)

    def diagnose(self, name: str, value: str, candidates: Sequence[str], margin: float = DEFAULT_MARGIN,
                 check: str = DEFAULT_CHECK, rule: str = DEFAULT_RULE) -> Diagnosis:
        """Whether setting ``name`` to ``value`` needs an erratum (more than the in-place edit) or the
        in-place edit suffices, without changing the context.

        The in-place edit and a corrected arm (``check``: ``field_plus_erratum``, or ``selective@K`` /
        ``selective@P%``, a true recompute of K (P% of the) downstream positions after it) are applied
        to copies and their decisions compared by :func:`verdict` (``rule``, ``margin`` in nats). A
        value that changes the prompt's tokens is re-prefilled from the field on, which is exact:
        never needs more. (The paper's ``needs_erratum`` compares the in-place decision with the
        erratum decision after short greedy decodes, gated on the erratum moving the stale decision;
        its validation reached precision 0.56 / recall 0.71 at margin 0.2. ``docs/context.md``
        measures both rules against the full re-prefill.)

        Raises:
            KvnotesError: as :meth:`edit`.
        """
        state = self._need_state()
        self._check_edit(name, value)
        return self._diagnose(state, name, value, candidates, margin, check, rule)[0]

    def _diagnose(self, state: _State, name: str, value: str, candidates: Sequence[str], margin: float,
                  check: str, rule: str = "flip") -> tuple[Diagnosis, dict[str, tuple[_State, str]]]:
        kind, k = parse_mode(check)
        if rule not in RULES:
            raise KvnotesError(f"unknown diagnostic rule {rule!r}; choose one of {', '.join(RULES)}")
        if kind not in _CORRECTED:
            raise KvnotesError(f"unknown diagnostic check {check!r}; choose one of {', '.join(CHECKS)}")
        (ip, c_ip, applied_ip), (fe, c_all, fe_applied) = self._arms(state, name, value, methods.for_mode(kind), k)
        c_fe = Cost(c_all.tokens - c_ip.tokens, c_all.flops - c_ip.flops, c_all.seconds - c_ip.seconds)
        t0 = time.perf_counter()
        d_ip, d_fe = self._decide(ip, candidates), self._decide(fe, candidates)
        read = Cost(2, ops.forward_flops(self.model.config, 2, ip.layout.length + fe.layout.length),
                    time.perf_counter() - t0)
        if applied_ip != "in_place":
            needs, reason = False, "the value changed the prompt's tokens: re-prefilled from the field on (exact)"
        else:
            b = ip.layout.fields[name][1]
            share = 1.0 if k is None else int(fe_applied.split("@")[1]) / max(1, ip.layout.length - 1 - b)
            needs, reason = verdict(d_ip, d_fe, rule, margin, share)
            reason = f"{check}: {reason}"
        diag = Diagnosis(needs, reason, d_ip, d_fe, margin, c_ip + c_fe + read, check, rule)
        return diag, {"in_place": (ip, applied_ip), "corrected": (fe, fe_applied)}

    def append(self, text: str) -> Cost:
        """Append text to the context (before the request), forwarding from the longest common token
        prefix with the cached prompt.

        Raises:
            KvnotesError: :meth:`prefill` not called, or empty text.
        """
        state = self._need_state()
        if not text:
            raise KvnotesError("append() needs text")
        segments = self._insert_before_request(state.segments, Segment("text", text))
        new, cost = self._extend(state, segments)
        self._state, self._segments = new, list(new.segments)
        return cost

    def set_request(self, text: str) -> Cost:
        """Replace the request (the decision block: a new question each turn), forwarding from the
        longest common token prefix with the cached prompt (the request, the template's tail and
        the answer prefix: exact).

        Raises:
            KvnotesError: :meth:`prefill` not called.
        """
        state = self._need_state()
        rest = tuple(s for s in state.segments if s.kind != "request")
        new, cost = self._extend(state, (*rest, Segment("request", text)))
        self._state, self._segments = new, list(new.segments)
        return cost

    def _with_value(self, state: _State, name: str, value: str) -> tuple[tuple[Segment, ...], Layout, bool]:
        """Segments and layout with ``name`` set to ``value``, and whether they are token-aligned with the
        cached prompt's (same length and field span and tokens outside it): only then is a refresh in place."""
        segments = tuple(replace(s, text=value) if s.kind == "field" and s.name == name else s for s in state.segments)
        layout = self._layout(segments)
        a, b = state.layout.fields[name]
        old, new = state.layout.ids, layout.ids
        aligned = (layout.length == state.layout.length and (a, b) == layout.fields[name] and b < layout.length - 1
                   and torch.equal(old[:a], new[:a]) and torch.equal(old[b:], new[b:]))
        return segments, layout, aligned

    def _source(self, state: _State, segments: tuple[Segment, ...], layout: Layout, name: str, value: str,
                erratum: bool) -> tuple[methods.EditSource, tuple[tuple[Segment, ...], Layout]]:
        """The edit-method registry's source for ``layout`` (token-aligned with the cached prompt), with the
        erratum prompt if asked (forwarded from the common token prefix), and the segments and layout the edit leaves."""
        prompts, after = {}, (segments, layout)
        if erratum:
            with_erratum = self._insert_before_request(segments, Segment("erratum", self._notice(name, value), name))
            after = (with_erratum, e := self._layout(with_erratum))
            prompts["erratum"] = methods.Prompted(state.cache, e.ids, _common_prefix(layout.ids, e.ids), e.length - 1)
        d = layout.length - 1
        return methods.EditSource(self.model, state.cache, layout.ids, layout.fields[name], d, int(layout.ids[d]),
                                  prompts), after

    def _made(self, method: methods.EditMethod, src: methods.EditSource, after: tuple[tuple[Segment, ...], Layout],
              k: int | float | None = None) -> tuple[_State, Cost, str]:
        """``method``'s edit from ``src`` (:func:`kvnotes.ops.methods.apply`): the next state, its cost and what it
        applied; a ranked method recomputes the top ``k`` (or share ``k``) downstream positions by K/V deviation."""
        b, d = src.downstream
        n = (k if isinstance(k, int) else math.ceil((k or 0) * (d - b))) if method.ranked else 0
        ed, _ = methods.apply(method, src, n, methods.RANKINGS["kv_deviation"].rank(src) if method.ranked else None)
        return (_State(*after, ed.cache), Cost(ed.tokens + ed.rank_tokens, ed.flops, ed.seconds),
                f"{method.mode}@{n}" if method.ranked else str(method.mode))

    def _apply(self, method: methods.EditMethod, state: _State, name: str, value: str,
               k: int | float | None) -> tuple[_State, Cost, str]:
        """``method``'s edit for the field's new value (a registry mode, not a re-prefill; :meth:`_made`)."""
        if method.prompt not in (None, "erratum"):
            raise KvnotesError(f"edit mode {method.mode!r}: a context renders no {method.prompt!r} prompt")
        if method.refresh:
            return self._arms(state, name, value, method, k)[1]
        return self._made(method, *self._source(state, state.segments, state.layout, name, value, bool(method.prompt)))

    def _arms(self, state: _State, name: str, value: str, method: methods.EditMethod,
              k: int | float | None) -> tuple[tuple[_State, Cost, str], tuple[_State, Cost, str]]:
        """The in-place edit and ``method``'s built on it (one field refresh), each ``(state, cost from the cached
        state, applied)``; a value that changes the prompt's tokens is re-prefilled from the field on (exact)."""
        segments, layout, aligned = self._with_value(state, name, value)
        if not aligned:
            nxt, cost = self._extend(state, segments, layout)
            ip = (nxt, cost, "reprefill_from_field")
            if method.prompt is None:
                return ip, ip
            fe, c_fe = self._extend(nxt, self._insert_before_request(segments, Segment("erratum", self._notice(
                name, value), name)))
            return ip, (fe, cost + c_fe, "reprefill_from_field+erratum")
        src, edited = self._source(state, segments, layout, name, value, bool(method.prompt))
        return self._made(methods.for_mode("in_place"), src, (segments, layout)), self._made(method, src, edited, k)

    def _extend(self, state: _State, segments: tuple[Segment, ...], layout: Layout | None = None) -> tuple[_State, Cost]:
        """Re-render ``segments`` and forward the new prompt from its longest common token prefix
        with the cached one (exact for everything forwarded)."""
        layout = layout or self._layout(segments)
        reuse = _common_prefix(state.layout.ids, layout.ids)
        T = layout.length
        if reuse >= T - 1:                           # nothing before the fed token changed
            return _State(segments, layout, state.cache.truncate(T - 1)), Cost()
        ed = ops.extend_from(self.model, state.cache, layout.ids, reuse, T - 1)
        return _State(segments, layout, ed.cache), Cost(ed.tokens, ed.flops, ed.seconds)

    # ------------------------------------------------------------------------------- reading

    @torch.no_grad()
    def decide(self, candidates: Sequence[str]) -> Decision:
        """The decision among ``candidates`` (continuations of the answer prefix, e.g. ``" yes"``)
        at the end of the cached prompt: each candidate's first-token log-prob in context.

        Raises:
            KvnotesError: fewer than two candidates, a candidate that merges with the prompt's last
                token, or two candidates with the same first token.
        """
        return self._decide(self._need_state(), candidates)

    def _decide(self, state: _State, candidates: Sequence[str]) -> Decision:
        firsts = candidate_first_tokens(self.tokenizer, state.layout.text, state.layout.ids, candidates)
        T = state.layout.length
        lp = ops.decision_logprobs(self.model, state.cache, int(state.layout.ids[-1]), T - 1).float().cpu()
        scores = lp[torch.tensor(firsts)]
        top = int(scores.argmax())
        return Decision(tuple(candidates), scores, candidates[top], int(lp.argmax()) == firsts[top], lp)

    @torch.no_grad()
    def generate(self, max_new_tokens: int = 64, stop: str | None = None) -> str:
        """Greedy reply from the cached prompt, up to ``max_new_tokens`` tokens, an end-of-turn token
        or the text ``stop`` (cut before it). The cache is left unchanged."""
        state = self._need_state()
        T = state.layout.length
        if max_new_tokens <= 0:
            return ""
        reached = (lambda ids: stop in self.tokenizer.decode(ids, skip_special_tokens=True)) if stop else (lambda ids: False)
        out = decode(self.model, state.cache, int(state.layout.ids[-1]), T - 1, max_new_tokens, reached,
                     stop_tokens(self.tokenizer))
        text = self.tokenizer.decode(out.chains[0].ids, skip_special_tokens=True)
        return text.split(stop)[0] if stop else text

    # ------------------------------------------------------------------------------- helpers

    def _need_state(self) -> _State:
        if self._state is None:
            raise KvnotesError("call prefill() first")
        return self._state

    def _before_prefill(self, what: str) -> None:
        if self._state is not None:
            raise KvnotesError(f"{what}() builds the context before prefill(); after it use append() or edit()")

    def _check_edit(self, name: str, value: str) -> None:
        if name not in self._values:
            raise KvnotesError(f"no field {name!r} in the context (fields: {', '.join(self._values) or 'none'})")
        self._check_value(name, value)

    @staticmethod
    def _check_value(name: str, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise KvnotesError(f"field {name!r} needs a non-empty text value")

    def _notice(self, name: str, value: str) -> str:
        try:
            line = self.erratum_template.format(field=self._labels[name], value=value)
        except (KeyError, IndexError, ValueError) as exc:
            raise KvnotesError(f"erratum template: only {{field}} and {{value}} can be filled ({exc})") from None
        return line

    @staticmethod
    def _insert_before_request(segments: tuple[Segment, ...], seg: Segment) -> tuple[Segment, ...]:
        at = next((i for i, s in enumerate(segments) if s.kind == "request"), len(segments))
        prev = "".join(s.text for s in segments[:at])
        if seg.kind == "erratum":                    # a correction is a line of its own
            seg = replace(seg, text=("" if not prev or prev.endswith("\n") else "\n") + seg.text
                          + ("" if at == len(segments) or segments[at].text.startswith("\n") else "\n"))
        return (*segments[:at], seg, *segments[at:])

    def _layout(self, segments: tuple[Segment, ...]) -> Layout:
        """Render, tokenise and locate the fields and chunks of ``segments`` (:func:`kvnotes.models.text.render_segments`)."""
        return render_segments(self.tokenizer, segments, self.answer_prefix, self.chat_template, self.system,
                               self.template_kwargs)
