"""The pair loop of a probe, owned by the harness, with the readout as a parameter of the run.

A pair probe says what to measure on each screened pair; everything else is the harness's job,
here, for both readouts:

- **direct** (``scenario.variant=direct``, the default): every aligned pair is prefilled and
  screened under the run's flip rule (:func:`kvnotes.harness.kit.each_pair`: the clean-run store,
  progress, timing); patched variants are scored in one batched call chunked to the memory budget
  (:func:`kvnotes.harness.readout.variant_scores`, the run's ``readout`` mode).
- **generated** (``scenario.variant=cot``): pairs are taken round-robin over scenarios up to the
  probe's ``cot_max_pairs`` (the rest counted ``beyond_max_pairs``); per pair both prefixes are
  prefilled and the clean chains decode greedily in one batch (:func:`kvnotes.harness.kit.cot_screen`,
  at most ``cot_max_new_tokens`` tokens): the old chain must name the old candidate after the
  scenario's answer marker (after the think block on a thinking model) and the new chain the new
  one (exclusions: ``<side>_no_marker``, ``<side>_truncated_in_think``, ``no_cot_flip``). Patched
  variants then decode their reasoning in one batch (:func:`kvnotes.kv.generate.generate`) and each
  decision is read after its chain's marker.

Either way the probe sees a :class:`ScreenedPair` (the pair, its clean scores, and ``score(masks)``
giving a :class:`Scored` under the run's readout) and its row (:func:`kvnotes.harness.pairs.pair_row`
and the screen's columns). :func:`pair_loop` runs the loop for any measurement; :func:`run_patches`
is the loop of a *patch probe*, one that names, per pair, position sets of the prefix ``[0, d)`` to
patch (every layer) from the new run's K/V into the old run's (activation patching: the new run is
the clean source, the old run the patched one). A patch probe's flipping rows hold, per variant
``v``: ``s_<v>`` (score, nats), ``r_<v>`` (recovery ``(s_v - s_old) / (s_new - s_old)``, unclipped;
docs/design.md §3) and ``flipped_<v>`` (the patched run takes the new run's decision); the generated
readout adds ``reached_<v>`` and ``chain_len_<v>`` (a variant whose chain missed its marker has
``s``, ``r`` and ``flipped`` None) and its rows keep the clean chains (``chain_old`` / ``chain_new``).

A probe whose ``Config`` includes :class:`GeneratedReadout`'s keys supports both readouts with one
code path (``docs/adding_a_probe.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tqdm import tqdm

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import PairRun, first_token_scores, variant_scores
from kvnotes.harness.selection import offset_profiles, profile_for, with_split
from kvnotes.kv import cache as kvcache
from kvnotes.kv.decision import recovery
from kvnotes.kv.engine import make_engine
from kvnotes.kv.masks import KVSite, Masks, site_masks
from kvnotes.kv import patch as kvpatch
from kvnotes.kv import generate as kvgen
from kvnotes.models.adapters import Adapter
from kvnotes.ops import edit as kvedit

#: ``pair -> {variant name: positions in [0, d)}`` (patched in every layer and KV head) or
#: ``{variant name: KVSite}`` (:class:`kvnotes.kv.masks.KVSite`: some layers and KV heads), in scoring order.
Variants = Callable[[Any], Mapping[str, "Sequence[int] | KVSite"]]
#: ``"flipping"``: measure the pairs that flip, exclude the rest; ``"all"``: measure every screened
#: pair (rows keep ``flips`` / ``reason``), and also list the non-flipping ones as exclusions.
Scope = Literal["flipping", "all"]


@dataclass
class GeneratedReadout:
    """Keys of a probe whose decisions can be read after generated reasoning (``scenario.variant=cot``).

    Attributes:
        cot_max_new_tokens: most tokens generated per chain (to the answer marker).
        cot_max_pairs: aligned pairs screened by generation, round-robin over scenarios (None: all).
    """

    cot_max_new_tokens: NonNegative = 40
    cot_max_pairs: Count | None = 12


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
    """

    s: list[float | None]
    r: list[float | None]
    flipped: list[bool | None]
    side: list[str | None]
    reached: list[bool]
    chains: list[kvgen.Chain] | None = None


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

    def masks(self, sets: Sequence[Sequence[int] | KVSite]) -> Masks:
        """Patch masks ``[V, n_layers, d]`` of position sets in ``[0, d)`` (every layer and KV head) or
        of :class:`kvnotes.kv.masks.KVSite` (positions in some layers and KV heads: a head patch,
        :func:`kvnotes.kv.masks.site_masks`)."""
        if any(isinstance(s, KVSite) for s in sets):
            ad = Adapter.for_model(self.model)                     # heads as the cache holds them
            return site_masks(ad.n_layers, self.pair.decision,
                              [s if isinstance(s, KVSite) else KVSite(s) for s in sets], ad.cache_heads)
        n_layers = self.model.config.get_text_config().num_hidden_layers
        return kvpatch.position_masks(n_layers, self.pair.decision, [list(s) for s in sets])

    @torch.no_grad()
    def score(self, masks: Masks) -> Scored:
        """Score ``masks`` (bool ``[V, n_layers, d]``: patch from the new run where true; or
        :class:`kvnotes.kv.masks.FactoredMasks`) in one
        batched call chunked to the memory budget (:func:`kvnotes.harness.readout.variant_scores`).

        Raises:
            ValueError: the readout mode is not one.
        """
        run = self.run.with_caches(self.model)
        with self.timer("variants"):
            s = variant_scores(self.model, run.pair, run.old_cache, run.new_cache, masks, self.mode, self.budget_bytes)
        flipped = run.decision_flipped(s).tolist()
        return Scored(s.tolist(), run.recovery(s).tolist(), flipped, ["new" if x > 0 else "old" for x in s.tolist()],
                      [True] * len(flipped))

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

    @torch.no_grad()
    def score(self, masks: Masks) -> Scored:
        """Decode every variant's chain in one batch and read each decision after its marker."""
        ctx, pair = self.ctx, self._pair
        model, d = ctx.bundle.model, pair.decision
        with ctx.timer("generate"):
            gen = kvgen.generate(model, kvcache.build_variants(model.config, self.old_cache, self.new_cache, masks),
                                 int(pair.old.ids[d]), d, self.max_new, K.cot_marker(ctx, pair),
                                 K.stop_tokens(ctx.bundle.tokenizer))
        reached = [c.reached for c in gen.chains]
        side = [kvgen.owned_side(lp, pair) if ok else None for lp, ok in zip(gen.logprobs, reached)]
        s = [float(first_token_scores(lp[None], pair)[0]) if ok else None for lp, ok in zip(gen.logprobs, reached)]
        return Scored(s, [recovery(x, self._s_old, self._s_new) for x in s],
                      [x == "new" if ok else None for x, ok in zip(side, reached)], side, reached, gen.chains)

    def released(self) -> "GeneratedPair":
        return self


@dataclass
class PairRows:
    """What the pair loop hands back to the probe.

    Attributes:
        rows: one row per measured pair (:data:`Scope`), with the probe's columns.
        excluded: one row per excluded pair with its ``reason`` (tokenisation, screen, flip rule,
            the probe's own ``exclude``).
        exclusions: reason -> count (with ``beyond_max_pairs`` under the generated readout).
        readout: ``"direct"`` or ``"generated"``.
        n_screened: pairs screened (every aligned pair under direct; the capped selection under
            generated).
        variants: a patch probe's variant names, in order.
        pairs: with ``keep``: the measured rows' :class:`ScreenedPair`, aligned with ``rows``.
    """

    rows: list[dict] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)
    exclusions: dict[str, int] = field(default_factory=dict)
    readout: str = "direct"
    n_screened: int = 0
    variants: list[str] = field(default_factory=list)
    pairs: list[ScreenedPair] = field(default_factory=list)


@dataclass
class Read:
    """One cache's decision under the run's readout (:func:`read_caches`).

    Attributes:
        logprobs: fp32 ``[vocab]`` log-probs of the decision's first token: at the decision position
            (direct) or right after the chain's answer marker (generated; NaN when it missed it).
        s: score ``log p(new) - log p(old)`` of the candidates' first tokens (nats); None when the
            chain missed its marker.
        side: the candidate decided for, ``"old"`` / ``"new"``: direct by the sign of ``s``;
            generated the owned top-1 after the marker (:func:`kvnotes.kv.generate.owned_side`),
            None when it is neither candidate or the chain missed its marker.
        reached: the chain reached its marker (always true under direct).
        chain: the generated chain (:class:`kvnotes.kv.generate.Chain`), None under direct.
    """

    logprobs: torch.Tensor
    s: float | None
    side: str | None
    reached: bool = True
    chain: kvgen.Chain | None = None


@torch.no_grad()
def read_caches(ctx, pair, items: Mapping[str, tuple[Any, int, int]]) -> dict[str, Read]:
    """The decisions of caches the probe built itself (edited, composed) under the run's readout,
    batched per (position, fed token): the readout hook of probes whose variants are caches, not
    patch masks (``edit``; :meth:`ScreenedPair.score` is the one of patch probes).

    Direct: the log-probs after feeding the token at its position
    (:func:`kvnotes.ops.edit.decision_logprobs_batch`, chunked to ``ctx.budget_bytes``). Generated:
    the caches of a group stacked (one copy) decode greedily, at most ``ctx.cfg.cot_max_new_tokens``
    tokens, to the pair's answer marker (:func:`kvnotes.kv.generate.generate`) and the decision is
    read after it.

    Args:
        ctx: the probe context.
        pair: the :class:`kvnotes.harness.pairs.TokenizedPair` whose candidates are scored.
        items: name -> (batch-1 :class:`kvnotes.kv.cache.AllSlotCache` over ``[0, pos)``, left
            unchanged; ``pos``; the token id fed at ``pos``).

    Returns:
        name -> :class:`Read`, in the order of ``items``.
    """
    model, generated = ctx.bundle.model, K.is_cot(ctx)
    groups: dict[tuple[int, int], list[str]] = {}
    for name, (_, pos, token) in items.items():
        groups.setdefault((pos, token), []).append(name)
    out: dict[str, Read] = {}
    for (pos, token), names in groups.items():
        caches = [items[n][0] for n in names]
        if not generated:
            lps = kvedit.decision_logprobs_batch(model, caches, token, pos, ctx.budget_bytes)
            for n, lp, s in zip(names, lps, first_token_scores(lps, pair).tolist()):
                out[n] = Read(lp, s, "new" if s > 0 else "old")
            continue
        with ctx.timer("generate"):
            gen = kvgen.generate(model, kvedit.stack(caches, pos), token, pos, int(ctx.cfg.cot_max_new_tokens),
                                 K.cot_marker(ctx, pair), K.stop_tokens(ctx.bundle.tokenizer))
        for n, chain, lp in zip(names, gen.chains, gen.logprobs):
            ok = chain.reached
            out[n] = Read(lp, float(first_token_scores(lp[None], pair)[0]) if ok else None,
                          kvgen.owned_side(lp, pair) if ok else None, ok, chain)
    return {n: out[n] for n in items}


def readout_aggregates(ctx, pr: PairRows) -> dict:
    """The aggregates every pair probe adds under the generated readout (``readout``,
    ``max_new_tokens``, ``n_screened``); none under direct."""
    if pr.readout != "generated":
        return {}
    return {"readout": "generated", "max_new_tokens": int(ctx.cfg.cot_max_new_tokens), "n_screened": pr.n_screened}


def _screened(ctx, desc: str, pairs: list | None) -> Iterator[tuple[ScreenedPair | None, dict]]:
    """``(screened pair, row)`` for each pair under the run's readout, in suite order (direct:
    every aligned pair; generated: ``pairs``); the pair is None when a generated clean chain missed
    its marker (``row["reason"]`` says how)."""
    if pairs is None:
        for run, row in K.each_pair(ctx, desc=desc):
            yield ScreenedPair.of(ctx, run), row
        return
    max_new = int(ctx.cfg.cot_max_new_tokens)
    for pair in tqdm(pairs, desc=f"{desc} cot", disable=not K.progress(ctx)):
        yield screen_generated(ctx, pair, max_new)


@torch.no_grad()
def screen_generated(ctx, pair, max_new: int) -> tuple[GeneratedPair | None, dict]:
    """Screen one pair under the generated readout: prefill both prefixes over ``[0, d)`` and
    decode the clean chains (:func:`kvnotes.harness.kit.cot_screen`).

    Returns:
        (the :class:`GeneratedPair`, or None when a clean chain missed its marker; the row:
        :func:`kvnotes.harness.pairs.pair_row` and the screen's columns, ``reason`` set).
    """
    d = pair.decision
    with ctx.timer("prefill"):
        old_c = kvcache.prefill(ctx.bundle.model, pair.old.ids[:d])
        new_c = kvcache.prefill(ctx.bundle.model, pair.new.ids[:d])
    screen, why = K.cot_screen(ctx, pair, old_c, new_c, max_new)
    row = pair_row(pair) | screen
    if why:
        return None, row | {"reason": why}
    return GeneratedPair(ctx, pair, old_c, new_c, screen, max_new), row


def _exclusion(row: dict) -> dict:
    """A generated exclusion row: :data:`kvnotes.harness.kit.EXCLUSION_COLUMNS` and the clean chains."""
    return {k: row[k] for k in K.EXCLUSION_COLUMNS} | {c: row[c] for c in ("chain_old", "chain_new") if c in row}


def pair_loop(ctx, desc: str, measure: Callable[[ScreenedPair, dict], dict] | None = None, *,
              scope: Scope = "flipping", exclude: Callable[[Any], str | None] | None = None,
              keep: bool = False, keep_caches: bool = False) -> PairRows:
    """The pair loop of a probe under the run's readout (module docstring).

    Exclusion rows come in this order: tokenisation; in suite order, the pairs the screen or the
    flip rule excluded (direct: the whole row; generated: :func:`_exclusion`); then, in suite order,
    the pairs the probe's ``exclude`` refused and, with ``scope="all"``, the measured pairs that do
    not flip.

    Args:
        ctx: the probe context (``ctx.cfg`` declares :class:`GeneratedReadout`'s keys when the
            probe supports the generated readout).
        desc: the progress bar's label.
        measure: ``(screened pair, row) -> columns`` of the probe's own, called on each measured
            pair right after its screen (its caches are used once, no second prefill).
        scope: which screened pairs are measured (:data:`Scope`).
        exclude: ``pair -> reason or None``: the probe's own exclusion of a flipping pair before
            it is measured (e.g. ``no_downstream``).
        keep: keep the measured pairs (:attr:`PairRows.pairs`), for a probe that must see every
            pair before it measures one; ``keep_caches``: with their prefix caches (else released
            and prefilled again when scored; generated pairs always keep theirs).

    Returns:
        :class:`PairRows`.
    """
    generated = K.is_cot(ctx)
    pairs, beyond = None, 0
    if generated:
        limit = ctx.cfg.cot_max_pairs
        pairs, beyond = K.cot_selection(ctx, None if limit is None else int(limit))
    out = PairRows(excluded=list(ctx.pairs.excluded), readout="generated" if generated else "direct")
    late: list[dict] = []

    def excluded(row: dict) -> dict:
        return _exclusion(row) if generated else row

    for sp, row in _screened(ctx, desc, pairs):
        out.n_screened += 1
        if sp is None or (not row["flips"] and scope == "flipping"):
            out.excluded.append(excluded(row))
            continue
        why = exclude(sp.pair) if exclude is not None and row["flips"] else None
        if why:
            late.append(excluded(row | {"reason": why}))
            continue
        if not row["flips"]:
            late.append(_exclusion(row))
        out.rows.append(row | measure(sp, row) if measure is not None else row)
        if keep:
            out.pairs.append(sp if keep_caches else sp.released())
    out.excluded += late
    out.exclusions = K.exclusion_counts(out.excluded)
    if beyond:                                            # counted, no rows: never screened
        out.exclusions["beyond_max_pairs"] = beyond
    return out


def patch_columns(sp: ScreenedPair, sets: Mapping[str, Sequence[int] | KVSite]) -> dict:
    """One pair's variants under the run's readout: each named position set patched (every layer)
    from the new run's prefix cache into the old run's, all scored in one batched call.

    Args:
        sp: the screened pair.
        sets: variant name -> positions in ``[0, d)`` (every layer and KV head), or a
            :class:`kvnotes.kv.masks.KVSite` (those positions in some layers and KV heads).

    Returns:
        per variant ``v``: ``r_<v>`` (recovery), ``s_<v>`` (score, nats), ``flipped_<v>``; under the
        generated readout also ``reached_<v>`` and ``chain_len_<v>``.
    """
    sc = sp.score(sp.masks(list(sets.values())))
    out: dict = {}
    for i, v in enumerate(sets):
        out |= {f"r_{v}": sc.r[i], f"s_{v}": sc.s[i], f"flipped_{v}": sc.flipped[i]}
        if sc.chains is not None:
            out |= {f"reached_{v}": sc.reached[i], f"chain_len_{v}": sc.chains[i].length}
    return out


def run_patches(ctx, variants: Variants, desc: str, keep_caches: bool = False,
                extra: Callable[[ScreenedPair, dict], dict] | None = None) -> PairRows:
    """The pair loop of a patch probe under the run's readout (module docstring).

    Args:
        ctx: the probe context.
        variants: the probe's variants of a pair (:data:`Variants`).
        desc: the progress bar's label.
        keep_caches: direct readout: keep the flipping pairs' prefix caches (no second prefill for
            a later probe of the job).
        extra: ``(screened pair, row with the variant columns) -> columns`` of the probe's own,
            added to the row.

    Returns:
        :class:`PairRows`.
    """
    names: list[str] = []

    def measure(sp: ScreenedPair, row: dict) -> dict:
        sets = variants(sp.pair)
        names[:] = list(sets)
        out = patch_columns(sp, sets)
        return out | (extra(sp, row | out) if extra is not None else {})

    pr = pair_loop(ctx, desc, measure, keep=keep_caches, keep_caches=keep_caches)
    pr.variants = names
    return pr


def start_circuit(ctx):
    """The common start of a circuit probe: the first-token readout check, the engine of the
    config's ``backend``, the flipping pairs with their prefix caches, and their selection /
    held-out split (``selection_fraction``, ``ctx.seed``).

    Returns:
        (engine, :class:`kvnotes.harness.kit.FlippingSet`, rows tagged with ``split``, selection instance
        ids, held-out instance ids).

    Raises:
        KvnotesError: a readout other than ``first_token``.
    """
    K.require_first_token(ctx)
    engine = make_engine(ctx.bundle.model, ctx.cfg.backend)
    fs = K.flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = with_split(fs.rows, float(ctx.cfg.selection_fraction), ctx.seed)
    return engine, fs, rows, sel, held


def note_profiles(ctx, runs: Sequence[PairRun], rows: list[dict], anchor: str, desc: str) -> dict:
    """The note-position profiles of a probe that chooses its note positions on selection instances
    (``components``, ``scrubbing``, ``sae_features``): each selection row with a downstream position
    gets ``position_map``, the recovery of every downstream position patched alone
    (:func:`kvnotes.harness.kit.single_position_scores`), and the profiles are their means per scenario and family
    (:func:`kvnotes.harness.selection.offset_profiles`; positions carried by ``anchor``).

    Args:
        runs: the flipping pairs' clean runs (with prefix caches), in the order of ``rows``.
        rows: their rows, tagged with ``split`` (:func:`kvnotes.harness.selection.with_split`).

    Returns:
        :func:`kvnotes.harness.selection.offset_profiles`' profiles.
    """
    model = ctx.bundle.model
    for run_, row in K.units(ctx, zip(runs, rows), desc):
        if row["split"] == "selection" and row["field"][1] < row["decision"]:
            with ctx.timer("position_map"):
                row["position_map"] = run_.recovery(
                    K.single_position_scores(model, run_, "first_token", ctx.budget_bytes)).tolist()
    return offset_profiles([r | {"single": r["position_map"], "downstream": (r["field"][1], r["decision"]),
                                 "downstream_ids": run_.pair.downstream_ids}
                            for run_, r in zip(runs, rows) if "position_map" in r], anchor)


def pair_profile(profiles: dict, row: dict) -> tuple[dict, str] | None:
    """The profile (:func:`note_profiles`) a pair's note positions are read from, its scenario's or
    else its family's, with that level; None when there is none or the pair has no downstream
    position, said in ``row["skipped"]`` (``no_profile``, ``no_downstream``)."""
    profile, level = profile_for(profiles, row["scenario"], row["family"])
    if profile is None or row["field"][1] >= row["decision"]:
        row["skipped"] = "no_profile" if profile is None else "no_downstream"
        return None
    return profile, str(level)
