"""The pair loop of a probe, owned by the harness, with the readout as a parameter of the run.

A pair probe says what to measure on each screened pair; everything else is the harness's job,
here, for both readouts:

- **direct** (``scenario.variant=direct``, the default): every aligned pair is prefilled and
  screened under the run's flip rule (:func:`kvnotes.harness.kit.each_pair`: the clean-run store,
  progress, timing); patched variants are scored in one batched call chunked to the memory budget
  (:func:`kvnotes.harness.readout.variant_scores`, the run's ``readout`` mode).
- **generated** (``scenario.variant=cot``): pairs are taken round-robin over scenarios up to the
  probe's ``cot_max_pairs`` (the rest counted ``beyond_max_pairs``); per pair the clean chains
  decode greedily from their prefix caches in one batch, each prompt's once per loop
  (:func:`kvnotes.harness.screened.screen_generated`, at most ``cot_max_new_tokens`` tokens): the old chain must name the old candidate after the
  scenario's answer marker (after the think block on a thinking model) and the new chain the new
  one (exclusions: ``<side>_no_marker``, ``<side>_truncated_in_think``, ``no_cot_flip``). Patched
  variants then decode their reasoning in one batch (:func:`kvnotes.kv.generate.generate`) and each
  decision is read after its chain's marker.

Either way the probe sees a :class:`kvnotes.harness.screened.ScreenedPair` (the pair, its clean
scores, ``score(masks)`` giving a :class:`kvnotes.harness.screened.Scored` and
``knockout(masks, groups)`` a :class:`kvnotes.harness.screened.Knocked` per clean run, under the
run's readout) and its row (:func:`kvnotes.harness.pairs.pair_row`
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
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal

import torch
from tqdm import tqdm

from kvnotes.errors import KvnotesError
from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.readout import first_token_scores
from kvnotes.harness.screened import READOUTS, Readout, ScreenedPair, screen_generated
from kvnotes.kv.sites import Site
from kvnotes.kv import generate as kvgen
from kvnotes.ops import edit as kvedit

#: ``pair -> {variant name: positions in [0, d)}`` (patched in every layer and KV head) or
#: ``{variant name: Site}`` (a K/V :class:`kvnotes.kv.sites.Site`: some layers and KV heads), in scoring order.
Variants = Callable[[Any], Mapping[str, "Sequence[int] | Site"]]
#: ``"flipping"``: measure the pairs that flip, exclude the rest; ``"all"``: measure every screened
#: pair (rows keep ``flips`` / ``reason``), and also list the non-flipping ones as exclusions.
Scope = Literal["flipping", "all"]


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
        name: listed in :attr:`PairRows.measured` when it ran (:func:`pair_loop`'s ``measures``).
        columns: ``(screened pair, *what the probe passes) -> columns``: :func:`run_patches` passes
            the row with the variant columns; a probe that calls :meth:`of` itself passes what it
            measured (e.g. its :class:`kvnotes.harness.screened.Knocked` runs).
        readouts: e.g. ``("direct",)`` for a measurement read at the decision position itself (the
            exact field refresh), which a generated readout would not read; ``("generated",)`` for
            one of what only a chain has.
        summary: ``(*what the probe passes) -> aggregates`` over the rows its columns filled, or
            None (:func:`summaries` runs it under the same readouts).
    """

    name: str
    columns: Callable[..., dict]
    readouts: tuple[Readout, ...] = READOUTS
    summary: Callable[..., dict] | None = None

    def of(self, unit, *args) -> dict:
        """Its columns on ``unit`` (a :class:`kvnotes.harness.screened.ScreenedPair`, a
        :class:`kvnotes.harness.reader.PromptReader`: anything with the run's ``readout``) when
        that readout is one of :attr:`readouts`, else none."""
        return self.columns(unit, *args) if unit.readout in self.readouts else {}


def summaries(readout: Readout, measures: Sequence[Measure], *args) -> dict:
    """The summaries of ``measures`` defined under ``readout`` (:attr:`Measure.summary` called on
    ``args``, merged in order): a measure's aggregates exist where its columns do, and the probe
    never asks which ran."""
    out: dict = {}
    for m in measures:
        if m.summary is not None and readout in m.readouts:
            out |= m.summary(*args)
    return out


def measured(ctx, measures: Sequence[Measure]) -> list[str]:
    """The names of ``measures`` defined under the run's readout (what :attr:`PairRows.measured`
    lists for a pair probe; a probe of other units asks here)."""
    readout = readout_of(ctx)
    return [m.name for m in measures if readout in m.readouts]


#: The scenario prompt variant each readout reads (``scenario.variant``).
PROMPT_VARIANT: dict[Readout, str] = {"direct": "direct", "generated": "cot"}


def readout_of(ctx) -> Readout:
    """The run's readout: ``"generated"`` under ``scenario.variant=cot``, else ``"direct"``."""
    return "generated" if K.is_cot(ctx) else "direct"


def readout_of_variant(variant: str) -> Readout:
    """The readout a scenario prompt variant is read under (:data:`PROMPT_VARIANT`; ``direct`` for
    any variant that generates nothing)."""
    return "generated" if variant == PROMPT_VARIANT["generated"] else "direct"


def config_for(cfg, readout: Readout):
    """A probe's config as ``readout`` reads it: under the generated readout a key ``cot_<k>`` of
    the probe's ``Config`` stands in for ``<k>`` (a sweep of its own, a cap, an arm left off:
    decoding a chain per variant costs more than reading one decision), but for
    :class:`GeneratedReadout`'s own keys; the direct readout reads the config as it is.

    A key the ``Config`` lists in ``DIRECT_ONLY`` (key -> why: an arm only the direct readout
    reads) is refused under the generated readout unless it keeps its default.

    Args:
        cfg: the typed probe config (a dataclass instance).

    Returns:
        ``cfg``, or a copy of it (:func:`dataclasses.replace`) with the ``cot_`` values.

    Raises:
        KvnotesError: a ``DIRECT_ONLY`` key set under the generated readout (one line).
    """
    if readout == "direct":
        return cfg
    for f in fields(cfg):
        why = getattr(cfg, "DIRECT_ONLY", {}).get(f.name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if why is not None and getattr(cfg, f.name) != default:
            value, back = (str(v).lower() if isinstance(v, bool) else v for v in (getattr(cfg, f.name), default))
            raise KvnotesError(f"probe.{f.name}={value} is not run under scenario.variant=cot ({why}); "
                               f"set probe.{f.name}={back}")
    own = {f.name for f in fields(GeneratedReadout)}
    keys = {f.name for f in fields(cfg)}
    return replace(cfg, **{k: getattr(cfg, f"cot_{k}") for k in keys if f"cot_{k}" in keys and f"cot_{k}" not in own})


def readout_config(ctx):
    """The probe's config as the run's readout reads it: :func:`config_for` of ``ctx.cfg``."""
    return config_for(ctx.cfg, readout_of(ctx))


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
    max_new, memo = int(ctx.cfg.cot_max_new_tokens), {}      # a prompt's clean chain decodes once
    for pair in tqdm(pairs, desc=f"{desc} cot", disable=not K.progress(ctx)):
        yield screen_generated(ctx, pair, max_new, memo)


def _exclusion(row: dict) -> dict:
    """A generated exclusion row: :data:`kvnotes.harness.kit.EXCLUSION_COLUMNS` and the clean chains."""
    return {k: row[k] for k in K.EXCLUSION_COLUMNS} | {c: row[c] for c in ("chain_old", "chain_new") if c in row}


def pair_loop(ctx, desc: str, measure: Callable[[ScreenedPair, dict], dict] | None = None, *,
              scope: Scope = "flipping", exclude: Callable[[Any], str | None] | None = None,
              keep: bool = False, keep_caches: bool = False, measures: Sequence[Measure] = ()) -> PairRows:
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
    out = PairRows(excluded=list(ctx.pairs.excluded), readout=readout, scope=scope, measured=measured(ctx, measures))
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

    def measure(sp: ScreenedPair, row: dict) -> dict:
        sets = variants(sp.pair)
        seen[:] = list(sets)
        out = patch_columns(sp, sets)
        return out | (extra.of(sp, row | out) if extra is not None else {})

    pr = pair_loop(ctx, desc, measure, keep=keep_caches, keep_caches=keep_caches,
                   measures=() if extra is None else (extra,))
    pr.variants = seen
    return pr
