"""``write_timing`` (docs/probes/write_timing.md): the depths on the planted constructions, where the
write layer and the read layer are known, on both architectures; and the commit rule."""

from __future__ import annotations

import pytest

import kvnotes.probes
from kvnotes.probes.write_timing import commit_depth
from tests.helpers import check_schema
from tests.planted import planted_context, planted_truth

#: nats: the lens at the last layer and the decision is the model's own readout (fp32 rounding)
READOUT = 1e-4


def test_commit_is_the_first_layer_that_keeps_the_sign():
    assert commit_depth([0.0, 1.0, 2.0], 1.0) == 1                  # exactly 0 has no sign
    assert commit_depth([1.0, -1.0, 2.0], 1.0) == 2                 # a later reversal resets it
    assert commit_depth([-1.0, -2.0], -1.0) == 0
    assert commit_depth([1.0, -1.0], 1.0) is None                   # never: the last layer disagrees
    assert commit_depth([1e-8, 1e-8], 1.0, margin=0.01) is None     # a leak has no sign


@pytest.mark.planted("write_timing")
def test_planted_write_and_commit_depths(planted_arch, planted_cache, monkeypatch):
    """The write head writes the note at layer 0, the read heads read it at layer 1: write depth 0
    (probe at the note), commit depth 1 (lens at the decision), and the lens at the note never
    commits (the unembedding reads only the output directions). The top note position is the
    planted marker. The probe at the decision may decode at layer 0 (Llama): the decision's layer-0
    attention is not one-hot, and per-feature standardisation lifts that trace of the value into a
    feature where nothing else varies (docs/probes/write_timing.md)."""
    ctx = planted_context(planted_cache, monkeypatch, "notes", "write_timing", {}, {"max_pairs": 8}, n_instances=2,
                          arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    agg = res["aggregates"]
    assert agg["cv_groups"] == "scenario" and agg["n_groups"] >= 2 and agg["n_pairs"] >= 6
    assert agg["write_depth"] == 0
    assert agg["commit_depth"]["mean"] == 1.0 and agg["depths"]["decision"]["lens"]["n_never"] == 0
    assert agg["depths"]["decision"]["probe"]["depth"] in (0, 1)
    assert agg["depths"]["note"]["lens"]["n_never"] == agg["n_prompts"]
    assert agg["checks"]["max_abs_lens_final_minus_score"] < READOUT
    tok = ctx.bundle.tokenizer
    pairs = {p.spec.id: p for p in ctx.pairs.pairs}
    markers = set(planted_truth(ctx)["notes"]["tokens"])
    assert all(tok.convert_ids_to_tokens(int(pairs[r["pair"]].old.ids[r["note_position"]])) in markers
               for r in res["rows"])
    if planted_arch == "llama":
        check_schema("write_timing", res)


@pytest.mark.embedded
def test_write_timing_on_the_embedded_model(smol):
    """On SmolLM2 the record is complete and self-consistent: the lens at the last layer equals the
    clean score, every depth lies within the layers; grouped by instance the probe scores every
    prompt whose candidate another instance decides (the two scenarios have their own candidates: by
    scenario none could be decoded), and says how many it left out."""
    from tests.helpers import recall_pairs

    ctx = kvnotes.probes.ProbeContext(bundle=smol, pairs=recall_pairs(smol, ["favourite_colour", "home_city"]),
                                      cfg=kvnotes.probes.load_config("write_timing", {"progress": False, "n_boot": 100,
                                                                                       "max_pairs": 6, "cv_groups": "instance"}))
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    agg = res["aggregates"]
    n_layers = smol.model.config.num_hidden_layers
    assert agg["checks"]["max_abs_lens_final_minus_score"] < READOUT
    assert len(agg["timing"]["note"]["probe accuracy"]) == n_layers and agg["cv_groups"] == "instance"
    unseen = agg["depths"]["decision"]["probe"]["n_unseen_label"]
    assert unseen < agg["n_prompts"] and res["warnings"] == [w for w in res["warnings"] if "no other instance" in w]
    assert agg["timing"]["decision"]["probe accuracy"][n_layers - 1]["n"] == agg["n_prompts"] - unseen
    for r in res["rows"]:
        assert r["field"][1] <= r["note_position"] < r["decision"]
        assert all(c is None or 0 <= c < n_layers for c in (r["commit_decision_old"], r["commit_decision_new"]))
    check_schema("write_timing", res)
