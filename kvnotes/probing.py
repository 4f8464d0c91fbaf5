"""Shared steps of the recovery probes: run every pair, keep the flipping ones (counting the rest
by reason), split instances into selection and held-out sets, and summarise recoveries.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvnotes.pairs import pair_row
from kvnotes.readout import PairRun, screen_pair
from kvnotes.stats import proportion, summarize


@dataclass
class FlippingSet:
    """Flipping pairs with their clean runs, and everything else counted by reason.

    Attributes:
        runs: :class:`PairRun` of each flipping pair (prefix caches + clean scores).
        rows: identifying columns + clean status of each flipping pair (same order as ``runs``).
        exclusions: reason -> count, over tokenisation exclusions and non-flipping pairs.
        excluded: one row per excluded pair, with its reason.
    """

    runs: list[PairRun] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    exclusions: dict[str, int] = field(default_factory=dict)
    excluded: list[dict] = field(default_factory=list)


def flipping_pairs(ctx, desc: str = "clean runs", keep_caches: bool = True) -> FlippingSet:
    """Run every aligned pair of ``ctx`` and keep those that flip under ``ctx.flip_rule``
    (``docs/design.md``, "Flip rules").

    Non-flipping pairs are excluded with reason ``no_decision_change``, ``small_effect`` or
    ``not_owned`` (flips between the candidates that are not the model's top-1 answers); pairs
    excluded at tokenisation keep their reason. With ``keep_caches=False`` the prefix caches of
    flipping pairs are dropped (the runs keep their scores).
    """
    out = FlippingSet(excluded=list(ctx.pairs.excluded))
    for pair in tqdm(ctx.pairs.pairs, desc=desc, disable=not ctx.cfg.get("progress", True)):
        with ctx.timer("clean_runs"):
            run, status = screen_pair(ctx.bundle.model, pair, ctx.readout, ctx.min_effect, ctx.flip_rule)
        row = pair_row(pair) | status
        if status["flips"]:
            out.runs.append(run if keep_caches else run.released())
            out.rows.append(row)
        else:
            out.excluded.append(row)
    out.exclusions = dict(Counter(r["reason"] for r in out.excluded))
    return out


def split_instances(rows: list[dict], selection_fraction: float = 0.5, seed: int = 0) -> tuple[set[str], set[str]]:
    """Split instance ids into a selection set and a held-out set, within each scenario.

    Each scenario's instances are shuffled by a generator seeded with ``(seed, crc32(scenario))``;
    the first ``round(fraction * n)`` (at least one, and at most ``n - 1`` when ``n >= 2``) are
    for selection. Scenarios with a single instance go to the held-out side.

    Returns:
        (selection instance ids, held-out instance ids); disjoint.
    """
    by: dict[str, list[str]] = {}
    for r in rows:
        if r["instance"] not in by.setdefault(r["scenario"], []):
            by[r["scenario"]].append(r["instance"])
    sel, held = set(), set()
    for scen, insts in by.items():
        insts = sorted(insts)
        rng = np.random.default_rng([seed, zlib.crc32(scen.encode())])
        order = [insts[i] for i in rng.permutation(len(insts))]
        k = 0 if len(order) < 2 else min(len(order) - 1, max(1, round(selection_fraction * len(order))))
        sel.update(order[:k])
        held.update(order[k:])
    return sel, held


def sample_instances(rows: list[dict], max_pairs: int | None, seed: int, by: tuple[str, ...] = ("family",)) -> set[str]:
    """Pair ids of whole instances, drawn round-robin across scenarios within each group.

    For each group of rows with equal ``row[k] for k in by`` (e.g. family and split), scenarios are
    visited in a seeded random order, each contributing one randomly drawn whole instance (all of
    its pairs) per round, until the group holds at least ``max_pairs`` pairs or runs out. So a cap
    keeps whole instances (pairs of one instance are not independent) spread over as many
    scenarios as the cap allows, never the first ``k`` pairs of one scenario.

    Args:
        rows: pair rows with ``pair``, ``scenario``, ``instance`` and the ``by`` columns.
        max_pairs: the cap per group; None returns every pair.
        seed: seed of the ``numpy.random.Generator``.

    Returns:
        the chosen pair ids.
    """
    if max_pairs is None:
        return {r["pair"] for r in rows}
    rng = np.random.default_rng(seed)
    out: set[str] = set()
    for key in sorted({tuple(r[k] for k in by) for r in rows}):
        insts: dict[str, dict[str, list[str]]] = {}
        for r in rows:
            if tuple(r[k] for k in by) == key:
                insts.setdefault(r["scenario"], {}).setdefault(r["instance"], []).append(r["pair"])
        scens = sorted(insts)
        scens = [scens[i] for i in rng.permutation(len(scens))]
        queues = {s: [sorted(insts[s])[i] for i in rng.permutation(len(insts[s]))] for s in scens}
        taken = 0
        while taken < int(max_pairs) and any(queues.values()):
            for s in scens:
                if queues[s] and taken < int(max_pairs):
                    pairs = insts[s][queues[s].pop(0)]
                    out.update(pairs)
                    taken += len(pairs)
    return out


def pair_rng(seed: int, pair_id: str) -> np.random.Generator:
    """A pair's own generator for random controls: seeded with ``(seed, crc32(pair id))``, never
    ``hash()`` (docs/design.md §10)."""
    return np.random.default_rng([int(seed), zlib.crc32(pair_id.encode())])


def recovery_summary(rows: list[dict], key: str, flipped_key: str | None = None, n_boot: int = 2000,
                     seed: int = 0) -> dict:
    """Mean/median recovery with cluster-bootstrap CIs (unclipped), plus the share of pairs whose
    decision the intervention actually flipped (Wilson CI) when ``flipped_key`` is given."""
    out = summarize([r[key] for r in rows], [r["scenario"] for r in rows], [r["instance"] for r in rows],
                    n_boot, seed)
    if flipped_key:
        out["decision_flipped"] = proportion(sum(bool(r[flipped_key]) for r in rows), len(rows))
    return out


def families_of(ctx, rows: list[dict]) -> list[str]:
    """Every family of the loaded scenarios (also those without flipping pairs), sorted."""
    return sorted({s.family for s in ctx.pairs.scenarios} | {r["family"] for r in rows})


def summaries_by_family(rows: list[dict], value, flipped, families: list[str], n_boot: int = 2000,
                        seed: int = 0) -> dict:
    """:func:`kvnotes.probing.recovery_summary` over all rows (``"all"``) and per family.

    Args:
        value: ``row -> float | None``; rows giving None are left out (not counted as non-finite).
        flipped: ``row -> bool``: the patched run took the new run's decision; None to omit the
            flip share.

    Returns:
        ``{"all": summary, <family>: summary, ...}``; families without rows get ``n = 0``.
    """
    out = {}
    for g in ["all", *families]:
        rs = rows if g == "all" else [r for r in rows if r["family"] == g]
        tmp = [{"scenario": r["scenario"], "instance": r["instance"], "_v": v,
                "_f": flipped(r) if flipped else None} for r in rs if (v := value(r)) is not None]
        out[g] = recovery_summary(tmp, "_v", "_f" if flipped else None, n_boot, seed)
    return out


def exclusions_by_family(excluded: list[dict], families: list[str]) -> dict:
    """``{family: {reason: count}}`` over excluded pair rows."""
    return {f: dict(Counter(r["reason"] for r in excluded if r.get("family") == f)) for f in families}
