"""A screened pair under the run's readout: the object a pair probe measures on.

:class:`ScreenedPair` (the direct readout: the decision read at the decision position ``d``) and
:class:`GeneratedPair` (the generated readout, ``scenario.variant=cot``: the decision read after
each chain's answer marker) answer the same calls, so a probe asks for its interventions once and
never which readout runs (the loop that makes them is :mod:`kvnotes.harness.protocol`):

- :meth:`ScreenedPair.score`: K/V patch variants from the new run into the old run
  (:class:`Scored`);
- :meth:`ScreenedPair.knockout`: key groups hidden from the queries that read the decision, in
  both clean runs (:class:`Knocked`), with those queries' attention mass per key group captured;
- :meth:`ScreenedPair.chain_columns`: what only a chain has (nothing under the direct readout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvnotes.harness import kit as K
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import PairRun, candidate_scores, first_token_scores, variant_scores
from kvnotes.kv import cache as kvcache
from kvnotes.kv import generate as kvgen
from kvnotes.kv import patch as kvpatch
from kvnotes.kv.decision import recovery
from kvnotes.kv.knockout import CHAIN_GROUPS, GROUPS, chain_spans, decision_forward, generate_knocked, group_masses
from kvnotes.kv.masks import Masks, site_masks
from kvnotes.kv.sites import Site, kv_site
from kvnotes.models.adapters import Adapter

#: The readouts a decision is read under (module docstring): ``scenario.variant=direct`` / ``cot``.
Readout = Literal["direct", "generated"]
READOUTS: tuple[Readout, ...] = ("direct", "generated")
#: The two clean runs of a pair.
SIDES = ("old", "new")


@dataclass
class Scored:
    """Patched variants of one pair scored under the run's readout (one entry per variant).

    Attributes:
        s: score ``log p(new) - log p(old)`` of the decision's first tokens (nats); None where a
            chain missed its marker.
        r: recovery ``(s - s_old) / (s_new - s_old)``, unclipped (docs/design.md §3); None with ``s``.
        flipped: the patched run takes the new run's decision (direct: the score's sign equals the
            new run's; generated: the owned top-1 after the marker is the new candidate).
        side: the candidate the patched run decides for, ``"old"`` / ``"new"`` (direct: by the
            score's sign; generated: the owned top-1 after the marker, None when neither).
        reached: the chain reached its marker (always true under the direct readout).
        chains: the generated chains (:class:`kvnotes.kv.generate.Chain`), None under direct.
        unreached: per variant, the exclusion reason of a chain that missed its marker
            (``<name>_no_marker``, ``<name>_truncated_in_think``: :func:`kvnotes.harness.kit.cot_unreached`,
            named by the variant names given to :meth:`ScreenedPair.score`), else None; None under direct.
    """

    s: list[float | None]
    r: list[float | None]
    flipped: list[bool | None]
    side: list[str | None]
    reached: list[bool]
    chains: list[kvgen.Chain] | None = None
    unreached: list[str | None] | None = None


def mass_groups(readout: Readout) -> tuple[str, ...]:
    """The key groups of :attr:`Knocked.masses` under a readout: :data:`kvnotes.kv.knockout.GROUPS`
    (the decision query sees the prompt's keys), under the generated readout also ``chain`` (the
    generated tokens, which every later query of a chain sees): :data:`kvnotes.kv.knockout.CHAIN_GROUPS`."""
    return CHAIN_GROUPS if readout == "generated" else GROUPS


@dataclass
class Knocked(Scored):
    """Knockout variants of one clean run of a pair under the run's readout
    (:meth:`ScreenedPair.knockout`); :class:`Scored`'s entries per variant (variant 0 knocks
    nothing out: the clean run, re-read), and what the knockout captured.

    Attributes:
        logprobs: fp32 ``[V, vocab]`` log-probs of the decision's first token: at the decision
            position (direct) or right after the chain's answer marker (generated).
        masses: fp32 ``[V, S, n_layers, G]`` head-mean attention mass per query, layer and key group
            (:attr:`groups`) of the queries that read the decision: ``S = 1``, the decision query
            (direct); the decision query, then one per decode step, the query of each generated
            token (generated; a chain that ended earlier keeps its batch row's later steps).
        groups: the key groups of ``masses`` (:func:`mass_groups`).
        lengths: per variant, the tokens its chain generated (0 under the direct readout).
        recon_err: max |the model's eager attention - the executed attention| over the captured
            queries (a check of the capture).
    """

    logprobs: torch.Tensor | None = None
    masses: torch.Tensor | None = None
    groups: tuple[str, ...] = GROUPS
    lengths: list[int] | None = None
    recon_err: float = 0.0

    def reading_masses(self, i: int) -> torch.Tensor:
        """fp32 ``[n_layers, G]``: variant ``i``'s mass of the queries that read its decision, mean
        over them: the decision query (direct, or a chain that generated nothing) or the chain's
        generated tokens' queries (steps ``1 .. length``)."""
        assert self.masses is not None and self.lengths is not None
        n = self.lengths[i]
        return self.masses[i, 1: n + 1].mean(0) if n else self.masses[i, :1].mean(0)


class ScreenedPair:
    """A pair that passed the screen, with its clean scores, under the direct readout.

    Attributes:
        run: its :class:`kvnotes.harness.readout.PairRun` (prefix caches over ``[0, d)``, or
            released: :meth:`score` prefills them again).
        readout: ``"direct"``.
    """

    readout = "direct"

    def __init__(self, run: PairRun, model, mode: str = "first_token",
                 budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES, timer: Callable[[str], Any] | None = None):
        self.run, self.model, self.mode, self.budget_bytes = run, model, mode, budget_bytes
        self.timer = timer or (lambda name: nullcontext())

    @classmethod
    def of(cls, ctx, run: PairRun) -> "ScreenedPair":
        """The pair under the run's readout mode, memory budget and timer."""
        return cls(run, ctx.bundle.model, ctx.readout, ctx.budget_bytes, ctx.timer)

    @property
    def pair(self):
        return self.run.pair

    @property
    def s_old(self) -> float:
        return self.run.s_old

    @property
    def s_new(self) -> float:
        return self.run.s_new

    def clean_side(self, run: str) -> str:
        """The candidate a clean run (``"old"`` / ``"new"``) decides for: by its score's sign."""
        return "new" if (self.s_new if run == "new" else self.s_old) > 0 else "old"

    def chain_columns(self, sc: Scored, i: int, *, chain: str | None = None, length: str | None = None,
                      reached: str | None = None, unreached: str | None = None, side: str | None = None,
                      reproduces: tuple[str, str] | None = None) -> dict:
        """The generated readout's columns of variant ``i`` of ``sc``, under the keys the probe
        names: ``chain`` its chain record (:meth:`kvnotes.kv.generate.Chain.record`), ``length`` its
        length, ``reached``, ``unreached`` its exclusion reason (None when it reached its marker),
        ``side`` the candidate it decided for (:attr:`Scored.side`), ``reproduces`` ``(key, run)``:
        whether it decoded the clean ``run``'s chain token for token. None under the direct
        readout, which reads no chain."""
        return {}

    def chain_records(self, sc: Scored, names: Mapping[str, int], key: str) -> dict:
        """``{key: {name: chain record}}`` of the variants ``names`` points at (name -> index into
        ``sc``; :meth:`kvnotes.kv.generate.Chain.record`); nothing under the direct readout."""
        return {}

    def masks(self, sets: Sequence[Sequence[int] | Site]) -> Masks:
        """Patch masks ``[V, n_layers, d]`` of position sets in ``[0, d)`` (every layer and KV head) or
        of K/V :class:`kvnotes.kv.sites.Site` (positions in some layers and KV heads: a head patch,
        :func:`kvnotes.kv.masks.site_masks`)."""
        if any(isinstance(s, Site) for s in sets):
            ad = Adapter.for_model(self.model)                     # heads as the cache holds them
            return site_masks(ad.n_layers, self.pair.decision,
                              [s if isinstance(s, Site) else kv_site(s) for s in sets], ad.cache_heads)
        n_layers = self.model.config.get_text_config().num_hidden_layers
        return kvpatch.position_masks(n_layers, self.pair.decision, [list(s) for s in sets])

    @torch.no_grad()
    def score(self, masks: Masks, names: Sequence[str] | None = None) -> Scored:
        """Score ``masks`` (bool ``[V, n_layers, d]``: patch from the new run where true; or
        :class:`kvnotes.kv.masks.FactoredMasks`) in one
        batched call chunked to the memory budget (:func:`kvnotes.harness.readout.variant_scores`);
        ``names`` (one per variant) label a generated chain's exclusion reason.

        Raises:
            ValueError: the readout mode is not one.
        """
        run = self.run.with_caches(self.model)
        with self.timer("variants"):
            s = variant_scores(self.model, run.pair, run.old_cache, run.new_cache, masks, self.mode, self.budget_bytes)
        flipped = run.decision_flipped(s).tolist()
        return Scored(s.tolist(), run.recovery(s).tolist(), flipped, ["new" if x > 0 else "old" for x in s.tolist()],
                      [True] * len(flipped))

    @torch.no_grad()
    def knockout(self, knock: Masks, groups: Mapping[str, tuple[int, int]]) -> dict[str, Knocked]:
        """Hide keys from the queries that read the decision, in both clean runs, under the run's
        readout, capturing those queries' attention mass per key group.

        Direct: the decision token is fed at ``d`` on each run's prefix cache with variant ``v``'s
        keys hidden from the decision row (:func:`kvnotes.kv.knockout.decision_forward`; both runs
        in the same batched forwards, chunked to the memory budget) and the decision is scored
        there (the run's readout mode).

        Args:
            knock: bool ``[V, n_layers, d]`` (:func:`kvnotes.kv.knockout.knockout_masks`; variant 0
                knocks nothing out, the clean run).
            groups: the key groups of :func:`kvnotes.kv.knockout.key_groups`, whose masses are captured.

        Returns:
            ``{"old": Knocked, "new": Knocked}``.

        Raises:
            KvnotesError: a knockout under an attention implementation other than sdpa/eager.
        """
        run = self.run.with_caches(self.model)

        def forward(tokens, first):
            read = decision_forward(self.model, run.old_cache, tokens, knock, first, self.budget_bytes, run.new_cache)
            return read.logprobs, read

        with self.timer("knockout"):                      # both runs in the same forwards: old rows, then new rows
            both, read = candidate_scores(forward, run.pair, self.mode)
        V = knock.shape[0]
        out = {}
        for half, name in enumerate(("old", "new")):
            rows = slice(half * V, (half + 1) * V)
            s = both[rows]
            out[name] = Knocked(s.tolist(), run.recovery(s).tolist(), run.decision_flipped(s).tolist(),
                                ["new" if x > 0 else "old" for x in s.tolist()], [True] * V,
                                logprobs=read.logprobs[rows, 0], masses=group_masses(read.probs[rows], groups)[:, None],
                                groups=GROUPS, lengths=[0] * V,
                                recon_err=read.recon_err_source if half else read.recon_err)
        return out

    def released(self) -> "ScreenedPair":
        """This pair without its prefix caches (:meth:`kvnotes.harness.readout.PairRun.released`)."""
        return ScreenedPair(self.run.released(), self.model, self.mode, self.budget_bytes, self.timer)


class GeneratedPair(ScreenedPair):
    """A pair that passed the generated screen: its prefix caches and the clean chains' scores
    (read after their markers); :meth:`score` decodes the variants' chains."""

    readout = "generated"

    def __init__(self, ctx, pair, old_cache, new_cache, screen: dict, max_new: int):
        self.ctx, self._pair, self.old_cache, self.new_cache = ctx, pair, old_cache, new_cache
        #: the clean chains' token ids, ``"old"`` / ``"new"``
        self.chain_ids = {side: screen[f"chain_{side}"]["ids"] for side in ("old", "new")}
        s_old, s_new = screen["s_old"], screen["s_new"]
        self.model, self.timer = ctx.bundle.model, ctx.timer
        self._s_old, self._s_new, self.max_new = s_old, s_new, max_new

    @property
    def pair(self):
        return self._pair

    @property
    def s_old(self) -> float:
        return self._s_old

    @property
    def s_new(self) -> float:
        return self._s_new

    def clean_side(self, run: str) -> str:
        """The candidate a clean run decides for: its own (the generated screen measures a pair
        when both clean chains reached their markers)."""
        return run

    def chain_columns(self, sc: Scored, i: int, *, chain: str | None = None, length: str | None = None,
                      reached: str | None = None, unreached: str | None = None, side: str | None = None,
                      reproduces: tuple[str, str] | None = None) -> dict:
        """:meth:`ScreenedPair.chain_columns` of a generated chain."""
        assert sc.chains is not None and sc.unreached is not None
        c = sc.chains[i]
        named = {chain: c.record(), length: c.length, reached: c.reached, unreached: sc.unreached[i], side: sc.side[i]}
        out = {key: value for key, value in named.items() if key is not None}
        if reproduces is not None:
            out[reproduces[0]] = c.ids == self.chain_ids[reproduces[1]]
        return out

    def chain_records(self, sc: Scored, names: Mapping[str, int], key: str) -> dict:
        """:meth:`ScreenedPair.chain_records` of generated chains."""
        assert sc.chains is not None
        return {key: {name: sc.chains[i].record() for name, i in names.items()}}

    @torch.no_grad()
    def score(self, masks: Masks, names: Sequence[str] | None = None) -> Scored:
        """Decode every variant's chain in one batch and read each decision after its marker
        (``names`` label the exclusion reason of a chain that missed it)."""
        ctx, pair = self.ctx, self._pair
        model, d = ctx.bundle.model, pair.decision
        with ctx.timer("generate"):
            gen = kvgen.generate(model, kvcache.build_variants(model.config, self.old_cache, self.new_cache, masks),
                                 int(pair.old.ids[d]), d, self.max_new, K.cot_marker(ctx, pair),
                                 K.stop_tokens(ctx.bundle.tokenizer))
        reached = [c.reached for c in gen.chains]
        side = [kvgen.owned_side(lp, pair) if ok else None for lp, ok in zip(gen.logprobs, reached)]
        s = [float(first_token_scores(lp[None], pair)[0]) if ok else None for lp, ok in zip(gen.logprobs, reached)]
        names = names or [str(i) for i in range(len(gen.chains))]
        unreached = [None if c.reached else K.cot_unreached(ctx, names[i], c) for i, c in enumerate(gen.chains)]
        return Scored(s, [recovery(x, self._s_old, self._s_new) for x in s],
                      [x == "new" if ok else None for x, ok in zip(side, reached)], side, reached, gen.chains,
                      unreached)

    @torch.no_grad()
    def knockout(self, knock: Masks, groups: Mapping[str, tuple[int, int]]) -> dict[str, Knocked]:
        """:meth:`ScreenedPair.knockout` under the generated readout: per run one batch from the run's
        one prefix cache decodes every variant's chain (:func:`kvnotes.kv.knockout.generate_knocked`):
        the knocked keys are hidden from the decision query and from every generated token's query
        in the variant's layers, on every decode step; each decision is read after its chain's
        marker, and every query's mass is captured over the groups and the chain itself
        (:func:`mass_groups`). A chain that missed its marker has ``s``, ``r``, ``flipped`` and
        ``side`` None and its reason in ``unreached``, named by the run (``old_no_marker``, ...)."""
        ctx, pair = self.ctx, self._pair
        d = pair.decision
        marker, stops = K.cot_marker(ctx, pair), K.stop_tokens(ctx.bundle.tokenizer)
        out = {}
        for name, cache in (("old", self.old_cache), ("new", self.new_cache)):
            with ctx.timer("knockout_generate"):
                gen, hook = generate_knocked(self.model, cache, int(pair.old.ids[d]), self.max_new, marker, stops,
                                             knock, chain_spans(dict(groups), d))
            reached = [c.reached for c in gen.chains]
            scores = first_token_scores(gen.logprobs, pair).tolist()
            s = [x if ok else None for x, ok in zip(scores, reached)]
            side = [kvgen.owned_side(lp, pair) if ok else None for lp, ok in zip(gen.logprobs, reached)]
            out[name] = Knocked(s, [recovery(x, self._s_old, self._s_new) for x in s],
                                [x == "new" if ok else None for x, ok in zip(side, reached)], side, reached, gen.chains,
                                [None if c.reached else K.cot_unreached(ctx, name, c) for c in gen.chains],
                                logprobs=gen.logprobs, masses=hook.step_masses(), groups=CHAIN_GROUPS,
                                lengths=[c.length for c in gen.chains], recon_err=hook.max_recon_err)
        return out

    def released(self) -> "GeneratedPair":
        return self


#: The pair loop's clean chains under the generated readout: a prompt's key (:func:`_chain_key`) ->
#: its clean chain and the fp32 ``[vocab]`` log-probs after its marker (NaN where unreached).
ChainMemo = dict[tuple, tuple[kvgen.Chain, torch.Tensor]]


def _chain_key(pair, side: str) -> tuple:
    """What a clean chain depends on: the scenario and prompt variant (its marker) and the side's
    tokens through the decision position (the prefix ``[0, d)`` and the token fed at ``d``)."""
    d = pair.decision
    return pair.spec.instance.scenario.id, pair.spec.variant, tuple(getattr(pair, side).ids[: d + 1].tolist())


@torch.no_grad()
def screen_generated(ctx, pair, max_new: int, memo: ChainMemo | None = None) -> tuple[GeneratedPair | None, dict]:
    """Screen one pair under the generated readout: the clean old and new chains decode greedily
    from their prefix caches over ``[0, d)`` (in one batch) and each decision is read after its
    marker (:func:`kvnotes.kv.generate.generate`).

    A prompt's clean chain is the same in every pair that holds it (an instance's value is the old
    run of some pairs and the new run of others): with ``memo`` (the pair loop's :data:`ChainMemo`)
    each prompt's chain decodes once, and a prefix is prefilled only to decode its chain or to be
    measured.

    Returns:
        (the :class:`GeneratedPair`, or None when a clean chain missed its marker; the row:
        :func:`kvnotes.harness.pairs.pair_row` and the screen's columns: ``s_old`` / ``s_new`` after
        the markers (None where unreached), ``effect``, ``flips`` (the old chain names the old
        candidate and the new chain the new one), ``reason`` (None, ``no_cot_flip``, or the
        unreached reason ``old_no_marker``, ``new_truncated_in_think``, ...), ``chain_old`` /
        ``chain_new`` (:meth:`kvnotes.kv.generate.Chain.record`)).
    """
    model, d = ctx.bundle.model, pair.decision
    memo = {} if memo is None else memo
    caches: dict = {}

    def cache(side: str):
        if side not in caches:
            with ctx.timer("prefill"):
                caches[side] = kvcache.prefill(model, getattr(pair, side).ids[:d])
        return caches[side]

    keys = {side: _chain_key(pair, side) for side in SIDES}
    todo = [side for side in SIDES if keys[side] not in memo]
    if todo:
        start = cache(todo[0])                      # one chain alone; both in one batch of variants
        if len(todo) == 2:
            both = torch.stack([torch.zeros(len(start.layers), d, dtype=torch.bool),
                                torch.ones(len(start.layers), d, dtype=torch.bool)])
            start = kvcache.build_variants(model.config, start, cache("new"), both)
        with ctx.timer("cot_screen"):
            gen = kvgen.generate(model, start, torch.stack([getattr(pair, side).ids[d] for side in todo]), d, max_new,
                                 K.cot_marker(ctx, pair), K.stop_tokens(ctx.bundle.tokenizer))
        for i, side in enumerate(todo):
            memo[keys[side]] = gen.chains[i], gen.logprobs[i]
    chains = {side: memo[keys[side]] for side in SIDES}
    cols: dict = {f"chain_{side}": chain.record() for side, (chain, _) in chains.items()}
    scores = {side: float(first_token_scores(lp[None], pair)[0]) if chain.reached else None
              for side, (chain, lp) in chains.items()}
    s_old, s_new = scores["old"], scores["new"]
    cols |= {"s_old": s_old, "s_new": s_new, "effect": s_new - s_old if s_old is not None and s_new is not None else None}
    row = pair_row(pair) | cols
    for side, (chain, _) in chains.items():
        if not chain.reached:
            return None, row | {"flips": False, "reason": K.cot_unreached(ctx, side, chain)}
    flips = [kvgen.owned_side(lp, pair) for _, lp in chains.values()] == list(SIDES)
    row |= {"flips": flips, "reason": None if flips else "no_cot_flip"}
    return GeneratedPair(ctx, pair, cache("old"), cache("new"), row, max_new), row
