"""``scrubbing``: causal scrubbing of the notes: the note set, chosen on selection instances, and the
rest of the downstream resampled on held-out pairs from a donor with the same conclusion (drift) and
from the pair's opposite run (interchange recovery) (the paper's Figure 15; anchors §10).

Specification: ``docs/probes/scrubbing.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import torch

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, OpenFraction, Share, one_of, require_instances
from kvnotes.harness.kit import ProbeConfig, RandomControl
from kvnotes.harness.pairs import outcomes
from kvnotes.harness.circuit import note_profiles, pair_profile
from kvnotes.harness.readout import PairRun, variant_scores
from kvnotes.harness.selection import (ANCHORS, align_positions, pair_rng, position_values,
                                       rank_values, split_warnings, with_split)
from kvnotes.harness.registry import Conformance
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.kv.rope import reposition
from kvnotes.records.figures import Bars
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import CircuitResult
from kvnotes.records.tables import Lines, ci

#: Position sets scrubbed: the note set, the rest of the downstream ``[b, d)``, and both.
SETS = ("notes", "rest", "downstream")


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/scrubbing.yaml`` (the defaults are here; see the specification)."""

    #: share of each scenario's instances on which the note set is chosen
    selection_fraction: OpenFraction = 0.5
    #: how selection positions carry to a held-out pair: aligned (token alignment) | decision | field_end
    topk_anchor: Annotated[str, one_of(*ANCHORS)] = "aligned"
    #: most positions in the note set
    k: Count = 8
    #: a position enters the note set when its selection single-position recovery reaches this
    min_recovery: Share = 0.05
    #: size-matched random position sets of the rest (interchange control), per pair
    random: RandomControl = field(default_factory=lambda: RandomControl(5))

    def check_run(self, run) -> None:
        """The note set is chosen on selection instances and scrubbed on held-out ones, with donors
        from other instances.

        Raises:
            KvnotesError: ``scenario.n_instances < 2``.
        """
        require_instances(run, 2, "scrubbing", "chooses the note set on selection instances, scrubs held-out ones "
                          "and takes same-conclusion donors from other instances")


def note_set(values: np.ndarray, downstream: tuple[int, int], anchor: str, k: int, min_recovery: float) -> list[int]:
    """The note set of a held-out pair: the (at most ``k``) downstream positions ranked highest by the
    selection profile's values carried onto them (``values`` ``[d - b]``,
    :func:`kvnotes.harness.selection.position_values`), keeping those whose value reaches
    ``min_recovery`` (a position no selection position maps onto has none). Sorted."""
    b = downstream[0]
    top = rank_values(values, downstream, anchor)[:k]
    return sorted(p for p in top if np.isfinite(values[p - b]) and values[p - b] >= min_recovery)


def position_map(donor: Sequence[int], base: Sequence[int]) -> dict[int, int]:
    """Base index -> donor index for two downstream spans (token ids): the token alignment
    (:func:`kvnotes.harness.selection.align_positions`), and in between two matched blocks a gap of
    the same length on both sides (a name or value of the same token count) paired in order. A base
    index in any other gap has no donor position."""
    matched = align_positions(donor, base)
    out = {j: i for i, j in matched}
    anchors = [(-1, -1)] + matched + [(len(donor), len(base))]
    for (i0, j0), (i1, j1) in zip(anchors, anchors[1:]):
        if i1 - i0 == j1 - j0 > 1:
            out |= {j0 + t: i0 + t for t in range(1, j1 - j0)}
    return out


@torch.no_grad()
def resampled_source(model, base, donor: kvcache.AllSlotCache, moves: dict[int, int]):
    """A copy of the batch-1 prefix cache ``base`` with the K/V of each base position ``p`` of
    ``moves`` (``{p: q}``) replaced by the donor's K/V at ``q``, its keys moved from position ``q`` to
    ``p`` by RoPE (:func:`kvnotes.kv.rope.reposition`). A layer that holds no slot for ``p`` (a sliding
    window) keeps what it holds.

    Args:
        base: the base run's prefix cache over ``[0, d)`` (windowed or all-slot).
        donor: the donor's all-slot prefix cache (slot ``j`` is position ``j``).

    Returns:
        a new cache over the base's positions (the base is not modified).
    """
    ps = sorted(moves)
    qs = torch.tensor([moves[p] for p in ps])
    keys = [layer.keys[:, :, qs.to(layer.keys.device)] for layer in donor.layers]
    values = [layer.values[:, :, qs.to(layer.values.device)] for layer in donor.layers]
    keys, values = reposition(model, keys, values, torch.tensor(ps) - qs)
    out_k, out_v = [], []
    for layer, k, v in zip(base.layers, keys, values, strict=True):
        bk, bv = layer.keys.clone(), layer.values.clone()
        held = {int(p): j for j, p in enumerate(kvcache.slot_positions(layer).tolist())}
        sel = [(held[p], i) for i, p in enumerate(ps) if p in held]
        if sel:
            slots, src = (torch.tensor(x, device=bk.device) for x in zip(*sel))
            bk[:, :, slots], bv[:, :, slots] = k[:, :, src].to(bk.dtype), v[:, :, src].to(bv.dtype)
        out_k.append(bk)
        out_v.append(bv)
    return kvcache.cache_from_tensors(model.config if not isinstance(base, kvcache.AllSlotCache) else None,
                                      out_k, out_v, kvcache.seq_length(base))


def interchange(model, run: PairRun, sets: dict[str, list[int]], random: list[list[int]], budget_bytes: int) -> dict:
    """Interchange recovery: each position set's K/V (every layer) from the pair's opposite run (the
    new one) patched into the old run, ``(s - s_old) / (s_new - s_old)``; ``random``: size-matched
    random sets of the rest, their mean and draws."""
    pair = run.pair
    masks = kvpatch.position_masks(len(run.old_cache.layers), pair.decision, [*sets.values(), *random])
    r = run.recovery(variant_scores(model, pair, run.old_cache, run.new_cache, masks, "first_token", budget_bytes))
    out = {name: float(r[i]) for i, name in enumerate(sets)}
    draws = r[len(sets):].tolist()
    return out | {"random": float(np.mean(draws)) if draws else None, "random_draws": draws}


def drift(model, run: PairRun, source, sets: dict[str, list[int]], budget_bytes: int) -> dict:
    """Each position set's K/V taken from ``source`` (the same-conclusion donor, resampled onto the
    old run's positions, :func:`resampled_source`) in the old run: the drift ``|s - s_old| / |s_new -
    s_old|``, the cosine of the decision's full logit vector with the unscrubbed run's, and whether
    the decision stayed the old run's; ``none_score_error``: the unscrubbed variant's score against
    the clean ``s_old`` (nats)."""
    pair = run.pair
    d = pair.decision
    masks = kvpatch.position_masks(len(run.old_cache.layers), d, [[], *sets.values()])
    logits = kvpatch.patched_logits(model, run.old_cache, source, masks, pair.old.ids[d: d + 1], budget_bytes)[:, 0]
    s = (logits[:, pair.cand_new[0]] - logits[:, pair.cand_old[0]]).cpu()
    cos = torch.nn.functional.cosine_similarity(logits[1:], logits[:1], dim=-1).cpu()
    return {"drift": {name: abs(float(s[i + 1]) - run.s_old) / abs(run.effect) for i, name in enumerate(sets)},
            "logit_cosine": {name: float(cos[i]) for i, name in enumerate(sets)},
            "kept": {name: bool((s[i + 1] > 0) == (run.s_old > 0)) for i, name in enumerate(sets)},
            "none_score_error": abs(float(s[0]) - run.s_old)}


def donors(runs: list[PairRun], rows: list[dict]) -> dict[tuple[str, str], list[tuple[str, int, str]]]:
    """Every clean prompt of the flipping pairs by ``(scenario, decided candidate)``: ``(instance,
    run index, side)``, the side deciding that candidate (its owned top-1 under the ``owned`` rule)."""
    out: dict = {}
    for i, (run, row) in enumerate(zip(runs, rows)):
        for side, outcome in zip(("old", "new"), outcomes(run)):
            out.setdefault((row["scenario"], outcome), []).append((row["instance"], i, side))
    return out


def pick_donor(pool: dict, row: dict, run: PairRun, seed: int) -> tuple[int, str] | None:
    """A same-conclusion donor for the pair's old run: a prompt of another instance of its scenario
    deciding the same candidate, drawn with the pair's generator; None when there is none."""
    cands = sorted({(i, side) for inst, i, side in pool.get((row["scenario"], outcomes(run)[0]), [])
                    if inst != row["instance"]})
    if not cands:
        return None
    return cands[int(pair_rng(seed, row["pair"]).integers(len(cands)))]


class Result(CircuitResult):
    """What ``run`` returns (record ``result``); ``warnings``: what could not be measured and why."""

    warnings: list[str]


def run(ctx) -> dict:
    """Note set from selection instances; interchange and same-conclusion scrubs on held-out pairs
    (see the specification)."""
    cfg: Config = ctx.cfg
    K.require_first_token(ctx)
    model = ctx.bundle.model
    fs = K.flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = with_split(fs.rows, cfg.selection_fraction, ctx.seed)
    anchor = cfg.topk_anchor
    profiles = note_profiles(ctx, fs.runs, rows, anchor, "scrubbing: position maps")
    pool = donors(fs.runs, rows)
    prefill = K.per_prompt(lambda ids: kvcache.AllSlotCache.prefill(model, ids))
    for run_, row in K.units(ctx, zip(fs.runs, rows), "scrubbing: held-out pairs"):
        if row["split"] == "heldout":
            with ctx.timer("scrub"):
                _scrub(ctx, fs.runs, run_, row, profiles, pool, prefill)
    return _result(ctx, fs, rows, sel, held, profiles)


def _scrub(ctx, runs: list[PairRun], run_: PairRun, row: dict, profiles: dict, pool: dict, prefill) -> None:
    """The note set, interchange and same-conclusion scrubs of one held-out pair (columns of ``row``)."""
    cfg: Config = ctx.cfg
    pair = run_.pair
    b, d = pair.field[1], pair.decision
    if (found := pair_profile(profiles, row)) is None:
        return
    profile, level = found
    values = position_values(profile, (b, d), cfg.topk_anchor, pair.downstream_ids)
    notes = note_set(values, (b, d), cfg.topk_anchor, cfg.k, cfg.min_recovery)
    if not notes:
        row["skipped"] = "empty_note_set"
        return
    rest = [p for p in range(b, d) if p not in notes]
    sets = {"notes": notes, "rest": rest, "downstream": list(range(b, d))}
    rng = pair_rng(ctx.seed, row["pair"])
    random_sets = ([sorted(int(p) for p in rng.choice(rest, size=len(notes), replace=False))
                    for _ in range(int(cfg.random.n_draws))] if len(rest) >= len(notes) else [])
    row |= {"note_set": notes, "note_offsets": [d - p for p in notes], "note_profile": level,
            "interchange": interchange(ctx.bundle.model, run_, sets, random_sets, ctx.budget_bytes)}
    donor = pick_donor(pool, row, run_, ctx.seed)
    if donor is None:
        row["drift_skipped"] = "no_donor"
        return
    index, side = donor
    dpair = runs[index].pair
    ids = (dpair.old if side == "old" else dpair.new).ids
    db, dd = dpair.field[1], dpair.decision
    moves = {b + j: db + q for j, q in position_map(ids[db:dd].tolist(), pair.old.ids[b:d].tolist()).items()}
    source = resampled_source(ctx.bundle.model, run_.old_cache, prefill(ids[:dd]), moves)
    row |= {"donor": {"pair": dpair.spec.id, "side": side, "instance": dpair.spec.instance.id},
            "unmapped": {name: sum(p not in moves for p in ps) for name, ps in sets.items()},
            **drift(ctx.bundle.model, run_, source, sets, ctx.budget_bytes)}


def _result(ctx, fs, rows: list[dict], sel: set, held: set, profiles: dict) -> dict:
    n_boot, seed = ctx.cfg.n_boot, ctx.seed
    families = K.families_of(ctx, rows + fs.excluded)
    scrubbed = [r for r in rows if "interchange" in r]
    drifted = [r for r in scrubbed if "drift" in r]

    def by_family(rs, get):
        return {f: K.summary([r for r in rs if f == "all" or r["family"] == f], get, n_boot, seed)
                for f in families + ["all"]}

    with ctx.timer("statistics"):
        agg = {"interchange": {s: by_family(scrubbed, lambda r, s=s: r["interchange"][s]) for s in SETS + ("random",)},
               "drift": {s: by_family(drifted, lambda r, s=s: r["drift"][s]) for s in SETS},
               "logit_cosine": {s: by_family(drifted, lambda r, s=s: r["logit_cosine"][s]) for s in SETS},
               "decision_kept": {s: by_family(drifted, lambda r, s=s: float(r["kept"][s])) for s in SETS},
               "note_set_size": by_family(scrubbed, lambda r: len(r["note_set"]))}
    checks = {"max_unscrubbed_score_error": K.worst(drifted, "none_score_error"),
              "max_unmapped_notes": max((r["unmapped"]["notes"] for r in drifted), default=None),
              "selection_pairs_in_heldout": sum(p in {r["pair"] for r in rows if r["split"] == "heldout"}
                                                for prof in profiles["scenario"].values() for p in prof["pairs"])}
    held_rows = [r for r in rows if r["split"] == "heldout"]
    warnings = split_warnings("scrubbing", rows, "scrubs", len(scrubbed),
                              "have no selection pairs of their scenario or family, no downstream position or an "
                              "empty note set")
    if len(drifted) < len(scrubbed):
        warnings.append(f"scrubbing: no same-conclusion donor (another instance of the scenario deciding the same "
                        f"candidate) for {len(scrubbed) - len(drifted)} of {len(scrubbed)} scrubbed pairs: no drift")
    aggregates = K.pair_counts(ctx, rows, fs.excluded, families) | agg | {
        "n_selection": len(rows) - len(held_rows), "n_heldout": len(held_rows), "n_scrubbed": len(scrubbed),
        "n_drift": len(drifted), "anchor": profiles["anchor"], "k": ctx.cfg.k,
        "min_recovery": ctx.cfg.min_recovery, "checks": checks,
        "skipped": dict(Counter(r["skipped"] for r in held_rows if "skipped" in r))}
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": "kv_attention",
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates,
            "warnings": warnings}


# ---------------------------------------------------------------------------------------------
# presentation


def scrub_table(rec: dict) -> str:
    """Interchange recovery and same-conclusion drift per position set (held-out pairs, all families)."""
    agg = rec["result"]["aggregates"]
    w = Lines()
    w(f"{agg['n_scrubbed']} held-out pairs scrubbed ({agg['n_drift']} with a same-conclusion donor); note set: "
      f"at most {agg['k']} positions with selection recovery >= {agg['min_recovery']} ({agg['anchor']} positions), "
      f"size {ci(agg['note_set_size']['all'])}\n")
    w("| positions | interchange recovery (opposite run) | drift (same-conclusion donor) | logit cosine | decision kept |")
    w("|---|---|---|---|---|")
    for s in SETS + ("random",):
        same = ((ci(agg[k][s]["all"]) for k in ("drift", "logit_cosine", "decision_kept")) if s != "random"
                else ("", "", ""))
        w(f"| {s} | {ci(agg['interchange'][s]['all'])} | " + " | ".join(same) + " |")
    return w.text()


#: How this probe's records are shown (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(headline="interchange/notes/all", table=scrub_table, figures=(
    Bars("interchange", "interchange/[notes,rest,downstream,random]/@",
         "interchange recovery per family, K/V from the opposite run (held-out; 95% interval)", "recovery"),
    Bars("drift", "drift/[notes,rest,downstream]/@",
         "drift per family, K/V from a same-conclusion donor (held-out; 95% interval)", "|Δs| / |s_new - s_old|")))


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.random.n_draws=1",), shapes="two")
