"""Selection on one split, evaluation on the other (``docs/design.md``, "Traps": never select on
the data you evaluate on).

Every probe that chooses something from data — top-k positions, heads, the note offset, the
layer — splits the instances of
each scenario into a **selection** set and a **held-out** set (:func:`split_instances`), ranks on
selection rows only (:func:`rank_by_mean`, :func:`selection_source`) and reports numbers on held-out
rows. Capped sweeps draw pairs stratified over scenarios and instances (:func:`sample_pairs`), and
say when a subset does not represent its family (:func:`coverage`). A held-out
pair's positions are matched to the selection pairs' by aligning the downstream tokens
(:func:`align_positions`), or by their offset from an anchor (:func:`offsets`), with profiles
learned on selection rows (:func:`offset_profiles`, :func:`profile_for`, :func:`rank_positions`).

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
from difflib import SequenceMatcher
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
        at most one line, e.g. ``"<probe>: no held-out top-k curve: none of the 6 flipping
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


def sample_pairs(rows: list[dict], max_pairs: int | None, seed: int, by: tuple[str, ...] = ("family",)) -> set[str]:
    """Pair ids stratified over scenarios, and over instances within each scenario.

    For each group of rows with equal ``row[k] for k in by`` (e.g. family and split), scenarios are
    visited in a seeded random order; each round takes one pair from every scenario that has one
    left, from its next instance in a seeded order (the instances take turns), until the group holds
    ``max_pairs`` pairs or runs out. So a cap of ``m`` pairs covers ``min(m, scenarios)`` scenarios
    and spreads each scenario's pairs over its instances; it never keeps the first ``k`` pairs of
    one instance (issue #53: a map built from one instance of one scenario ranked the heads of a
    scenario without notes for a family whose other scenario has them).

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
        tree: dict[str, dict[str, list[str]]] = {}
        for r in rows:
            if tuple(r[k] for k in by) == key:
                tree.setdefault(r["scenario"], {}).setdefault(r["instance"], []).append(r["pair"])
        scens = sorted(tree)
        scens = [scens[i] for i in rng.permutation(len(scens))]
        queues = {}
        for sc in scens:
            insts = sorted(tree[sc])
            insts = [insts[i] for i in rng.permutation(len(insts))]
            pairs = {i: sorted(tree[sc][i]) for i in insts}
            pairs = {i: [ps[j] for j in rng.permutation(len(ps))] for i, ps in pairs.items()}
            queues[sc] = [p for turn in zip_longest(*pairs.values()) for p in turn if p is not None]
        taken = 0
        while taken < int(max_pairs) and any(queues.values()):
            for sc in scens:
                if queues[sc] and taken < int(max_pairs):
                    out.add(queues[sc].pop(0))
                    taken += 1
    return out


def coverage(rows: list[dict], chosen: set[str], by: tuple[str, ...] = ("family",)) -> dict[str, dict]:
    """How well the ``chosen`` pairs (a selection subset, a map's pairs) represent each group of
    ``rows`` (grouped by ``by``, e.g. family): ``{group: {"n_scenarios", "n_scenarios_used",
    "n_instances_used", "represents"}}``, group keys joined by ``/``. ``represents`` is True when the
    chosen pairs cover at least two of the group's scenarios (every scenario, when it has fewer)
    and more than one instance (issue #53: no probe ranks on a single instance without saying it,
    even when the group has no other)."""
    out: dict[str, dict] = {}
    for key in sorted({tuple(r[k] for k in by) for r in rows}):
        group = [r for r in rows if tuple(r[k] for k in by) == key]
        used = [r for r in group if r["pair"] in chosen]
        n_scen = len({r["scenario"] for r in group})
        n_used = len({r["scenario"] for r in used})
        n_inst = len({r["instance"] for r in used})
        out["/".join(map(str, key))] = {"n_scenarios": n_scen, "n_scenarios_used": n_used, "n_instances_used": n_inst,
                                        "represents": n_used >= min(2, n_scen) and n_inst >= 2}
    return out


def coverage_warnings(probe: str, cover: dict[str, dict], what: str) -> list[str]:
    """The lines saying which groups' ``what`` (e.g. ``"head ranking"``) does not represent them
    (:func:`coverage`): one per group built from too few of its scenarios, and one naming every
    group built from a single instance."""
    out, single = [], []
    for group, c in cover.items():
        if c["represents"] or not c["n_instances_used"]:
            continue
        if c["n_scenarios_used"] < min(2, c["n_scenarios"]):
            out.append(f"{probe}: the {what} of {group} comes from {c['n_scenarios_used']} of its {c['n_scenarios']} "
                       f"scenarios; raise the cap so it covers at least two")
        else:
            single.append(group)
    if single:
        out.append(f"{probe}: the {what} of {', '.join(single)} comes from a single selection instance each; it may "
                   f"not represent {'them' if len(single) > 1 else 'it'} (more instances: raise scenario.n_instances)")
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
# position rankings learned on the selection split (top-k positions, a note position)

#: How a held-out pair's downstream positions are matched to the selection pairs' (``topk_anchor``):
#: ``aligned`` aligns the downstream tokens (:func:`align_positions`); ``decision`` and ``field_end``
#: carry a position by its offset from that anchor (:func:`offsets`).
ALIGNED = "aligned"
OFFSET_ANCHORS = ("decision", "field_end")
ANCHORS = (ALIGNED, *OFFSET_ANCHORS)


def offsets(downstream: tuple[int, int], anchor: str) -> np.ndarray:
    """Offset of each downstream position ``b .. d-1`` from the anchor, ``[n]`` ints.

    ``decision``: ``d - p`` (``n .. 1``); ``field_end``: ``p - b`` (``0 .. n-1``).

    Raises:
        ValueError: an anchor other than :data:`OFFSET_ANCHORS`.
    """
    b, d = downstream
    pos = np.arange(b, d)
    if anchor == "decision":
        return d - pos
    if anchor == "field_end":
        return pos - b
    raise ValueError(f"topk_anchor must be one of {OFFSET_ANCHORS} to count offsets, got {anchor!r}")


def align_positions(source: Sequence[int], target: Sequence[int]) -> list[tuple[int, int]]:
    """Order-preserving token alignment of two downstream spans: ``(i, j)`` index pairs with
    ``source[i] == target[j]``, from the matching blocks of :class:`difflib.SequenceMatcher`
    (Ratcliff/Obershelp: the longest common block first, then recursively either side of it; no
    junk heuristic). Both spans start right after the field and end at the decision, so the
    alignment is anchored at both ends; a filler or name of another length shifts the positions
    after it, and the shared tokens around it still match.

    Args:
        source: token ids of ``[b, d)`` of one prompt (a selection pair's).
        target: token ids of ``[b, d)`` of the other (a held-out pair's).

    Returns:
        matched index pairs (into ``source``, into ``target``), increasing in both.
    """
    blocks = SequenceMatcher(None, list(source), list(target), autojunk=False).get_matching_blocks()
    return [(blk.a + k, blk.b + k) for blk in blocks for k in range(blk.size)]


def offset_profiles(selection_rows: list[dict], anchor: str) -> dict:
    """Mean single-position recovery per selection position, per scenario and per family.

    Args:
        selection_rows: rows of **selection** pairs with ``single`` (recovery of each downstream
            position alone, ``[n]``), ``downstream``, ``scenario``, ``family`` and ``pair``; with
            ``anchor="aligned"`` also ``downstream_ids`` (the prompt's token ids of ``[b, d)``).
        anchor: one of :data:`ANCHORS`.

    Returns:
        ``{"scenario": {id: profile}, "family": {name: profile}, "anchor": anchor}``; a profile is
        ``{"offset": {offset: mean recovery}, "pairs": [pair ids used]}`` for an offset anchor, and
        ``{"spans": [{"ids": [...], "mean": [...]}], "pairs": [...]}`` for ``aligned`` (one span per
        distinct downstream text, its map averaged over the pairs that share it: the pairs of one
        instance differ only in the field).

    Raises:
        ValueError: an unknown anchor.
    """
    if anchor not in ANCHORS:
        raise ValueError(f"topk_anchor must be one of {ANCHORS}, got {anchor!r}")
    out: dict = {"scenario": {}, "family": {}}
    acc: dict = {}
    for r in selection_rows:
        for level in ("scenario", "family"):
            sums, counts, pairs = acc.setdefault((level, r[level]), ({}, {}, []))
            pairs.append(r["pair"])
            keys = ([(tuple(r["downstream_ids"]), i) for i in range(len(r["single"]))] if anchor == ALIGNED
                    else offsets(tuple(r["downstream"]), anchor).tolist())
            for o, v in zip(keys, r["single"], strict=True):
                sums[o] = sums.get(o, 0.0) + v
                counts[o] = counts.get(o, 0) + 1
    for (level, key), (sums, counts, pairs) in acc.items():
        mean = {o: sums[o] / counts[o] for o in sums}
        if anchor == ALIGNED:
            spans = list(dict.fromkeys(ids for ids, _ in mean))
            out[level][key] = {"spans": [{"ids": list(ids), "mean": [mean[(ids, i)] for i in range(len(ids))]}
                                         for ids in spans], "pairs": pairs}
        else:
            out[level][key] = {"offset": mean, "pairs": pairs}
    return out | {"anchor": anchor}


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


def position_values(profile: dict, downstream: tuple[int, int], anchor: str,
                    downstream_ids: Sequence[int] | None = None) -> np.ndarray:
    """The profile's value at each position ``b .. d-1`` of a held-out pair, ``[n]`` floats; NaN
    where no selection position maps there (an offset the selection pairs lack, a token no
    alignment matched).

    ``aligned``: each selection span is aligned to ``downstream_ids`` (:func:`align_positions`) and a
    position takes the mean of the values carried onto it; an offset anchor reads the profile at the
    position's offset (:func:`offsets`).

    Raises:
        ValueError: ``aligned`` without ``downstream_ids`` of the span's length.
    """
    b, d = downstream
    if anchor != ALIGNED:
        return np.array([profile["offset"].get(int(o), np.nan) for o in offsets(downstream, anchor)], dtype=float)
    if downstream_ids is None or len(downstream_ids) != d - b:
        raise ValueError(f"aligned positions need the held-out pair's {d - b} downstream token ids")
    sums, counts = np.zeros(d - b), np.zeros(d - b)
    for span in profile["spans"]:
        for i, j in align_positions(span["ids"], downstream_ids):
            sums[j] += span["mean"][i]
            counts[j] += 1
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def rank_positions(profile: dict, downstream: tuple[int, int], anchor: str,
                   downstream_ids: Sequence[int] | None = None) -> list[int]:
    """Downstream positions ordered by the profile's value there (:func:`position_values`), highest
    first (:func:`rank_values`)."""
    return rank_values(position_values(profile, downstream, anchor, downstream_ids), downstream, anchor)


def rank_values(values: np.ndarray, downstream: tuple[int, int], anchor: str) -> list[int]:
    """Downstream positions ``b .. d-1`` ordered by ``values`` (``[d - b]``, :func:`position_values`),
    highest first. Positions without a value (NaN) rank last; ties (and those) go to the position
    nearer the anchor (the decision for ``aligned`` and ``decision``, the field's end for ``field_end``).
    """
    b, d = downstream
    vals = np.where(np.isnan(values), -np.inf, values)
    near = offsets(downstream, "field_end" if anchor == "field_end" else "decision")
    order = sorted(range(d - b), key=lambda i: (-vals[i], near[i]))
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
