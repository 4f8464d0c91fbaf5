"""``heads``: which attention heads read and write the notes (docs/design.md §6).

Specification: ``docs/probes/heads.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Optional

import numpy as np
from annotated_types import Len

from kvnotes.errors import KvnotesError, ModelFitError
from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, Counts, OpenFraction, one_of, require_instances
from kvnotes.harness.head_patch import (HEAD_SITES, clean_residuals, head_outputs, patched_scores, set_masks,
                                        single_head_map)
from kvnotes.harness.kit import ProbeConfig, RandomControl
from kvnotes.harness.circuit import start_circuit
from kvnotes.harness.readout import PairRun
from kvnotes.harness.selection import (coverage, coverage_warnings, pair_rng, random_head_sets, rank_by_mean,
                                       sample_pairs, selection_source, split_warnings)
from kvnotes.harness.registry import Conformance
from kvnotes.kv import cache as kvcache
from kvnotes.kv.engine import BACKENDS, Engine
from kvnotes.records.figures import Curves
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import CircuitResult


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/heads.yaml`` (the defaults are here; the YAML sets what differs; see the specification)."""

    #: nnsight | transformer_lens (engine backend, kvnotes/kv/engine.py)
    backend: Annotated[str, one_of(*BACKENDS)] = "nnsight"
    #: head variants per batched forward (16 was fastest on a 2-core CPU)
    chunk_heads: Count = 16
    #: cumulative top-k sizes (k above n_layers * n_heads is dropped)
    ks: Counts = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    #: n_draws: k-matched random head sets per k (Generator seeded from seed + pair id)
    random: RandomControl = field(default_factory=lambda: RandomControl(5))
    #: share of each scenario's instances used to rank heads
    selection_fraction: OpenFraction = 0.5
    #: Single-head maps cost n_layers * n_heads resumed prefills per pair (write mode): map at most this many
    #: selection pairs per family (seeded draw); null = every selection pair.
    max_map_pairs_per_family: Optional[Count] = 2
    #: also compute single-head maps on held-out pairs (figures only; never ranked)
    heldout_maps: bool = False
    #: read heads (decision position) and/or write heads (note positions; the costly sweep)
    modes: Annotated[list[Annotated[str, one_of(*HEAD_SITES)]], Len(min_length=1)] = field(default_factory=lambda: list(HEAD_SITES))

    def check_run(self, run) -> None:
        """Every number is a held-out transfer of a ranking made on selection instances.

        Raises:
            KvnotesError: ``scenario.n_instances < 2``.
        """
        require_instances(run, 2, "heads", "ranks heads on selection instances and patches them on held-out ones")


def head_ks(ks, n_layers: int, n_heads: int) -> tuple[list[int], list[int]]:
    """The top-k sizes of ``ks`` the model's ``n_layers * n_heads`` heads can fill (sorted, distinct)
    and those they cannot (dropped; the run says so in its ``warnings``).

    Raises:
        ModelFitError: no size fits, before any work.
    """
    total = n_layers * n_heads
    fit, over = sorted({int(k) for k in ks if int(k) <= total}), sorted({int(k) for k in ks if int(k) > total})
    if not fit:
        raise ModelFitError(f"probe.ks={list(ks)}: every k exceeds the model's {total} heads "
                            f"({n_layers} layers x {n_heads})")
    return fit, over


def map_pairs(rows: list[dict], per_family: int | None, seed: int) -> set[str]:
    """Selection pairs that get single-head maps: all of them, or pairs drawn across scenarios and
    their instances until a family holds ``per_family`` pairs (:func:`kvnotes.harness.selection.sample_pairs`;
    the write sweep costs ``n_layers * n_heads`` resumed prefills per pair). Held-out pairs are
    never returned."""
    return sample_pairs([r for r in rows if r["split"] == "selection"], per_family, seed)


def _ranking_by_family(rows: list[dict], maps: dict, mode: str, families: list[str]) -> dict:
    """Per family: the head order (:func:`kvnotes.harness.selection.rank_by_mean` over the family's
    selection maps, else every selection map) and the pair ids it came from."""
    sel = [r for r in rows if r["split"] == "selection" and r["pair"] in maps]
    out = {}
    for f in families:
        src, level = selection_source(sel, {"family": f}, ("family", "all"))
        if src:
            out[f] = {"order": rank_by_mean([maps[r["pair"]][mode] for r in src]),
                      "pairs": [r["pair"] for r in src],
                      "source": "family" if level == "family" else "all_selection"}
    return out


def _mean_over_k(row: dict, key: str) -> float | None:
    """A held-out row's recovery of ``row[key]`` (``topk_<mode>`` or ``random_<mode>``) averaged over
    its k sizes (the area under its k curve), None when the row has none."""
    cells = row.get(key)
    return float(np.mean([c["r"] for c in cells.values()])) if cells else None


def _mode_start(engine: Engine, model, run: PairRun, mode: str):
    """(prefix cache, clean residuals or None) a mode's sweep starts from: read heads decode on the
    old cache ``[0, d)``; write heads resume the prefill at ``b`` on its view ``[0, b)``, each chunk
    from its lowest patched layer (:func:`kvnotes.harness.head_patch.clean_residuals`)."""
    if mode == "read":
        return run.old_cache, None
    prefix = kvcache.prefix_cache(model, run.old_cache, run.pair.old.ids, run.pair.field[1])
    return prefix, clean_residuals(engine, run, prefix)


class Result(CircuitResult):
    """What ``run`` returns (record ``result``): held-out rows carry ``topk_<mode>`` and
    ``random_<mode>`` (mode ``read`` / ``write``), mapped selection rows ``maps``; ``warnings``:
    what could not be measured and why, one line each (also said on stderr)."""

    warnings: list[str]


def _single_head_maps(ctx, engine, fs, rows, modes: list[str], chunk: int) -> dict[str, dict]:
    """Stage 1: single-head maps of the selection pairs (at most ``max_map_pairs_per_family`` per
    family, drawn by a seeded Generator; held-out ones only for figures when asked):
    ``pair -> mode -> [n_layers, n_heads]``."""
    model = ctx.bundle.model
    maps: dict[str, dict] = {}
    mapped = map_pairs(rows, ctx.cfg.max_map_pairs_per_family, ctx.seed)
    for run_, row in K.units(ctx, zip(fs.runs, rows), "heads: single-head maps"):
        if row["pair"] not in mapped and not (row["split"] == "heldout" and ctx.cfg.heldout_maps):
            continue
        with ctx.timer("head_outputs"):
            source = head_outputs(engine, run_.pair.new.ids)
        maps[row["pair"]] = {}
        for mode in modes:
            with ctx.timer(f"{mode}_map"):
                prefix, resid = _mode_start(engine, model, run_, mode)
                maps[row["pair"]][mode] = single_head_map(engine, run_, source, mode, prefix, chunk, resid)
    return maps


def _topk_row(ctx, engine, run_, row: dict, rankings: dict, modes: list[str], ks: list[int], n_draws: int,
              chunk: int) -> None:
    """Stage 2 for one held-out pair: all heads, the family's cumulative top-k and k-matched random
    head sets patched in one batch per mode; columns written into ``row``."""
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    with ctx.timer("head_outputs"):
        source = head_outputs(engine, run_.pair.new.ids)
    rng = pair_rng(ctx.seed, row["pair"])
    all_heads = [(l, h) for l in range(L) for h in range(H)]
    for mode in modes:
        rk = rankings[mode].get(row["family"])
        if rk is None:
            continue
        sets = [all_heads]
        sets += [rk["order"][:k] for k in ks]
        rand = [random_head_sets(rng, L, H, k, n_draws) for k in ks]
        sets += [s for draws in rand for s in draws]
        with ctx.timer(f"{mode}_topk"):
            prefix, resid = _mode_start(engine, ctx.bundle.model, run_, mode)
            s = patched_scores(engine, run_, source, set_masks(sets, L, H), mode, prefix, chunk, resid)
        r = run_.recovery(s).numpy()
        flipped = run_.decision_flipped(s).numpy()
        row[f"r_{mode}_all"] = float(r[0])
        row[f"topk_{mode}"] = {str(k): {"r": float(r[1 + i]), "flipped": bool(flipped[1 + i]),
                                        "heads": [list(x) for x in sets[1 + i]]} for i, k in enumerate(ks)}
        base = 1 + len(ks)
        row[f"random_{mode}"] = {}
        for i, k in enumerate(ks):
            rr = r[base + i * n_draws: base + (i + 1) * n_draws]
            ff = flipped[base + i * n_draws: base + (i + 1) * n_draws]
            row[f"random_{mode}"][str(k)] = {"r": float(rr.mean()), "flipped": bool(ff.mean() > 0.5),
                                             "draws": rr.tolist(), "k_sizes": [len(x) for x in rand[i]]}
        row[f"ranking_pairs_{mode}"] = rk["pairs"]


def _summaries(out_rows: list[dict], maps: dict, modes: list[str], ks: list[int], families, n_boot: int,
               seed: int) -> tuple[dict, dict]:
    """Stage 3: held-out top-k / random / all-heads curves per mode, and the mean selection maps."""
    held_rows = [r for r in out_rows if r["split"] == "heldout"]
    curves: dict = {}
    for mode in modes:
        hr = [r for r in held_rows if f"topk_{mode}" in r]
        curves[mode] = {}
        for kind in ("topk", "random"):
            curves[mode][kind] = {}
            for k in ks:
                flat = [r | {"_r": r[f"{kind}_{mode}"][str(k)]["r"], "_f": r[f"{kind}_{mode}"][str(k)]["flipped"]}
                        for r in hr]
                curves[mode][kind][str(k)] = K.summaries_by_family(flat, "_r", "_f", families, n_boot, seed)
        curves[mode]["all_heads"] = K.summaries_by_family([r | {"_r": r[f"r_{mode}_all"]} for r in hr], "_r", None,
                                                          families, n_boot, seed)
    sel_maps: dict = {}
    for mode in modes:
        sel_maps[mode] = {}
        for f in families + ["all"]:
            ms = [maps[r["pair"]][mode] for r in out_rows
                  if r["split"] == "selection" and r["pair"] in maps and (f == "all" or r["family"] == f)]
            sel_maps[mode][f] = {"mean": np.mean(np.stack(ms), 0).tolist(), "n": len(ms)} if ms else {"n": 0}
    return curves, sel_maps


def run(ctx) -> dict:
    """Read/write head patching, top-k transfer to held-out instances; see the specification.
    Stages: single-head maps on selection pairs (:func:`_single_head_maps`), rankings per family,
    top-k and random sets on held-out pairs (:func:`_topk_row`), summaries and checks.

    Raises:
        KvnotesError: a readout other than ``first_token``, or bad ``modes``.
        ModelFitError: every k of ``ks`` exceeds the model's heads (before any work).
    """
    cfg = ctx.cfg
    ks, dropped = head_ks(cfg.ks, ctx.bundle.adapter.n_layers, ctx.bundle.adapter.n_heads)    # before any work
    engine, fs, rows, sel, held = start_circuit(ctx)
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    chunk = cfg.chunk_heads
    n_draws = int(cfg.random.n_draws)
    n_boot = cfg.n_boot
    modes = [m for m in HEAD_SITES if m in cfg.modes]
    if not modes or set(cfg.modes) - set(HEAD_SITES):
        raise KvnotesError(f"heads: modes must be a non-empty subset of {list(HEAD_SITES)} (got {list(cfg.modes)})")
    maps = _single_head_maps(ctx, engine, fs, rows, modes, chunk)
    families = K.families_of(ctx, rows + fs.excluded)
    rankings = {mode: _ranking_by_family(rows, maps, mode, families) for mode in modes}
    out_rows = []
    for run_, row in K.units(ctx, zip(fs.runs, rows), "heads: top-k held-out"):
        row = dict(row)
        if row["pair"] in maps:
            row["maps"] = {m: maps[row["pair"]][m].tolist() for m in modes}
        if row["split"] == "heldout":
            _topk_row(ctx, engine, run_, row, rankings, modes, ks, n_draws, chunk)
        out_rows.append(row)
    fs.runs = [r.released() for r in fs.runs]
    held_rows = [r for r in out_rows if r["split"] == "heldout"]
    with ctx.timer("statistics"):
        curves, sel_maps = _summaries(out_rows, maps, modes, ks, families, n_boot, ctx.seed)
        verdict = {m: K.verdicts(held_rows, lambda r, m=m: _mean_over_k(r, f"topk_{m}"),
                                 lambda r, m=m: _mean_over_k(r, f"random_{m}"), families,
                                 f"top-k {m} heads vs k random heads, held-out recovery averaged over k {ks}",
                                 n_boot, ctx.seed) for m in modes}
    held_ids = {r["pair"] for r in out_rows if r["split"] == "heldout"}
    cover = coverage([r for r in out_rows if r["split"] == "selection"], set(maps))
    checks = {
        "ranking_pairs_in_heldout": sum(p in held_ids for m in modes for rk in rankings[m].values() for p in rk["pairs"]),
        "max_abs_read_all_minus_1": max((abs(r["r_read_all"] - 1) for r in held_rows if "r_read_all" in r), default=None),
        "random_set_sizes_match_k": all(all(sz == int(k) for sz in v["k_sizes"]) for r in held_rows
                                        for m in modes for k, v in r.get(f"random_{m}", {}).items()),
    }
    aggregates = K.pair_counts(ctx, out_rows, fs.excluded, families) | {
                  "n_selection": sum(r["split"] == "selection" for r in out_rows), "n_heldout": len(held_rows),
                  "ks": ks, "modes": modes, "n_layers": L, "n_heads": H, "curves": curves,
                  "selection_maps": sel_maps, "checks": checks,
                  "per_family": K.no_circuit_note(families, out_rows, fs.excluded),
                  "verdicts": verdict, "map_coverage": cover,
                  "rankings": {m: {f: {"top": [list(x) for x in rk["order"][:max(ks, default=0)]],
                                       "pairs": rk["pairs"], "source": rk["source"]}
                                   for f, rk in rankings[m].items()} for m in modes}}
    warnings = split_warnings("heads", out_rows, "held-out top-k head curves",
                              sum(any(f"topk_{m}" in r for m in modes) for r in held_rows),
                              "have no head ranking of their family or of all selection pairs")
    warnings += coverage_warnings("heads", cover, "head ranking (single-head maps)")
    if dropped:
        warnings.append(f"heads: probe.ks {dropped} exceed the model's {L * H} heads and were dropped")
    return {"rows": out_rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": engine.backend,
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates,
            "warnings": warnings}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(headline="curves/read/all_heads/all",
    figures=tuple(Curves(f"k-curves-{mode}", f"curves/{mode}/[topk,random]/#/@", f"{mode} heads: cumulative "
                      "top-k recovery against k-matched random heads (held-out pairs; mean, 95% interval)",
                      "k heads patched jointly", "recovery", xlog=True) for mode in ("read", "write")))


#: The zoo conformance lane runs it on its two cache shapes, on both backends: what is its own there,
#: the KV-head sites (one KV head, grouped heads, sliding windows), tests/kv/test_head_masks.py checks
#: on all five tiny architectures; on every entry it cost 3-7 s each, the lane's dearest probe
#: (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.random.n_draws=1", "probe.max_map_pairs_per_family=1", "probe.ks=[1,4]"),
                          shapes="two", transformer_lens="two")
