"""Residual decomposition of the components probe: embedding + every attention and MLP addition
== final pre-norm residual on every adapter architecture (Gemma-2/3 post-norms included), and the
projections onto the conclusion direction add up; on the planted constructions the decision is the read
layer's attention and the note is placed by alignment across distances."""

from __future__ import annotations

import pytest
import torch

import kvnotes.probes
from kvnotes.circuits.components import (
    contributions,
    decomposition_error,
    direct_logit_attribution,
    logit_diff_direction,
    residual_parts,
    top_offset,
)
from kvnotes.kv.engine import NNsightEngine
from kvnotes.models.adapters import Adapter
from tests.helpers import VOCAB, check_schema, recall_pairs
from tests.planted import (EXACT, FOUND, SCALE, marker_positions, note_position, planted_context,
                            planted_truth, run_spaced)

TOL = 1e-4
# fp32 logits of a tiny model are O(1); the attribution re-derives them through the final norm in a
# different order of operations, so they agree to a few ulps times the hidden size
LOGIT_TOL = 1e-4
#: DLA total vs the logit difference on the 30-layer embedded model: fp32 sums of 60 projections.
DLA_TOL = 1e-3


def _ids(seed):
    return torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed))


def test_decomposition_sums_to_final_residual(tiny):
    engine = NNsightEngine(tiny)
    parts = residual_parts(engine, _ids(0))
    L = tiny.config.num_hidden_layers
    assert parts["attn"].shape == (L, 12, tiny.config.hidden_size)
    assert decomposition_error(parts) < TOL * float(parts["final"].abs().max())
    with torch.no_grad():
        hs = tiny(_ids(0)[None], output_hidden_states=True).hidden_states
    assert (parts["embed"] - hs[0][0]).abs().max() < TOL                 # adapter-free reference
    if engine.adapter.has_post_norms:
        # the raw sublayer outputs (before the post-norm) do NOT sum to the residual: the check
        # above would fail if the engine measured them instead of the residual additions
        from kvnotes.kv.sites import Site
        raw = engine.run(_ids(0), capture=[Site("hook_z", 0)]).acts[Site("hook_z", 0)]
        o_proj = engine.adapter.module(tiny, "o_proj", 0)
        with torch.no_grad():
            pre_norm = o_proj(raw.flatten(2))[0]
        assert (pre_norm - parts["attn"][0]).abs().max() > 1e-3


class _Pair:
    cand_old, cand_new = (3,), (11,)


def _logits(model, ids):
    """Decision-position logits of a full forward, before Gemma-2's final soft-capping."""
    with torch.no_grad():
        z = model(ids[None]).logits[0].float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.atanh(z / cap) if cap else z


def test_direct_logit_attribution_sums_to_the_logit_difference(tiny):
    """Contributions times the final RMS scale add up to the model's own logit difference, with the
    final norm's gain (Gemma: 1 + w) in the direction; without the gain they would not."""
    engine = NNsightEngine(tiny)
    adapter = Adapter.for_model(tiny)
    # a non-trivial final-norm gain, so that leaving it out (or using w for 1 + w) fails
    norm = adapter.module(tiny, "final_norm")
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.8, norm.weight.numel()))
    try:
        ids = _ids(2)
        parts = residual_parts(engine, ids)
        v = logit_diff_direction(tiny, adapter, _Pair)
        eps = adapter.final_norm_eps(tiny)
        logits = _logits(tiny, ids)
        for p in (0, 5, 11):
            dla = direct_logit_attribution(parts, v, p, eps)
            target = float(logits[p, 11] - logits[p, 3])
            total = dla["embed"] + sum(dla["attn"]) + sum(dla["mlp"])
            assert abs(dla["final"] - target) < LOGIT_TOL * max(1.0, abs(target))
            assert abs(total - target) < LOGIT_TOL * max(1.0, abs(target))
        W = adapter.module(tiny, "unembed").weight
        raw = (W[11] - W[3]).float()             # the unembedding difference alone (old definition)
        wrong = direct_logit_attribution(parts, raw, 11, eps)["final"]
        assert abs(wrong - float(logits[11, 11] - logits[11, 3])) > 1e-3
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved)


def test_contributions_add_up_to_the_change_of_the_logit_difference(tiny):
    engine = NNsightEngine(tiny)
    adapter = Adapter.for_model(tiny)
    old, new = residual_parts(engine, _ids(0)), residual_parts(engine, _ids(1))
    v = logit_diff_direction(tiny, adapter, _Pair)
    c = contributions(old, new, v, 7, adapter.final_norm_eps(tiny))
    lo, ln = _logits(tiny, _ids(0)), _logits(tiny, _ids(1))
    target = float((ln[7, 11] - ln[7, 3]) - (lo[7, 11] - lo[7, 3]))
    assert c["sum_error"] < TOL * max(1.0, abs(c["final"]))
    assert abs(c["final"] - target) < LOGIT_TOL * max(1.0, abs(target))
    assert len(c["attn"]) == tiny.config.num_hidden_layers


def test_the_note_position_is_learned_per_scenario_from_its_anchor():
    """Offsets count from the decision (``d - p``) or the field's end (``p - b``); the profile is the
    selection rows' mean per offset; its top offset is the note position (ties: the smaller offset)."""
    from kvnotes.harness.selection import offset_profiles, rank_positions

    rows = [{"pair": "a", "scenario": "s", "family": "f", "downstream": (10, 14), "single": [0.0, 0.1, 0.9, 0.2]},
            {"pair": "b", "scenario": "s", "family": "f", "downstream": (10, 13), "single": [0.5, 0.8, 0.1]}]
    # offsets d - p: first [4, 3, 2, 1] -> [0.0, 0.1, 0.9, 0.2], second [3, 2, 1] -> [0.5, 0.8, 0.1]
    prof = offset_profiles(rows, "decision")["scenario"]["s"]
    assert top_offset(prof) == 2 and rank_positions(prof, (20, 26), "decision")[0] == 24
    # offsets p - b: [0, 1, 2, 3] and [0, 1, 2] -> means [0.25, 0.45, 0.5, 0.2]
    prof = offset_profiles(rows, "field_end")["scenario"]["s"]
    assert top_offset(prof) == 2 and rank_positions(prof, (20, 26), "field_end")[0] == 22
    assert top_offset({"offset": {3: 0.5, 1: 0.5}, "pairs": []}) == 1
    assert top_offset({"offset": {}, "pairs": []}) is None


def test_probe_run_on_embedded_model_matches_its_schema(smol):
    """A small components run on the embedded model: its result matches the declared schema and
    the direct logit attribution adds up to the logit difference of every pair."""
    from kvnotes.circuits.components import run as run_components
    from kvnotes.probes import ProbeContext, load_config

    cfg = load_config("components", {"progress": False, "n_boot": 200})
    res = run_components(ProbeContext(bundle=smol, pairs=recall_pairs(smol, ["favourite_colour"], per_instance=2), cfg=cfg, seed=0))
    check_schema("components", res)
    assert res["rows"] and res["aggregates"]["checks"]["max_logit_diff_error"] < DLA_TOL


# --- the planted constructions (tests/planted.py) -------------------------------------------------


@pytest.mark.planted("components")
def test_components_attribute_the_decision_to_the_read_layer_and_cannot_see_the_notes(planted_arch, planted_cache,
                                                                                        monkeypatch):
    """Mixed family (alpha 0.3): at the decision position the whole change of the logit difference is
    the attention of the read heads' layer (1): embedding, the other layers and every MLP add
    nothing. The note offset chosen on the selection split is the planted marker; there direct
    logit attribution is 0 in every component, the write layer's included: the notes sit in a
    direction the unembedding does not read and act only through the read heads' attention (what
    the attribution cannot see, documented in docs/results/planted.md)."""
    ctx = planted_context(planted_cache, monkeypatch, "mixed", "components", {"planted": {"alpha": 0.3}},
                          {"topk_anchor": "field_end"}, arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    truth = planted_truth(ctx)
    read_layer = truth["read_heads"]["notes"][0][0]
    assert read_layer == truth["read_heads"]["field"][0][0]
    by_id = {p.spec.id: p for p in ctx.pairs.pairs}
    held = [r for r in res["rows"] if r["split"] == "heldout"]
    assert held
    for r in held:
        at = r["at_decision"]
        assert at["final"] == pytest.approx(2 * truth["beta"], rel=SCALE)       # -beta -> +beta
        assert at["attn"][read_layer] == pytest.approx(at["final"], rel=EXACT)
        others = [abs(x) for i, x in enumerate(at["attn"]) if i != read_layer] + [abs(x) for x in at["mlp"]]
        assert max(others) < EXACT * truth["beta"] and abs(at["embed"]) < EXACT * truth["beta"]
        assert r["note_position"] == marker_positions(ctx, by_id[r["pair"]])["note"]
        assert max(abs(x) for x in [*r["at_note"]["attn"], *r["at_note"]["mlp"], r["at_note"]["final"]]) < EXACT


def test_components_places_the_note_by_alignment_across_distances(planted_arch, planted_cache, monkeypatch):
    ctx, _, held, distances = run_spaced(planted_cache, monkeypatch, "components", planted_arch)
    assert len(held) == 12 and len(distances) > 1
    assert sum(r["note_position"] == note_position(ctx, r["pair"]) for r in held) >= FOUND
