"""``field_or_notes``: does the decision read the field's own K/V or the notes written after it?

A probe of this example project (not of kvnotes): for every flipping pair it patches, from the new
run into the old one, either the field span's K/V alone or the downstream K/V alone (every
position after the field up to the decision), and reports the normalised logit-difference recovery
of each per family. kvnotes' harness does everything else: pairs, the flip filter, the readout,
intervals, the record.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.protocol import run_patches
from kvnotes.records.figures import Bars
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, PairRow


@dataclass
class Config(ProbeConfig):
    """Keys of conf/probe/field_or_notes.yaml (progress, n_boot and pairs from kvnotes' _base.yaml)."""


class Row(PairRow):
    r_field: float | None
    flipped_field: bool | None
    r_notes: float | None
    flipped_notes: bool | None


class Result(BaseResult):
    rows: list[Row]


def run(ctx) -> dict:
    """Recovery of every flipping pair from the field's K/V alone and from the notes' alone."""
    pr = run_patches(ctx, lambda pair: {"field": range(*pair.field), "notes": range(pair.field[1], pair.decision)},
                     desc="field_or_notes")
    families = K.families_of(ctx, pr.rows + pr.excluded)
    aggregates = {name: K.summaries_by_family(pr.rows, f"r_{name}", f"flipped_{name}", families,
                                              ctx.cfg.n_boot, ctx.seed) for name in ("field", "notes")}
    return {"rows": pr.rows, "aggregates": aggregates, "exclusions": pr.exclusions, "excluded": pr.excluded}


PRESENTATION = Presentation(
    headline="field/all",
    figures=(Bars("field-recovery", "field/@", "recovery from the field's K/V alone (95% interval)", "recovery"),
             Bars("notes-recovery", "notes/@", "recovery from the notes' K/V alone (95% interval)", "recovery")))
