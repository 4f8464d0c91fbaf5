"""The edit-method registry's source for a scenario pair (:class:`kvnotes.ops.methods.EditSource`):
the stale cache of the old prompt, the full re-prefill and the field refresh, and the edited prompts
the registry's methods name (erratum, wrong erratum, length-matched notice, hoisted layout),
rendered for the pair (``docs/probes/edit.md``; the other source is
:class:`kvnotes.context.EditableContext`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness import edit_prompts as sedits
from kvnotes.harness.selection import pair_rng
from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit, methods
from kvnotes.ops.methods import EditSource, Prompted


class PairEditor(EditSource):
    """What every method of one pair reads (:class:`kvnotes.ops.methods.EditSource`), shared by the
    direct and CoT readouts: the stale cache, the full re-prefill and the field refresh (each
    computed once), and the prompts the methods name, rendered for this pair (:data:`PROMPTS`)."""

    def __init__(self, ctx, pair, kwargs: dict):
        self.ctx, self.pair = ctx, pair
        self.tok = ctx.bundle.tokenizer
        cfg = ctx.cfg
        self.placement = str(cfg.placement)
        self.template = str(cfg.erratum_template or sedits.ERRATUM_TEMPLATE)
        self.chat = ctx.scenario.chat_template
        self.kwargs = kwargs
        transcript = ctx.scenario.transcript
        self.turns = None if transcript is None else transcript.turns      # None: the flat layout
        spec = pair.spec
        self.inst, self.variant = spec.instance, spec.variant
        same = sedits.edited_prompt(self.tok, self.inst, spec.old, pair.old, self.variant, chat_template=self.chat,
                                    template_kwargs=kwargs, turns=self.turns)
        if not torch.equal(same.prompt.ids, pair.old.ids):
            raise KvnotesError("edit: re-rendering the old prompt does not reproduce its tokens; set "
                               "probe.chat_template_kwargs to null (the model's template arguments)")
        self.d = pair.decision
        model = ctx.bundle.model
        super().__init__(model, AllSlotCache.prefill(model, pair.old.ids[: self.d]), pair.new.ids, pair.field, self.d,
                         int(pair.old.ids[self.d]))
        _ = self.full                                   # the reference, computed first

    def prompt_names(self) -> tuple[str, ...]:
        return tuple(PROMPTS)

    def prompt(self, name: str) -> Prompted:
        """The edited prompt ``name`` of this pair (:data:`PROMPTS`).

        Raises:
            KvnotesError: an unknown prompt.
        """
        if name not in PROMPTS:
            raise KvnotesError(f"edit: no {name!r} prompt (known: {', '.join(PROMPTS)})")
        return PROMPTS[name](self)

    def rng(self) -> np.random.Generator:
        """The pair's seeded generator (:func:`kvnotes.harness.selection.pair_rng`)."""
        return pair_rng(self.ctx.seed, self.pair.spec.id)

    def noticed(self, text: str) -> Prompted:
        """The old prompt with ``text`` inserted at the configured placement, aligned with the stale cache."""
        ep = sedits.edited_prompt(self.tok, self.inst, self.pair.spec.old, self.pair.old, self.variant,
                                  notice=text, placement=self.placement, chat_template=self.chat,
                                  template_kwargs=self.kwargs, turns=self.turns)
        return Prompted(self.stale, ep.prompt.ids, ep.reuse, ep.prompt.decision)

    def hoisted(self) -> Prompted:
        """The new value in the hoisted layout, aligned with the old value's hoisted prompt, whose cache
        (what one would have stored with that layout) is prefilled here, not counted."""
        spec = self.pair.spec
        old_h, new_h = sedits.hoisted_pair(self.tok, self.inst, spec.old, spec.new, self.variant, self.chat,
                                           self.kwargs, self.turns)
        cached = AllSlotCache.prefill(self.model, old_h.ids[: old_h.decision])
        return Prompted(cached, new_h.prompt.ids, new_h.reuse, new_h.prompt.decision)

    def named(self) -> dict[str, tuple[edit.Edited, int]]:
        """``name -> (edited, decision token)`` for every method of the registry that is not ranked
        (:data:`EDIT_METHODS`), in record order."""
        return {name: methods.apply(methods.METHODS[name], self) for name in EDIT_METHODS}

    def erratum(self, value: str) -> str:
        """The erratum text stating ``value`` for this pair's instance."""
        return sedits.erratum_text(self.inst, value, self.template)

    def rankings(self, names) -> dict[str, tuple[list[int], dict]]:
        """``name -> (downstream positions in ranked order, cost)`` for registered rankings (:data:`RANKINGS`).

        Raises:
            KvnotesError: an unknown ranking name.
        """
        out = {}
        for name in names:
            if name not in RANKINGS:
                raise KvnotesError(f"edit: unknown ranking '{name}' (known: {', '.join(RANKINGS)})")
            out[name] = RANKINGS[name].rank(self)
        return out


#: The prompts the registry's prompt steps name, rendered for a pair: ``name -> fn(editor)``.
PROMPTS = {
    "erratum": lambda ed: ed.noticed(ed.erratum(ed.pair.spec.new)),
    "wrong_erratum": lambda ed: ed.noticed(ed.erratum(ed.pair.spec.old)),
    "irrelevant_notice": lambda ed: ed.noticed(sedits.length_matched_notice(
        ed.tok, sedits.notice_tokens(ed.tok, ed.erratum(ed.pair.spec.new)))),
    "hoist": lambda ed: ed.hoisted(),
}


#: The named edits every pair gets, in record order: the registry's methods that are not ranked.
EDIT_METHODS: tuple[str, ...] = tuple(n for n, m in methods.METHODS.items() if not m.ranked)


#: The rankings of ranked methods (``selective@K``): the registry's (:data:`kvnotes.ops.methods.RANKINGS`).
RANKINGS = methods.RANKINGS


#: Edit methods that are controls (they should not move the decision the way the edit does).
CONTROLS: list[str] = list(methods.controls())


def sweep_methods(editor: PairEditor, rankings: list[str], ks: list[int], oracle_ranking: str | None):
    """Yield ``(method name, ranking, K, edited)`` for the ranked methods of the registry: each
    ranking of ``rankings`` for a method, ``oracle_ranking`` (None: skipped) for an upper bound."""
    n_down = editor.pair.downstream[1] - editor.pair.downstream[0]
    ranked = editor.rankings(sorted(set(rankings) | ({oracle_ranking} if oracle_ranking else set())))
    for m in methods.METHODS.values():
        if not m.ranked or (m.upper_bound and not oracle_ranking):
            continue
        for name in ([oracle_ranking] if m.upper_bound else rankings):
            for k in ks:
                if k <= n_down:
                    yield (m.variant(name, k), m.name if m.upper_bound else name, k,
                           methods.apply(m, editor, k, ranked[name])[0])
