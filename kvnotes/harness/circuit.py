"""The common steps of the circuit probes (``circuits/``): the flipping pairs with their prefix
caches and their selection / held-out split, and the note positions learned on selection pairs.

A circuit measures components (heads, directions, attention vs MLP, SAE features) on the flipping
pairs the pair loop of :mod:`kvnotes.harness.protocol` would screen; it chooses what it measures on
selection instances and reports held-out ones (docs/design.md, "Traps").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvnotes.harness import kit as K
from kvnotes.harness.readout import PairRun
from kvnotes.harness.selection import offset_profiles, profile_for, with_split
from kvnotes.kv.engine import make_engine


def start_circuit(ctx):
    """The common start of a circuit probe: the first-token readout check, the engine of the
    config's ``backend``, the flipping pairs with their prefix caches, and their selection /
    held-out split (``selection_fraction``, ``ctx.seed``).

    Returns:
        (engine, :class:`kvnotes.harness.kit.FlippingSet`, rows tagged with ``split``, selection instance
        ids, held-out instance ids).

    Raises:
        KvnotesError: a readout other than ``first_token``.
    """
    K.require_first_token(ctx)
    engine = make_engine(ctx.bundle.model, ctx.cfg.backend)
    fs = K.flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = with_split(fs.rows, float(ctx.cfg.selection_fraction), ctx.seed)
    return engine, fs, rows, sel, held


def note_profiles(ctx, runs: Sequence[PairRun], rows: list[dict], anchor: str, desc: str) -> dict:
    """The note-position profiles of a probe that chooses its note positions on selection instances
    (the circuits that read note positions): each selection row with a downstream position
    gets ``position_map``, the recovery of every downstream position patched alone
    (:func:`kvnotes.harness.kit.single_position_scores`), and the profiles are their means per scenario and family
    (:func:`kvnotes.harness.selection.offset_profiles`; positions carried by ``anchor``).

    Args:
        runs: the flipping pairs' clean runs (with prefix caches), in the order of ``rows``.
        rows: their rows, tagged with ``split`` (:func:`kvnotes.harness.selection.with_split`).

    Returns:
        :func:`kvnotes.harness.selection.offset_profiles`' profiles.
    """
    model = ctx.bundle.model
    for run_, row in K.units(ctx, zip(runs, rows), desc):
        if row["split"] == "selection" and row["field"][1] < row["decision"]:
            with ctx.timer("position_map"):
                row["position_map"] = run_.recovery(
                    K.single_position_scores(model, run_, "first_token", ctx.budget_bytes)).tolist()
    return offset_profiles([r | {"single": r["position_map"], "downstream": (r["field"][1], r["decision"]),
                                 "downstream_ids": run_.pair.downstream_ids}
                            for run_, r in zip(runs, rows) if "position_map" in r], anchor)


def pair_profile(profiles: dict, row: dict) -> tuple[dict, str] | None:
    """The profile (:func:`note_profiles`) a pair's note positions are read from, its scenario's or
    else its family's, with that level; None when there is none or the pair has no downstream
    position, said in ``row["skipped"]`` (``no_profile``, ``no_downstream``)."""
    profile, level = profile_for(profiles, row["scenario"], row["family"])
    if profile is None or row["field"][1] >= row["decision"]:
        row["skipped"] = "no_profile" if profile is None else "no_downstream"
        return None
    return profile, str(level)
