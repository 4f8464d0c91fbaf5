"""``components``: direct logit attribution (DLA) of the logit difference to every layer's
attention and MLP, at the decision position and at the top note position (``docs/design.md``,
"Circuits").

Specification: ``docs/probes/components.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import OpenFraction, one_of
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.circuit import note_profiles, start_circuit
from kvnotes.harness.selection import ALIGNED, ANCHORS, coverage, coverage_warnings, profile_for, rank_positions, split_warnings
from kvnotes.harness.registry import Conformance, Invariants, flipping_rows
from kvnotes.kv.engine import BACKENDS, Engine
from kvnotes.kv.sites import Site
from kvnotes.records.figures import Curves
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import CircuitResult, SplitRow

# ----------------------------------------------------------------------- direct logit attribution

def residual_parts(engine: Engine, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual-stream decomposition of a full forward of ``ids`` (``[T]``).

    Returns:
        ``embed`` ``[T, D]``, ``attn`` / ``mlp`` ``[n_layers, T, D]`` (the residual additions),
        ``final`` ``[T, D]`` (last layer output, before the final norm); fp32.
    """
    L = engine.adapter.n_layers
    sites = [Site("resid_pre", 0), Site("resid_post", L - 1)] + [Site(k, l) for l in range(L) for k in ("attn_out", "mlp_out")]
    acts = engine.run(ids, capture=sites).acts
    return {"embed": acts[Site("resid_pre", 0)][0].float(),
            "attn": torch.stack([acts[Site("attn_out", l)][0] for l in range(L)]).float(),
            "mlp": torch.stack([acts[Site("mlp_out", l)][0] for l in range(L)]).float(),
            "final": acts[Site("resid_post", L - 1)][0].float()}


def decomposition_error(parts: dict[str, torch.Tensor]) -> float:
    """Max abs of ``embed + Σ_l (attn_l + mlp_l) - final`` over positions and dimensions."""
    total = parts["embed"] + parts["attn"].sum(0) + parts["mlp"].sum(0)
    return float((total - parts["final"]).abs().max())


def logit_diff_direction(model, adapter, pair) -> torch.Tensor:
    """The logit-difference direction ``g ⊙ (W_U[cand_new] - W_U[cand_old])``, ``[D]`` fp32
    (first tokens; ``g`` the final norm's effective gain, :meth:`Adapter.final_norm_gain`). Not
    normalised: ``σ · v · x`` is the logit difference of the final residual ``x``."""
    from accelerate.utils import align_module_device

    head = adapter.module(model, "unembed")
    with align_module_device(head):          # an offloaded head (device map) has its weight on meta until then
        row = (head.weight[pair.cand_new[0]] - head.weight[pair.cand_old[0]]).float()
    gain = adapter.final_norm_gain(model)
    return gain * row.to(gain.device)


def final_scale(final: torch.Tensor, eps: float) -> torch.Tensor:
    """The final RMSNorm's scale ``1 / sqrt(mean(x²) + eps)`` per position of the final
    pre-norm residual ``final`` ``[T, D]``; returns ``[T]`` fp32."""
    return torch.rsqrt(final.float().pow(2).mean(-1) + eps)


def direct_logit_attribution(parts: dict[str, torch.Tensor], v: torch.Tensor, p: int, eps: float) -> dict:
    """Direct logit attribution of one run at position ``p``: every residual part (``embed``,
    ``attn`` / ``mlp`` per layer, ``final``) projected on ``v`` and scaled by the run's frozen
    final RMS scale, in nats. ``final`` is the logit difference itself."""
    s = final_scale(parts["final"][p:p + 1], eps)[0]
    return {"embed": float(s * (parts["embed"][p] @ v)), "attn": (s * (parts["attn"][:, p] @ v)).tolist(),
            "mlp": (s * (parts["mlp"][:, p] @ v)).tolist(), "final": float(s * (parts["final"][p] @ v))}


def contributions(old: dict, new: dict, v: torch.Tensor, p: int, eps: float) -> dict:
    """New-minus-old direct logit attribution at position ``p`` (:func:`direct_logit_attribution`
    of each run): ``embed``, ``attn`` / ``mlp`` per layer (lists), ``final`` (the change of the
    logit difference), ``sum_error`` (|embed + Σ - final|), all in nats."""
    a, b = direct_logit_attribution(old, v, p, eps), direct_logit_attribution(new, v, p, eps)
    out = {"embed": b["embed"] - a["embed"], "final": b["final"] - a["final"],
           "attn": [y - x for x, y in zip(a["attn"], b["attn"])], "mlp": [y - x for x, y in zip(a["mlp"], b["mlp"])]}
    return out | {"sum_error": abs(out["embed"] + sum(out["attn"]) + sum(out["mlp"]) - out["final"])}


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/components.yaml``
    (the defaults are here; the YAML sets what differs; see the specification)."""

    #: nnsight | transformer_lens
    backend: Annotated[str, one_of(*BACKENDS)] = "nnsight"
    #: share of each scenario's instances used to choose the note offset
    selection_fraction: OpenFraction = 0.5
    #: the note position, learned per scenario: aligned (token alignment) | decision (offset d - p) |
    #: field_end (p - b)
    topk_anchor: Annotated[str, one_of(*ANCHORS)] = "aligned"


def top_offset(profile: dict) -> int | None:
    """The offset with the highest mean recovery in an offset profile
    (:func:`kvnotes.harness.selection.offset_profiles`; ties: the smaller offset), None when empty."""
    offs = profile["offset"]
    return min(offs, key=lambda o: (-offs[o], o)) if offs else None


def top_note(profile: dict, anchor: str) -> dict:
    """What the record says of a selection profile's top note position: the pairs it came from and,
    for an offset anchor, the offset (:func:`top_offset`); for ``aligned``, per selection span (one
    per instance) the top position's offset from the decision (positions move between instances,
    so no one offset names them)."""
    if anchor != ALIGNED:
        return {"offset": top_offset(profile), "pairs": profile["pairs"]}
    tops = [len(sp["mean"]) - int(np.argmax(sp["mean"])) for sp in profile["spans"] if sp["mean"]]
    return {"offset": None, "offsets_from_decision": tops, "pairs": profile["pairs"]}



class ComponentsRow(SplitRow):
    """A flipping pair: its split and the DLA contributions at the decision position."""

    at_decision: dict[str, Any]


class Result(CircuitResult):
    """What ``run`` returns (record ``result``); ``warnings``: what could not be measured and why,
    one line each (also said on stderr)."""

    rows: list[ComponentsRow]
    warnings: list[str]


def run(ctx) -> dict:
    """Attention vs MLP contributions per layer; see the specification."""
    engine, fs, rows, sel, held = start_circuit(ctx)
    cfg = ctx.cfg
    model = ctx.bundle.model
    L = engine.adapter.n_layers
    eps = engine.adapter.final_norm_eps(model)
    n_boot = cfg.n_boot
    # 1. the top note offset per family, from selection pairs only
    families = K.families_of(ctx, rows + fs.excluded)
    anchor = cfg.topk_anchor
    profiles = note_profiles(ctx, fs.runs, rows, anchor, "components: position maps")
    offsets = {level: {key: top_note(prof, anchor) for key, prof in profiles[level].items()}
               for level in ("scenario", "family")} | {"anchor": anchor}
    # 2. decomposition of every pair at the decision position and the family's note offset; a prompt
    # two pairs share (an instance's value is the new side of one and the old side of the next) once
    parts = K.per_prompt(lambda ids: residual_parts(engine, ids))
    for i, (run_, row) in enumerate(K.units(ctx, zip(fs.runs, rows), "components: decompose")):
        with ctx.timer("decompose"):
            old = parts(run_.pair.old.ids)
            new = parts(run_.pair.new.ids)
        v = logit_diff_direction(model, engine.adapter, run_.pair)
        row["decomposition_error"] = max(decomposition_error(old), decomposition_error(new))
        row["at_decision"] = contributions(old, new, v, run_.pair.decision, eps)
        row["logit_diff_error"] = abs(row["at_decision"]["final"] - (run_.s_new - run_.s_old))
        profile, level = profile_for(profiles, row["scenario"], row["family"])
        b, d = row["field"][1], row["decision"]
        if profile is not None and b < d:
            row["note_position"] = rank_positions(profile, (b, d), anchor, run_.pair.downstream_ids)[0]
            row["note_profile"] = level
            row["at_note"] = contributions(old, new, v, row["note_position"], eps)
        fs.runs[i] = run_.released()
    held_rows = [r for r in rows if r["split"] == "heldout"]
    with ctx.timer("statistics"):
        def per_layer(rs, where, comp):
            rs = [r for r in rs if where in r]
            return [K.summary(rs, lambda r, l=l: r[where][comp][l], n_boot, ctx.seed) for l in range(L)]

        def scalar(rs, where, comp):
            rs = [r for r in rs if where in r]
            return K.summary(rs, lambda r: r[where][comp], n_boot, ctx.seed)

        contrib = {}
        for where in ("at_note", "at_decision"):
            contrib[where] = {}
            for f in families + ["all"]:
                rs = [r for r in held_rows if f == "all" or r["family"] == f]
                contrib[where][f] = {"attn": per_layer(rs, where, "attn"), "mlp": per_layer(rs, where, "mlp"),
                                     "embed": scalar(rs, where, "embed"), "final": scalar(rs, where, "final")}
    checks = {"max_decomposition_error": max((r["decomposition_error"] for r in rows), default=None),
              # first-token scores are logit differences: the attribution's total must equal them
              "max_logit_diff_error": max((r["logit_diff_error"] for r in rows), default=None),
              "max_projection_sum_error": max((r[w]["sum_error"] for r in rows for w in ("at_note", "at_decision")
                                               if w in r), default=None),
              "offset_pairs_in_heldout": sum(p in {r["pair"] for r in held_rows}
                                             for level in ("scenario", "family") for o in offsets[level].values()
                                             for p in o["pairs"])}
    aggregates = K.pair_counts(ctx, rows, fs.excluded, families) | {
                  "n_selection": len(rows) - len(held_rows), "n_heldout": len(held_rows),
                  "n_layers": L, "direction": "logit difference: final-norm gain * (W_U[cand_new] - W_U[cand_old]), "
                  "scaled by each run's final RMS scale (direct logit attribution, nats)",
                  "note_offsets": offsets, "contributions": contrib, "checks": checks,
                  "post_norms": engine.adapter.has_post_norms,
                  "per_family": K.no_circuit_note(families, rows, fs.excluded)}
    warnings = split_warnings("components", rows, "contributions at the top note position",
                              sum("at_note" in r for r in held_rows),
                              "have no selection pairs of their scenario or family to place the note by, or no "
                              "downstream position")
    sel_rows = [r for r in rows if r["split"] == "selection"]
    aggregates["profile_coverage"] = coverage(sel_rows, {r["pair"] for r in sel_rows}, ("scenario",))
    warnings += coverage_warnings("components", aggregates["profile_coverage"], "note position")
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": engine.backend,
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates,
            "warnings": warnings}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=tuple(Curves(f"layer-contributions-{where}", f"contributions/{where}/@/[attn,mlp]/#",
                           f"new - old direct logit attribution per layer, {what} (held-out; mean, 95% interval)",
                           "layer", "Δ logit attribution (nats)")
                    for where, what in (("at_note", "top note position"), ("at_decision", "decision position"))))


#: Nats: direct logit attribution's parts against the model's own logit difference (fp32).
DLA_TOL = 1e-3


def invariants(rec: dict) -> Invariants:
    """What a record holds on any model and backend: the DLA parts add up to the logit difference,
    and the decision's final difference is the runs' score difference."""
    rows = flipping_rows(rec)
    return Invariants("DLA sums", len(rows), [
        f"{r['pair']}: decomposition error {r['decomposition_error']}, logit difference error {r['logit_diff_error']}"
        for r in rows if not (abs(r["decomposition_error"]) < DLA_TOL and abs(r["logit_diff_error"]) < DLA_TOL)])


#: The zoo conformance lane runs it on every entry, on the TransformerLens backend too (its hook
#: names and head outputs of that architecture; :class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(transformer_lens="every", invariants=invariants)
