"""``injection``: write the other run's downstream notes over a self-consistent cache — does the
decision follow the notes or the field? (docs/design.md §3, §5)

Specification: ``docs/probes/injection.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.protocol import Check, GeneratedReadout, pair_loop, readout_aggregates
from kvnotes.harness.screened import ScreenedPair
from kvnotes.harness.readout import PairRun, run_pair
from kvnotes.harness.stats import proportion
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.kv.decision import recovery
from kvnotes.records.figures import Bars
from kvnotes.records.presentation import Presentation, ResultsColumn
from kvnotes.records.schema import BaseResult, PairRow

DIRECTIONS = {
    # name: (base run = whose field stays, source run = whose notes are written)
    "old_notes_into_new": ("new", "old"),
    "new_notes_into_old": ("old", "new"),
}


#: With ``scenario.variant=cot`` the injected caches' reasoning is generated and the decision read after it.
SUPPORTS_COT = True


@dataclass
class Config(ProbeConfig, GeneratedReadout):
    """Keys of ``conf/probe/injection.yaml``
    (the defaults are here; the YAML sets what differs; see the specification); with
    ``scenario.variant=cot`` the generated readout's keys (:class:`kvnotes.harness.protocol.GeneratedReadout`)."""


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
    return {name: kvpatch.position_masks(n_layers, d, [list(r) for r in rs]) for name, rs in sets.items()}


def inject_run(model, run: PairRun, mode: str = "first_token",
               budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """Both injections of one pair's clean run (prefix caches over ``[0, d)``) under the direct
    readout (:func:`inject`)."""
    return inject(ScreenedPair(run, model, mode, budget_bytes))


@torch.no_grad()
def inject(sp: ScreenedPair) -> dict:
    """Both injections of one screened pair, scored (or decoded) in one batch under the run's
    readout (:func:`injection_masks`).

    Returns:
        per direction ``D`` in :data:`DIRECTIONS`: ``D_s_notes`` (score with the source's notes),
        ``D_s_all`` (field + notes from the source), ``D_follows_notes`` (the injected run decides
        for the source's candidate, :meth:`kvnotes.harness.screened.ScreenedPair.clean_side`),
        ``D_r_notes`` and ``D_r_all`` (``(s - s_base) / (s_source - s_base)``, None when the two runs
        score equally), ``D_side_notes`` (the candidate the notes-injected run decides for: direct by
        the score's sign; generated the one its chain names, None when neither). Under the
        generated readout also ``D_chain_notes`` / ``D_chain_all`` (chain records),
        ``D_unreached_reason`` and ``D_chain_all_matches_source``
        (:meth:`kvnotes.harness.screened.ScreenedPair.chain_columns`); a chain without its marker
        has None scores and follow flag.
    """
    pair = sp.pair
    clean = {"old": sp.s_old, "new": sp.s_new}
    masks = injection_masks(sp.model.config.get_text_config().num_hidden_layers, pair.field, pair.decision)
    sc = sp.score(torch.cat([masks[n] for n in DIRECTIONS]), names=[n for n in DIRECTIONS for _ in range(2)])
    out: dict = {}
    for k, (name, (base, source)) in enumerate(DIRECTIONS.items()):
        i, j = 2 * k, 2 * k + 1
        s_notes, s_all = sc.s[i], sc.s[j]
        out |= {
            f"{name}_s_notes": s_notes, f"{name}_s_all": s_all,
            f"{name}_follows_notes": sc.side[i] == sp.clean_side(source) if sc.reached[i] else None,
            f"{name}_r_notes": recovery(s_notes, clean[base], clean[source]),
            f"{name}_r_all": recovery(s_all, clean[base], clean[source]),
            f"{name}_side_notes": sc.side[i],
        } | sp.chain_columns(sc, i, chain=f"{name}_chain_notes", unreached=f"{name}_unreached_reason") \
          | sp.chain_columns(sc, j, chain=f"{name}_chain_all", reproduces=(f"{name}_chain_all_matches_source", source))
    return out


def inject_pair(model, pair, mode: str = "first_token", budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES,
                min_effect: float = 1.0, flip_rule: str = "owned") -> dict:
    """Clean run of ``pair`` (:func:`kvnotes.harness.readout.run_pair`): its :func:`kvnotes.harness.readout.pair_status`
    columns under ``flip_rule`` and :func:`inject_run`'s columns."""
    run = run_pair(model, pair, mode)
    return run.status(min_effect, flip_rule) | inject_run(model, run, mode, budget_bytes)


def _aggregate(rows: list[dict], n_boot: int, seed: int) -> dict:
    """Per family and ``all``, per direction: follow rates (Wilson CIs) over the injected runs that
    decided (under the generated readout: whose chain reached its marker; ``follow_field`` = the
    base run's candidate, a chain naming neither counts in ``n`` only), ``n_neither`` and
    ``n_unreached`` (both 0 under the direct readout, which always decides), and ``r_notes``
    (cluster-bootstrap CI)."""
    out = {}
    for fam, rs in K.by_family(rows).items():
        out[fam] = {}
        for name in DIRECTIONS:
            done = [r for r in rs if r[f"{name}_follows_notes"] is not None]
            follows = sum(bool(r[f"{name}_follows_notes"]) for r in done)
            neither = sum(r[f"{name}_side_notes"] is None for r in done)
            out[fam][name] = {"follow_notes": proportion(follows, len(done)),
                              "follow_field": proportion(len(done) - follows - neither, len(done)),
                              "n_neither": neither, "n_unreached": len(rs) - len(done),
                              "r_notes": K.summary([r for r in done if r[f"{name}_r_notes"] is not None],
                                                   f"{name}_r_notes", n_boot, seed)}
    return out


#: The injections that write the field and the notes from the source run reproduce it: its score
#: (every readout; under the generated one where the chain is the source's own), its recovery 1
#: (direct), its chain token for token (generated).
CHECKS = (
    Check("max_field_and_notes_score_err", lambda rows: max(
        (abs(r[f"{n}_s_all"] - r[f"s_{src}"]) for r in rows for n, (_, src) in DIRECTIONS.items()
         if r[f"{n}_s_all"] is not None and r.get(f"{n}_chain_all_matches_source") is not False), default=None)),
    Check("max_field_and_notes_recovery_err", lambda rows: max(
        (abs(r[f"{n}_r_all"] - 1) for r in rows for n in DIRECTIONS if r[f"{n}_r_all"] is not None), default=None),
        readouts=("direct",)),
    Check("n_field_and_notes_chain_mismatch", lambda rows: sum(
        not r[f"{n}_chain_all_matches_source"] for r in rows for n in DIRECTIONS), readouts=("generated",)))


class InjectionRow(PairRow):
    """A pair: per direction ``<D>_s_notes``, ``<D>_follows_notes``, ``<D>_r_notes``, ..."""

    #: None only under ``scenario.variant=cot``: the injected chain did not reach its marker
    old_notes_into_new_follows_notes: bool | None
    new_notes_into_old_follows_notes: bool | None
    old_notes_into_new_r_notes: float | None
    new_notes_into_old_r_notes: float | None


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[InjectionRow]
    notes: dict[str, str]
    directions: dict[str, dict[str, str]]


def run(ctx) -> dict:
    """Inject the other run's notes into every screened pair under the run's readout
    (:func:`kvnotes.harness.protocol.pair_loop`, every pair measured); aggregate over flipping pairs.

    Returns:
        ``rows`` (every screened pair, with ``flips``/``reason``), ``aggregates`` (per family and
        ``all``: per direction follow rates with Wilson CIs and ``r_notes`` with cluster-bootstrap
        CIs, over flipping pairs; the exact-reproduction check over all pairs), ``notes`` (families
        without flipping pairs, with their counts), ``exclusions``
        (reason -> count: tokenisation exclusions, clean chains without their marker, non-flipping
        pairs), ``excluded``, ``directions``.
    """
    pr = pair_loop(ctx, "injection", lambda sp, row: inject(sp), scope="all")
    rows = pr.rows
    flipping = [r for r in rows if r["flips"]]
    with ctx.timer("statistics"):
        aggregates: dict[str, Any] = {
            "n_pairs": len(rows), "n_flip": len(flipping),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in flipping)),
            "flipping": _aggregate(flipping, ctx.cfg.n_boot, ctx.seed),
            "checks": pr.checks(CHECKS),
        } | readout_aggregates(ctx, pr)
    notes = {f: (f"no {pr.flips_phrase(n)}: {dict(Counter(r['reason'] for r in rows if r['family'] == f))}): "
                 "follow rates are undefined for this family and not reported")
             for f, n in aggregates["n_pairs_by_family"].items() if f not in aggregates["n_flip_by_family"]}
    return {"rows": rows, "aggregates": aggregates, "notes": notes, "exclusions": pr.exclusions,
            "excluded": pr.excluded, "directions": {n: {"base": b, "notes_from": s} for n, (b, s) in DIRECTIONS.items()}}


# ---------------------------------------------------------------------------------------------
# presentation


def fmt_kn_or_dash(d: dict | None) -> str:
    """``k/n``, or ``-`` for no count."""
    return f"{d['k']}/{d['n']}" if d else "-"


def _follow_notes(rec: dict, fam: str) -> str:
    f = rec["result"]["aggregates"]["flipping"].get(fam)
    return (fmt_kn_or_dash(f["old_notes_into_new"]["follow_notes"]) + " / "
            + fmt_kn_or_dash(f["new_notes_into_old"]["follow_notes"])) if f else "-"


#: The columns this probe's records add to the per-family results table (kvnotes table --results).
INJECTION_RESULTS = (ResultsColumn(70, "notes injected: decision follows notes", _follow_notes),)


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(results=INJECTION_RESULTS, headline="flipping/all/old_notes_into_new/r_notes",
    figures=(
    Bars("family-follow", "flipping/@/*/follow_notes", "decision follows the injected notes (flipping pairs; "
         "Wilson 95%)", "share of pairs"),
    Bars("family-r-notes", "flipping/@/*/r_notes", "r_notes: score moved towards the notes' run (flipping "
         "pairs; mean, 95% interval)", "r_notes")))
