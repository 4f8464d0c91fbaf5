"""Selection on one split, evaluation on the other (``docs/design.md``, "Traps": never select on
the data you evaluate on).

Every probe that chooses something from data — top-k positions (``suffix_recovery``), heads
(``heads``), the note offset (``components``), the layer (``direction``) — splits the instances of
each scenario into a **selection** set and a **held-out** set (:func:`split_instances`), ranks on
selection rows only (:func:`rank_by_mean`, :func:`selection_source`) and reports numbers on held-out
rows. Capped sweeps draw whole instances across scenarios (:func:`sample_instances`). Positions are
ranked by their offset from an anchor (:func:`offsets`) with profiles learned on selection rows
(:func:`offset_profiles`, :func:`profile_for`, :func:`rank_positions`).

Position sets of a downstream span ``[b, d)`` on a grid of sizes (:func:`grid_points`,
:func:`k_for`): the last or first ``k`` positions (:func:`suffix_set`, :func:`prefix_set`) and their
k-matched random control (:func:`random_sets`), per set family (:func:`position_sets`); the random
control of a set of attention heads (:func:`random_head_sets`).
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Sequence
from itertools import zip_longest

import numpy as np

SELECTION, HELDOUT = "selection", "heldout"


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


def with_split(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], set[str], set[str]]:
    """Copies of ``rows`` tagged with ``split`` = ``"selection"`` / ``"heldout"`` by instance
    (:func:`split_instances`). Returns (rows, selection instance ids, held-out instance ids)."""
    sel, held = split_instances(rows, fraction, seed)
    return [r | {"split": SELECTION if r["instance"] in sel else HELDOUT} for r in rows], sel, held


def alternate_splits(rows: list[dict], order: Sequence[int]) -> list[int]:
    """Row indices of ``order`` with the two splits taking turns (selection first), each side in its
    own ``order``, so that a cap on the result (e.g. a probe's sweep) keeps pairs of both sides;
    once one side runs out the other follows. ``rows[i]["split"]`` is ``"selection"`` or ``"heldout"``."""
    sides = ([i for i in order if rows[i]["split"] == SELECTION], [i for i in order if rows[i]["split"] != SELECTION])
    out = []
    for pair in zip_longest(*sides):
        out += [i for i in pair if i is not None]
    return out


def split_warnings(probe: str, rows: list[dict], what: str, n_used: int | None = None, missing: str = "") -> list[str]:
    """The warnings (a result's ``warnings``, said on stderr too) of a probe whose held-out numbers
    ``what`` are empty or partial: none of its flipping ``rows`` is on a selection instance (every
    scenario's flipping pairs come from a single instance, which is held out), or, with ``n_used``
    (held-out rows that carry the numbers), some held-out rows lack them because they ``missing``.
    Nothing when there are no rows (the run's outcome line says no pair flipped).

    Returns:
        at most one line, e.g. ``"suffix_recovery: no held-out top-k curve: none of the 6 flipping
        pairs is on a selection instance (...)"``.
    """
    if not rows:
        return []
    n_sel = sum(r.get("split") == SELECTION for r in rows)
    n_held = len(rows) - n_sel
    if n_sel == 0:
        return [f"{probe}: no {what}: none of the {len(rows)} flipping pairs is on a selection instance "
                f"(a scenario's instances split into selection and held-out only when two or more of them have "
                f"flipping pairs)"]
    if n_used is not None and n_used < n_held:
        return [f"{probe}: {what} for {n_used} of {n_held} held-out pairs only; the other {n_held - n_used} {missing}"]
    return []


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
    ``hash()`` (docs/design.md, "Traps")."""
    return np.random.default_rng([int(seed), zlib.crc32(pair_id.encode())])


def selection_source(selection_rows: list[dict], row: dict, levels: Sequence[str] = ("family", "all")
                     ) -> tuple[list[dict], str | None]:
    """The selection rows a held-out ``row`` is ranked by: those sharing its ``levels[0]`` column
    (e.g. its scenario), else its ``levels[1]`` (e.g. family), ...; ``"all"`` means every selection
    row.

    Returns:
        (rows, the level they came from), or ``([], None)`` when no level has rows.
    """
    for level in levels:
        src = selection_rows if level == "all" else [r for r in selection_rows if r[level] == row[level]]
        if src:
            return src, level
    return [], None


def rank_by_mean(selection_maps: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    """Indices of a map (e.g. ``(layer, head)``) ordered by their mean over selection maps,
    descending; ties by index. Only selection maps may be passed (docs/design.md, "Traps").

    Args:
        selection_maps: arrays of one shape.

    Raises:
        ValueError: no maps.
    """
    if not len(selection_maps):
        raise ValueError("no selection maps to rank on")
    mean = np.mean(np.stack(selection_maps), axis=0)
    return sorted(np.ndindex(*mean.shape), key=lambda ix: (-mean[ix], ix))


def round_robin(rows: list[dict]) -> list[int]:
    """Row indices ordered round-robin over scenarios (first pair of each scenario, then second...),
    so a cap keeps every scenario represented."""
    seen: Counter = Counter()
    rank = []
    for i, r in enumerate(rows):
        rank.append((seen[r["scenario"]], i))
        seen[r["scenario"]] += 1
    return [i for _, i in sorted(rank)]


# ---------------------------------------------------------------------------------------------
# position rankings learned on the selection split (suffix_recovery's top-k positions)

#: Where a downstream position's offset is counted from: the decision (``d - p``) or the field's end (``p - b``).
ANCHORS = ("decision", "field_end")


def offsets(downstream: tuple[int, int], anchor: str) -> np.ndarray:
    """Offset of each downstream position ``b .. d-1`` from the anchor, ``[n]`` ints.

    ``decision``: ``d - p`` (``n .. 1``); ``field_end``: ``p - b`` (``0 .. n-1``).

    Raises:
        ValueError: unknown anchor.
    """
    b, d = downstream
    pos = np.arange(b, d)
    if anchor == "decision":
        return d - pos
    if anchor == "field_end":
        return pos - b
    raise ValueError(f"topk_anchor must be one of {ANCHORS}, got {anchor!r}")


def offset_profiles(selection_rows: list[dict], anchor: str) -> dict:
    """Mean single-position recovery per anchor offset, per scenario and per family.

    Args:
        selection_rows: rows of **selection** pairs with ``single`` (recovery of each downstream
            position alone, ``[n]``), ``downstream``, ``scenario``, ``family`` and ``pair``.

    Returns:
        ``{"scenario": {id: profile}, "family": {name: profile}}``; a profile is
        ``{"offset": {offset: mean recovery}, "pairs": [pair ids used]}``.
    """
    out: dict = {"scenario": {}, "family": {}}
    acc: dict = {}
    for r in selection_rows:
        offs = offsets(tuple(r["downstream"]), anchor)
        for level in ("scenario", "family"):
            sums, counts, pairs = acc.setdefault((level, r[level]), ({}, {}, []))
            pairs.append(r["pair"])
            for o, v in zip(offs.tolist(), r["single"], strict=True):
                sums[o] = sums.get(o, 0.0) + v
                counts[o] = counts.get(o, 0) + 1
    for (level, key), (sums, counts, pairs) in acc.items():
        out[level][key] = {"offset": {o: sums[o] / counts[o] for o in sums}, "pairs": pairs}
    return out


def profile_for(profiles: dict, scenario: str, family: str) -> tuple[dict | None, str | None]:
    """The profile a held-out pair is ranked by: its scenario's, else its family's, else None.

    Returns:
        (profile, ``"scenario"`` / ``"family"`` / None).
    """
    if scenario in profiles["scenario"]:
        return profiles["scenario"][scenario], "scenario"
    if family in profiles["family"]:
        return profiles["family"][family], "family"
    return None, None


def rank_positions(profile: dict, downstream: tuple[int, int], anchor: str) -> list[int]:
    """Downstream positions ordered by the profile value of their offsets, highest first.

    Offsets absent from the profile rank last; ties (and absent offsets) go to the smaller offset.
    """
    b, _ = downstream
    offs = offsets(downstream, anchor)
    vals = np.array([profile["offset"].get(int(o), -np.inf) for o in offs])
    order = sorted(range(len(offs)), key=lambda i: (-vals[i], offs[i]))
    return [b + i for i in order]


def grid_points(fractions: Sequence[float], counts: Sequence[int]) -> list[dict]:
    """The k grid: ``{"kind": "fraction", "value": f}`` then ``{"kind": "count", "value": c}``.

    Raises:
        ValueError: a fraction outside ``(0, 1]`` or a count below 1.
    """
    pts = []
    for f in fractions:
        if not 0 < float(f) <= 1:
            raise ValueError(f"grid fractions must lie in (0, 1], got {f}")
        pts.append({"kind": "fraction", "value": float(f)})
    for c in counts:
        if int(c) < 1:
            raise ValueError(f"grid counts must be >= 1, got {c}")
        pts.append({"kind": "count", "value": int(c)})
    return pts


def k_for(point: dict, n_downstream: int) -> int | None:
    """Set size of a grid point for a downstream of ``n_downstream`` positions.

    Fractions give ``ceil(f * n)`` (at least 1); counts give ``c``, or None when ``c > n``.
    """
    if point["kind"] == "fraction":
        return max(1, min(n_downstream, math.ceil(point["value"] * n_downstream - 1e-9)))
    return point["value"] if point["value"] <= n_downstream else None


def suffix_set(downstream: tuple[int, int], k: int) -> list[int]:
    """The last ``k`` positions of ``[b, d)``."""
    b, d = downstream
    return list(range(d - k, d))


def prefix_set(downstream: tuple[int, int], k: int) -> list[int]:
    """The first ``k`` positions of ``[b, d)``."""
    b, _ = downstream
    return list(range(b, b + k))


def random_sets(rng: np.random.Generator, downstream: tuple[int, int], k: int, n_draws: int) -> list[list[int]]:
    """``n_draws`` sets of ``k`` distinct positions drawn uniformly from ``[b, d)`` (sorted).

    Raises:
        ValueError: ``k`` exceeds the downstream length.
    """
    b, d = downstream
    if not 0 <= k <= d - b:
        raise ValueError(f"cannot draw {k} distinct positions from [{b}, {d})")
    return [sorted(int(p) for p in rng.choice(np.arange(b, d), size=k, replace=False)) for _ in range(n_draws)]


def random_head_sets(rng: np.random.Generator, n_layers: int, n_heads: int, k: int, n_draws: int) -> list[list[tuple[int, int]]]:
    """``n_draws`` sets of ``k`` distinct (layer, head) pairs drawn uniformly without replacement."""
    flat = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    return [[flat[i] for i in sorted(rng.choice(len(flat), size=k, replace=False))] for _ in range(n_draws)]


def position_sets(fams: list[str], ks: list[int | None], down: tuple[int, int], rng: np.random.Generator,
                  n_draws: int, topk_order: list[int] | None) -> dict[str, list]:
    """Per set family (``suffix``, ``prefix``, ``topk``, ``random``) and set size ``k`` of ``ks``, the
    positions of the downstream span ``down`` = ``[b, d)`` to patch (None where ``k`` is None, a
    skipped grid point): one set for suffix / prefix / topk (the first ``k`` of ``topk_order``, sorted),
    ``n_draws`` seeded random sets of ``rng`` for ``random`` (:func:`random_sets`)."""
    sets: dict[str, list] = {f: [] for f in fams}
    for k in ks:
        for f in fams:
            if k is None:
                sets[f].append(None)
            elif f == "suffix":
                sets[f].append([suffix_set(down, k)])
            elif f == "prefix":
                sets[f].append([prefix_set(down, k)])
            elif f == "topk":
                assert topk_order is not None
                sets[f].append([sorted(topk_order[:k])])
            else:
                sets[f].append(random_sets(rng, down, k, n_draws))
    return sets
