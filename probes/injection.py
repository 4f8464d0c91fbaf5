"""``injection``: write the other run's downstream notes over a self-consistent cache — does the
decision follow the notes or the field? (docs/design.md §3, §5)

For each token-aligned pair, two injections into prefix caches over ``[0, d)``:

- ``old_notes_into_new``: the new run's cache (new field) with every layer's downstream positions
  ``[b, d)`` overwritten by the old run's KV;
- ``new_notes_into_old``: the old run's cache (old field) with the new run's downstream KV.

The decision token is then fed at ``d`` (it reads the edited cache). The decision *follows the
notes* when the sign of the injected score equals that of the run the notes came from (the notes'
source); otherwise it follows the field (for a flipping pair the two runs' decisions differ, so
exactly one holds). Score-based: ``r_notes = (s_inj - s_base) / (s_source - s_base)``, 1 = the
notes fully decide, 0 = the field fully decides; never clipped.

Follow rates (Wilson CIs) and ``r_notes`` (cluster-bootstrap CIs) are reported only over flipping
pairs (the flip rule, docs/design.md §3); the rest are excluded and counted by reason. As a check, each
direction also injects field + downstream ``[a, d)``, which must reproduce the source run exactly
(``r = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collections import Counter

import torch

from kvnotes.records.schema import BaseResult, PairRow
from kvnotes.harness.kit import ProbeConfig
from kvnotes.kv import cache as kvcache
from kvnotes.harness import kit as K
from kvnotes.harness.readout import PairRun, run_pair, variant_scores
from kvnotes.harness.stats import proportion

DIRECTIONS = {
    # name: (base run = whose field stays, source run = whose notes are written)
    "old_notes_into_new": ("new", "old"),
    "new_notes_into_old": ("old", "new"),
}


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/injection.yaml`` (defaults there; see the module docstring)."""

    pass


def injection_masks(n_layers: int, field: tuple[int, int], decision: int) -> dict[str, torch.Tensor]:
    """Patch masks ``[2, n_layers, d]`` of each direction in :data:`DIRECTIONS`, all on the old
    cache with the new run's K/V where true (one batched call scores every variant): row 0 the
    notes, row 1 field + notes, in every layer.

    - ``new_notes_into_old``: ``[b, d)``, then ``[a, d)``;
    - ``old_notes_into_new``: the new cache with the old ``[b, d)`` is the old cache with the new
      K/V everywhere else, ``[0, b)``; with the old ``[a, d)`` it is the old cache with the new
      run's prefix ``[0, a)``.
    """
    a, b = field
    d = decision
    sets = {"new_notes_into_old": [range(b, d), range(a, d)], "old_notes_into_new": [range(0, b), range(0, a)]}
    return {name: kvcache.position_masks(n_layers, d, [list(r) for r in rs]) for name, rs in sets.items()}


@torch.no_grad()
def inject_run(model, run: PairRun, mode: str = "first_token",
               budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """Both injections of one pair's clean run (prefix caches over ``[0, d)``), scored in one
    batched call (:func:`injection_masks`).

    Returns:
        per direction ``D`` in :data:`DIRECTIONS`: ``D_s_notes`` (score with the source's notes),
        ``D_s_all`` (field + notes from the source), ``D_follows_notes`` (sign matches the source
        run), ``D_r_notes`` and ``D_r_all`` (``(s - s_base) / (s_source - s_base)``, None when the
        two runs score equally).
    """
    pair = run.pair
    clean = {"old": run.s_old, "new": run.s_new}
    masks = injection_masks(len(run.old_cache.layers), pair.field, pair.decision)
    scores = variant_scores(model, pair, run.old_cache, run.new_cache, torch.cat([masks[n] for n in DIRECTIONS]),
                            mode, budget_bytes).view(len(DIRECTIONS), 2)
    out = {}
    for (name, (base, source)), s in zip(DIRECTIONS.items(), scores):
        s_notes, s_all = float(s[0]), float(s[1])
        gap = clean[source] - clean[base]
        out |= {
            f"{name}_s_notes": s_notes, f"{name}_s_all": s_all,
            f"{name}_follows_notes": (s_notes > 0) == (clean[source] > 0),
            f"{name}_r_notes": (s_notes - clean[base]) / gap if gap else None,
            f"{name}_r_all": (s_all - clean[base]) / gap if gap else None,
        }
    return out


def inject_pair(model, pair, mode: str = "first_token", budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES,
                min_effect: float = 1.0, flip_rule: str = "owned") -> dict:
    """Clean run of ``pair`` (:func:`kvnotes.harness.readout.run_pair`): its :func:`kvnotes.harness.readout.pair_status`
    columns under ``flip_rule`` and :func:`inject_run`'s columns."""
    run = run_pair(model, pair, mode)
    return run.status(min_effect, flip_rule) | inject_run(model, run, mode, budget_bytes)


def _aggregate(rows: list[dict], n_boot: int, seed: int) -> dict:
    out = {}
    for fam, rs in K.by_family(rows).items():
        out[fam] = {}
        for name in DIRECTIONS:
            follows = sum(bool(r[f"{name}_follows_notes"]) for r in rs)
            out[fam][name] = {
                "follow_notes": proportion(follows, len(rs)),
                "follow_field": proportion(len(rs) - follows, len(rs)),
                "r_notes": K.summary(rs, f"{name}_r_notes", n_boot, seed),
            }
    return out


class InjectionRow(PairRow):
    """A pair: per direction ``<D>_s_notes``, ``<D>_follows_notes``, ``<D>_r_notes``, ..."""

    old_notes_into_new_follows_notes: bool
    new_notes_into_old_follows_notes: bool
    old_notes_into_new_r_notes: float | None
    new_notes_into_old_r_notes: float | None


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[InjectionRow]
    notes: dict[str, str]
    directions: dict[str, dict[str, str]]


def run(ctx) -> dict:
    """Inject the other run's notes into every aligned pair; aggregate over flipping pairs.

    Returns:
        ``rows`` (every aligned pair, with ``flips``/``reason``), ``aggregates`` (per family and
        ``all``: per direction follow rates with Wilson CIs and ``r_notes`` with cluster-bootstrap
        CIs, over flipping pairs; the exact-reproduction check over all pairs), ``notes`` (families
        without flipping pairs, with their counts), ``exclusions``
        (reason -> count: tokenisation exclusions and non-flipping pairs), ``excluded``, ``directions``.
    """
    cfg = ctx.cfg
    model = ctx.bundle.model
    n_boot = int(cfg.get("n_boot", 2000))
    budget = ctx.budget_bytes
    rows = []
    for run_, row in K.each_pair(ctx, desc="injection"):
        with ctx.timer("injection"):
            rows.append(row | inject_run(model, run_, ctx.readout, budget))
    flipping = [r for r in rows if r["flips"]]
    excluded = K.excluded_rows(ctx.pairs.excluded, rows)
    all_err = [abs(r[f"{n}_r_all"] - 1) for r in rows for n in DIRECTIONS if r[f"{n}_r_all"] is not None]
    score_err = [abs(r[f"{n}_s_all"] - r[f"s_{src}"]) for r in rows for n, (_, src) in DIRECTIONS.items()]
    with ctx.timer("statistics"):
        aggregates: dict[str, Any] = {
            "n_pairs": len(rows), "n_flip": len(flipping),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in flipping)),
            "flipping": _aggregate(flipping, n_boot, ctx.seed),
            "checks": {"max_field_and_notes_score_err": max(score_err, default=None),
                       "max_field_and_notes_recovery_err": max(all_err, default=None)},
        }
    notes = {f: (f"no flipping pairs ({n} aligned pairs: "
                 f"{dict(Counter(r['reason'] for r in rows if r['family'] == f))}): follow rates are undefined "
                 f"for this family and not reported")
             for f, n in aggregates["n_pairs_by_family"].items() if f not in aggregates["n_flip_by_family"]}
    return {"rows": rows, "aggregates": aggregates, "notes": notes,
            "exclusions": K.exclusion_counts(excluded), "excluded": excluded,
            "directions": {n: {"base": b, "notes_from": s} for n, (b, s) in DIRECTIONS.items()}}
