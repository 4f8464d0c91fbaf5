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
    """Run every aligned pair of ``ctx`` and keep those that flip (DESIGN.md §3).

    Non-flipping pairs are excluded with reason ``no_decision_change`` or ``small_effect``; pairs
    excluded at tokenisation keep their reason. With ``keep_caches=False`` the prefix caches of
    flipping pairs are dropped (the runs keep their scores).
    """
    out = FlippingSet(excluded=list(ctx.pairs.excluded))
    for pair in tqdm(ctx.pairs.pairs, desc=desc, disable=not ctx.cfg.get("progress", True)):
        with ctx.timer("clean_runs"):
            run, status = screen_pair(ctx.bundle.model, pair, ctx.readout, ctx.min_effect)
        row = pair_row(pair) | status
        if status["flips"]:
            if not keep_caches:
                run = PairRun(pair, None, None, run.s_old, run.s_new)
            out.runs.append(run)
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


def pair_rng(seed: int, pair_id: str) -> np.random.Generator:
    """A pair's own generator for random controls: seeded with ``(seed, crc32(pair id))``, never
    ``hash()`` (DESIGN.md §10)."""
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
