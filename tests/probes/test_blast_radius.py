"""``blast_radius`` (docs/probes/blast_radius.md): on the planted constructions a field change moves the
values of exactly the planted note positions, and on the embedded SmolLM2 the deviation maps of a
real recall pair hold their invariants."""

from __future__ import annotations

import pytest

import kvnotes.probes
from kvnotes.probes.blast_radius import deviation_maps, summarize_pair
from tests.planted import EXACT, ROUNDING, planted_context, planted_truth


@pytest.mark.planted("blast_radius")
@pytest.mark.parametrize("family", ["notes", "distributed"])
def test_blast_radius_moves_the_values_of_the_note_positions_only(planted_arch, planted_cache, monkeypatch, family):
    """A field change moves no key downstream (keys read role flags only) and the values of exactly
    the planted note positions the write head reached (every layer: the notes are written at layer
    0 and read from layer 1's values); nothing before the field moves."""
    ctx = planted_context(planted_cache, monkeypatch, family, "blast_radius", n_instances=1, scenario_ids=["adjacent"],
                          arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    truth = planted_truth(ctx)
    assert res["aggregates"]["prefix_max_dev"] < ROUNDING
    ex = res["examples"]["planted"]
    b, d = ex["field"][1], ex["decision"]
    moved = {p for p in range(b, d) if max(layer[p] for layer in ex["maps"]["v_rel"]) > EXACT}
    assert {ex["tokens"][p] for p in moved} == set(truth["notes"]["tokens"]) and len(moved) == len(truth["notes"]["tokens"])
    assert max(max(layer[b:d]) for layer in ex["maps"]["k_rel"]) < EXACT


def test_blast_radius_maps(smol, smol_recall_pair, smol_pair_run):
    maps, lps = deviation_maps(smol.model, smol_recall_pair)
    scores = [float(lp[smol_recall_pair.cand_new[0]] - lp[smol_recall_pair.cand_old[0]]) for lp in lps]
    assert scores == pytest.approx([smol_pair_run.s_old, smol_pair_run.s_new], abs=1e-4)
    assert [int(lp.argmax()) for lp in lps] == [d.top1 for d in smol_pair_run.decisions]
    a, b = smol_recall_pair.field
    d = smol_recall_pair.decision
    assert maps["k_rel"].shape == (30, d + 1)
    assert float(maps["k_rel"][:, :a].max()) < 1e-5                      # prefix does not move
    assert float(maps["k_rel"][:, a:b].min()) > 1e-2                     # the field's own keys change
    assert float(maps["k_rel"][0, b:].max()) < 1e-5                      # layer 0 KV depends only on the token
    assert float(maps["k_rel"][1:, b:d].mean()) > 1e-3                  # deeper layers carry it downstream
    assert float(maps["attn_rel"][:, :b].max()) < 1e-5                   # field-only refresh is exact up to b
    summary = summarize_pair(maps, (a, b), d, [0.001, 0.01])
    assert 0 <= summary["k_rel_share"][1] <= summary["k_rel_share"][0] <= 1
