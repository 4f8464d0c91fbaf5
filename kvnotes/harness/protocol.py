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
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
from tqdm import tqdm

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import PairRun, first_token_scores, variant_scores
from kvnotes.kv import cache as kvcache
from kvnotes.kv.decision import recovery
from kvnotes.kv.masks import Masks, site_masks
from kvnotes.kv.sites import Site, kv_site
from kvnotes.kv import patch as kvpatch
from kvnotes.kv import generate as kvgen
from kvnotes.models.adapters import Adapter
from kvnotes.ops import edit as kvedit

#: ``pair -> {variant name: positions in [0, d)}`` (patched in every layer and KV head) or
#: ``{variant name: Site}`` (a K/V :class:`kvnotes.kv.sites.Site`: some layers and KV heads), in scoring order.
Variants = Callable[[Any], Mapping[str, "Sequence[int] | Site"]]
#: ``"flipping"``: measure the pairs that flip, exclude the rest; ``"all"``: measure every screened
#: pair (rows keep ``flips`` / ``reason``), and also list the non-flipping ones as exclusions.
Scope = Literal["flipping", "all"]
#: The readouts a decision is read under (module docstring): ``scenario.variant=direct`` / ``cot``.
Readout = Literal["direct", "generated"]
READOUTS: tuple[Readout, ...] = ("direct", "generated")


@dataclass(frozen=True)
class Check:
    """A quantity a probe's rows hold by construction (a check, not a finding), computed by the
    harness under the readouts it holds under (:meth:`PairRows.checks`).

    Attributes:
        name: its key in the record's ``aggregates.checks``.
        value: ``rows -> value`` (e.g. the largest ``|r - 1|`` of a variant that must recover 1).
        readouts: the readouts under which the identity holds: patching ``[a, d)`` equals patching
            ``[0, d)`` only when the decision is read at ``d`` (direct); chains are compared only
            where there are chains (generated).
    """

    name: str
    value: Callable[[list[dict]], Any]
    readouts: tuple[Readout, ...] = READOUTS


@dataclass(frozen=True)
class Measure:
    """Columns a probe adds to each measured row, under the readouts it is defined under.

    Attributes:
        name: listed in :attr:`PairRows.measured` when it ran.
        columns: ``(screened pair, row so far) -> columns``.
        readouts: e.g. ``("direct",)`` for a measurement read at the decision position itself (the
            exact field refresh), which a generated readout would not read.
    """

    name: str
    columns: Callable[["ScreenedPair", dict], dict]
    readouts: tuple[Readout, ...] = READOUTS


#: The scenario prompt variant each readout reads (``scenario.variant``).
PROMPT_VARIANT: dict[Readout, str] = {"direct": "direct", "generated": "cot"}


def readout_of(ctx) -> Readout:
    """The run's readout: ``"generated"`` under ``scenario.variant=cot``, else ``"direct"``."""
    return "generated" if K.is_cot(ctx) else "direct"


def readout_config(ctx):
    """The probe's config as the run's readout reads it: under the generated readout a key
    ``cot_<k>`` of the probe's ``Config`` stands in for ``<k>`` (a sweep of its own, a cap, an arm
    left off: decoding a chain per variant costs more than reading one decision), but for
    :class:`GeneratedReadout`'s own keys; the direct readout reads the config as it is.

    Returns:
        ``ctx.cfg``, or a copy of it (:func:`dataclasses.replace`) with the ``cot_`` values.
    """
    cfg = ctx.cfg
    if readout_of(ctx) == "direct":
        return cfg
    own = {f.name for f in fields(GeneratedReadout)}
    keys = {f.name for f in fields(cfg)}
    return replace(cfg, **{k: getattr(cfg, f"cot_{k}") for k in keys if f"cot_{k}" in keys and f"cot_{k}" not in own})


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
                      reached: str | None = None, unreached: str | None = None,
                      reproduces: tuple[str, str] | None = None) -> dict:
        """The generated readout's columns of variant ``i`` of ``sc``, under the keys the probe
        names: ``chain`` its chain record (:meth:`kvnotes.kv.generate.Chain.record`), ``length`` its
        length, ``reached``, ``unreached`` its exclusion reason (None when it reached its marker),
        ``reproduces`` ``(key, run)``: whether it decoded the clean ``run``'s chain token for token.
        None under the direct readout, which reads no chain."""
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
                      reached: str | None = None, unreached: str | None = None,
                      reproduces: tuple[str, str] | None = None) -> dict:
        """:meth:`ScreenedPair.chain_columns` of a generated chain."""
        assert sc.chains is not None and sc.unreached is not None
        c = sc.chains[i]
        named = {chain: c.record(), length: c.length, reached: c.reached, unreached: sc.unreached[i]}
        out = {key: value for key, value in named.items() if key is not None}
        if reproduces is not None:
            out[reproduces[0]] = c.ids == self.chain_ids[reproduces[1]]
        return out

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
        scope: the loop's :data:`Scope`.
        measured: the names of the probe's :class:`Measure` that ran (those defined under the readout).
    """

    rows: list[dict] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)
    exclusions: dict[str, int] = field(default_factory=dict)
    readout: Readout = "direct"
    n_screened: int = 0
    variants: list[str] = field(default_factory=list)
    pairs: list[ScreenedPair] = field(default_factory=list)
    scope: Scope = "flipping"
    measured: list[str] = field(default_factory=list)

    def checks(self, checks: Sequence[Check], rows: list[dict] | None = None) -> dict:
        """The values of the probe's :class:`Check` that hold under this run's readout, over
        ``rows`` (default: :attr:`rows`), by name."""
        rows = self.rows if rows is None else rows
        return {c.name: c.value(rows) for c in checks if self.readout in c.readouts}

    def flips_phrase(self, n: int) -> str:
        """What a family without flipping pairs lacks, for a note: ``flipping pairs (n aligned
        pairs`` (direct) or ``generated flips (n pairs whose clean chains reached the marker``."""
        return (f"generated flips ({n} pairs whose clean chains reached the marker" if self.readout == "generated"
                else f"flipping pairs ({n} aligned pairs")


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

    def chain_columns(self, **names: str) -> dict:
        """The generated readout's columns of this read, under the keys the probe names for
        ``reached``, ``length`` (the chain's) and ``side`` (the candidate the chain names); none
        under the direct readout, which reads no chain."""
        if self.chain is None:
            return {}
        have = {"reached": self.reached, "length": self.chain.length, "side": self.side}
        return {key: have[what] for what, key in names.items()}


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
    ``max_new_tokens``, ``n_screened``; a patch probe's ``n_unreached``, per variant the measured
    rows whose chain missed its marker; a loop of scope ``"all"``: ``n_pairs``, every pair of the
    suite, tokenisation exclusions and ``beyond_max_pairs`` included, and ``n_reached``, the pairs
    measured); none under direct."""
    if pr.readout != "generated":
        return {}
    out = {"readout": "generated", "max_new_tokens": int(ctx.cfg.cot_max_new_tokens), "n_screened": pr.n_screened}
    if pr.variants:
        out["n_unreached"] = {v: sum(not r[f"reached_{v}"] for r in pr.rows) for v in pr.variants}
    if pr.scope == "all":
        out |= {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_reached": len(pr.rows)}
    return out


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
    readout = readout_of(ctx)
    generated = readout == "generated"
    pairs, beyond = None, 0
    if generated:
        limit = ctx.cfg.cot_max_pairs
        pairs, beyond = K.cot_selection(ctx, None if limit is None else int(limit))
    out = PairRows(excluded=list(ctx.pairs.excluded), readout=readout, scope=scope)
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


def patch_columns(sp: ScreenedPair, sets: Mapping[str, Sequence[int] | Site]) -> dict:
    """One pair's variants under the run's readout: each named position set patched (every layer)
    from the new run's prefix cache into the old run's, all scored in one batched call.

    Args:
        sp: the screened pair.
        sets: variant name -> positions in ``[0, d)`` (every layer and KV head), or a
            K/V :class:`kvnotes.kv.sites.Site` (those positions in some layers and KV heads).

    Returns:
        per variant ``v``: ``r_<v>`` (recovery), ``s_<v>`` (score, nats), ``flipped_<v>``; under the
        generated readout also ``reached_<v>`` and ``chain_len_<v>`` (:meth:`ScreenedPair.chain_columns`).
    """
    sc = sp.score(sp.masks(list(sets.values())))
    out: dict = {}
    for i, v in enumerate(sets):
        out |= {f"r_{v}": sc.r[i], f"s_{v}": sc.s[i], f"flipped_{v}": sc.flipped[i]}
        out |= sp.chain_columns(sc, i, reached=f"reached_{v}", length=f"chain_len_{v}")
    return out


def run_patches(ctx, variants: Variants, desc: str, keep_caches: bool = False,
                extra: Measure | None = None, names: Sequence[str] = ()) -> PairRows:
    """The pair loop of a patch probe under the run's readout (module docstring).

    Args:
        ctx: the probe context.
        variants: the probe's variants of a pair (:data:`Variants`).
        desc: the progress bar's label.
        keep_caches: direct readout: keep the flipping pairs' prefix caches (no second prefill for
            a later probe of the job).
        extra: the probe's own :class:`Measure` (``(screened pair, row with the variant columns)
            -> columns``), run on each pair when the run's readout is one of its readouts.
        names: the variant names, when the probe's are fixed: :attr:`PairRows.variants` (and the
            generated readout's ``n_unreached``) name them even when no pair is measured.

    Returns:
        :class:`PairRows`.
    """
    seen: list[str] = list(names)
    extra = extra if extra is not None and readout_of(ctx) in extra.readouts else None

    def measure(sp: ScreenedPair, row: dict) -> dict:
        sets = variants(sp.pair)
        seen[:] = list(sets)
        out = patch_columns(sp, sets)
        return out | (extra.columns(sp, row | out) if extra is not None else {})

    pr = pair_loop(ctx, desc, measure, keep=keep_caches, keep_caches=keep_caches)
    pr.variants, pr.measured = seen, [extra.name] if extra is not None else []
    return pr
