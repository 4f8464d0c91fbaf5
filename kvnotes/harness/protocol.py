"""The pair loop of a patch probe, owned by the harness, with the readout as a parameter of the run.

A *patch probe* says, for each token-aligned pair, which positions of the prefix ``[0, d)`` to patch
(every layer) from the new run's K/V into the old run's: named position sets, its *variants*
(activation patching: the new run is the clean source, the old run the patched one). Everything
else is the harness's job, here, for both readouts:

- **direct** (``scenario.variant=direct``, the default): every aligned pair is prefilled and
  screened under the run's flip rule (:func:`kvnotes.harness.kit.flipping_pairs`: the clean-run
  store, exclusions by reason, progress, timing); each flipping pair's variants are scored in one
  batched call chunked to the memory budget (:func:`kvnotes.harness.readout.variant_scores`, the
  run's ``readout`` mode), right after its clean run.
- **generated** (``scenario.variant=cot``): pairs are taken round-robin over scenarios up to the
  probe's ``cot_max_pairs`` (the rest counted ``beyond_max_pairs``); per pair both prefixes are
  prefilled, every variant and the two clean runs (nothing patched, everything patched) decode
  their reasoning greedily in one batch, at most ``cot_max_new_tokens`` tokens
  (:func:`kvnotes.kv.generate.generate`), and each decision is read after the scenario's answer
  marker (after the think block on a thinking model). The clean chains decide whether the pair
  flips: the old chain must name the old candidate and the new chain the new one (exclusions:
  ``<side>_no_marker``, ``<side>_truncated_in_think``, ``no_cot_flip``).

Either way a flipping pair's row holds :func:`kvnotes.harness.pairs.pair_row` columns, its clean
scores and, per variant ``v``: ``s_<v>`` (score, nats), ``r_<v>`` (recovery
``(s_v - s_old) / (s_new - s_old)``, unclipped; docs/design.md §3) and ``flipped_<v>`` (the patched
run takes the new run's decision); the generated readout adds ``reached_<v>`` and
``chain_len_<v>`` (a variant whose chain missed its marker has ``s``, ``r`` and ``flipped`` None)
and the clean chains' texts. A probe adds its own columns with ``extra`` (direct readout only: it
gets the pair's prefix caches). :func:`run_patches` returns a :class:`PatchRows`; the probe
summarises them (``kit.summaries_by_family``) and names what it found.

A probe that declares its variants this way supports both readouts with one code path
(``docs/adding_a_probe.md``); its ``Config`` includes :class:`GeneratedReadout`'s keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import PairRun, first_token_scores, variant_scores
from kvnotes.kv import cache as kvcache
from kvnotes.kv.generate import generate, owned_side, stop_tokens, unreached_label

#: ``pair -> {variant name: positions in [0, d)}`` (patched in every layer), in scoring order.
Variants = Callable[[Any], Mapping[str, Sequence[int]]]


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
class PatchRows:
    """What the pair loop hands back to the probe.

    Attributes:
        rows: one row per flipping pair (module docstring).
        excluded: one row per excluded pair with its ``reason`` (tokenisation, screen, flip rule).
        exclusions: reason -> count (with ``beyond_max_pairs`` under the generated readout).
        readout: ``"direct"`` or ``"generated"``.
        variants: the variant names, in order.
    """

    rows: list[dict] = field(default_factory=list)
    excluded: list[dict] = field(default_factory=list)
    exclusions: dict[str, int] = field(default_factory=dict)
    readout: str = "direct"
    variants: list[str] = field(default_factory=list)


@torch.no_grad()
def patch_columns(model, run: PairRun, sets: Mapping[str, Sequence[int]], mode: str = "first_token",
                  budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """The direct readout of one pair's variants: each named position set patched (every layer)
    from the new run's prefix cache into the old run's, all scored in one batched call
    (:func:`kvnotes.harness.readout.variant_scores`, chunked to ``budget_bytes``).

    Args:
        run: the pair's clean run with its prefix caches over ``[0, d)``.
        sets: variant name -> positions in ``[0, d)``.
        mode: readout mode (``first_token`` or ``full``, docs/design.md §3).

    Returns:
        per variant ``v``: ``r_<v>`` (recovery), ``s_<v>`` (score, nats), ``flipped_<v>``.

    Raises:
        ValueError: ``mode`` is not a readout mode.
    """
    masks = kvcache.position_masks(len(run.old_cache.layers), run.pair.decision, [list(v) for v in sets.values()])
    s = variant_scores(model, run.pair, run.old_cache, run.new_cache, masks, mode, budget_bytes)
    r, f = run.recovery(s), run.decision_flipped(s)
    out: dict = {}
    for i, v in enumerate(sets):
        out |= {f"r_{v}": float(r[i]), f"s_{v}": float(s[i]), f"flipped_{v}": bool(f[i])}
    return out


def run_patches(ctx, variants: Variants, desc: str, keep_caches: bool = False,
                extra: Callable[[PairRun, dict], dict] | None = None) -> PatchRows:
    """The pair loop of a patch probe under the run's readout (module docstring).

    Args:
        ctx: the probe context (``ctx.cfg`` declares :class:`GeneratedReadout`'s keys when the
            probe supports the generated readout).
        variants: the probe's variants of a pair (:data:`Variants`).
        desc: the progress bar's label.
        keep_caches: direct readout: keep the flipping pairs' prefix caches in the clean-run
            store's runs (more memory, no second prefill for a later probe of the job).
        extra: direct readout: ``(run with caches, row with the variant columns) -> columns`` of
            the probe's own, added to the row.

    Returns:
        :class:`PatchRows`.
    """
    if K.is_cot(ctx):
        return _generated(ctx, variants, desc)
    model = ctx.bundle.model
    names: list[str] = []

    def score(run_: PairRun, row: dict) -> dict:
        sets = variants(run_.pair)
        names[:] = list(sets)
        with ctx.timer("variants"):
            out = patch_columns(model, run_, sets, ctx.readout, ctx.budget_bytes)
            return out | (extra(run_, row | out) if extra is not None else {})

    fs = K.flipping_pairs(ctx, desc=desc, keep_caches=keep_caches, process=score)
    return PatchRows(fs.rows, fs.excluded, fs.exclusions, "direct", names)


def _clean_index(sets: Mapping[str, Sequence[int]], d: int) -> tuple[list[list[int]], int, int]:
    """The position sets to decode (the variants', then the clean runs' where no variant is one)
    and the indices of the clean old (nothing patched) and clean new (all of ``[0, d)``) runs."""
    rows = [sorted(int(p) for p in v) for v in sets.values()]
    full = list(range(d))
    if [] not in rows:
        rows.append([])
    if full not in rows:
        rows.append(full)
    return rows, rows.index([]), rows.index(full)


@torch.no_grad()
def generated_pair(ctx, pair, sets: Mapping[str, Sequence[int]], max_new: int) -> tuple[dict, str | None]:
    """One pair under the generated readout: every variant and the clean runs decode their reasoning
    in one batch and each decision is read after the answer marker (module docstring).

    Returns:
        (the row: ``s_<v>`` (None: marker not reached), ``r_<v>``, ``flipped_<v>``, ``reached_<v>``,
        ``chain_len_<v>``, ``old_text`` / ``new_text`` of the clean chains, and when the clean chains
        flip ``s_old``, ``s_new``, ``effect``, ``flips``, ``reason``; the exclusion reason, or None
        for a pair whose generated decision flips).
    """
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    d = pair.decision
    todo, i_old, i_new = _clean_index(sets, d)
    with ctx.timer("prefill"):
        old_c, new_c = kvcache.prefill(model, pair.old.ids[:d]), kvcache.prefill(model, pair.new.ids[:d])
    masks = kvcache.position_masks(ctx.bundle.adapter.n_layers, d, todo)
    with ctx.timer("generate"):
        gen = generate(model, kvcache.build_variants(model.config, old_c, new_c, masks), int(pair.old.ids[d]), d,
                       max_new, K.cot_marker(ctx, pair), stop_tokens(tok))
    reached = [c.reached for c in gen.chains]
    side = [owned_side(lp, pair) if ok else None for lp, ok in zip(gen.logprobs, reached)]
    score = [float(first_token_scores(lp[None], pair)[0]) if ok else None for lp, ok in zip(gen.logprobs, reached)]
    row = pair_row(pair)
    for i, v in enumerate(sets):
        row[f"s_{v}"] = score[i]
        row[f"reached_{v}"], row[f"chain_len_{v}"] = reached[i], gen.chains[i].length
        row[f"flipped_{v}"] = side[i] == "new" if reached[i] else None
    row["old_text"] = tok.decode(gen.chains[i_old].ids, skip_special_tokens=True)
    row["new_text"] = tok.decode(gen.chains[i_new].ids, skip_special_tokens=True)
    for name, i in (("old", i_old), ("new", i_new)):
        if not reached[i]:
            return row, unreached_label(tok, name, gen.chains[i], ctx.thinking)
    if side[i_old] != "old" or side[i_new] != "new":
        return row, "no_cot_flip"
    s_old, s_new = score[i_old], score[i_new]
    assert s_old is not None and s_new is not None              # both clean chains reached their marker
    row |= {"s_old": s_old, "s_new": s_new, "effect": s_new - s_old, "flips": True, "reason": None}
    for v in sets:
        s = row[f"s_{v}"]
        row[f"r_{v}"] = None if s is None else (s - s_old) / (s_new - s_old)
    return row, None


def _generated(ctx, variants: Variants, desc: str) -> PatchRows:
    """:func:`run_patches` under the generated readout."""
    limit = ctx.cfg.cot_max_pairs
    pairs, beyond = K.cot_selection(ctx, None if limit is None else int(limit))
    out = PatchRows(excluded=list(ctx.pairs.excluded), readout="generated")
    for pair in tqdm(pairs, desc=f"{desc} cot", disable=not K.progress(ctx)):
        sets = variants(pair)
        out.variants = list(sets)
        row, reason = generated_pair(ctx, pair, sets, int(ctx.cfg.cot_max_new_tokens))
        if reason:
            out.excluded.append(row | {"reason": reason})
        else:
            out.rows.append(row)
    out.exclusions = K.exclusion_counts(out.excluded)
    if beyond:                                            # counted, no rows: never screened
        out.exclusions["beyond_max_pairs"] = beyond
    return out
