"""The ground-truth lane (issue #36): the probes' conclusions scored against planted-mechanism
models whose notes, heads and field share are known by construction (:mod:`kvnotes.models.planted`).
Each model is loaded through the model configs (``conf/model/planted-*.yaml``) and runs its suite
(``conf/scenario/planted.yaml``); each probe is held to the bar the issue sets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import kvnotes.probes
from kvnotes.harness.pairs import prepare_pairs
from kvnotes.models import planted, zoo
from kvnotes.models.loading import load_model

#: recovery units: the issue's bar for a probe's estimate of a planted share
BAR = 0.05
#: recovery units: how close the construction itself is to linear (RMSNorm over a dominant constant)
EXACT = 2e-3
CONF = kvnotes.probes.CONF_DIR.parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvnotes-cache")


def _context(cache, monkeypatch, family: str, probe: str, model_overrides: dict | None = None,
             probe_overrides: dict | None = None, scenario_ids: list[str] | None = None, n_instances: int = 2):
    """A probe context on planted model ``family`` and the planted suite (``n_instances`` per scenario)."""
    monkeypatch.setenv("KVNOTES_CACHE", str(cache))
    bundle = load_model(OmegaConf.merge(zoo.zoo_config(f"planted-{family}"), model_overrides or {}), "cpu")
    scen = OmegaConf.merge(OmegaConf.load(CONF / "scenario" / "default.yaml"),
                           OmegaConf.load(CONF / "scenario" / "planted.yaml"),
                           {"n_instances": n_instances, "ids": scenario_ids, "paths": [str(CONF.parent / "scenarios" / "planted")]})
    scen.pop("defaults", None)
    cfg = kvnotes.probes.load_config(probe, {"progress": False, "n_boot": 100} | (probe_overrides or {}))
    return kvnotes.probes.ProbeContext(bundle=bundle, pairs=prepare_pairs(bundle.tokenizer, scen), cfg=cfg, scenario_cfg=scen)


def _truth(ctx) -> dict:
    return getattr(ctx.bundle.model.config, planted.TRUTH_KEY)


def test_the_checkpoint_carries_its_truth(cache, monkeypatch):
    ctx = _context(cache, monkeypatch, "distributed", "field_refresh")
    truth = _truth(ctx)
    assert truth["family"] == "distributed" and truth["notes"]["weights"] == pytest.approx([0.5, 0.3, 0.2])
    on_disk = json.loads(next((cache / "planted").glob("distributed-*/config.json")).read_text())[planted.TRUTH_KEY]
    assert on_disk == json.loads(json.dumps(truth))
    assert ctx.bundle.info["source"] == "planted"
    with pytest.raises(Exception, match="model.planted.family"):
        planted.PlantedSpec.of({"family": "nope"})
    with pytest.raises(Exception, match=r"model.planted.alpha: must be in \[0, 1\]"):
        planted.PlantedSpec.of({"family": "mixed", "alpha": 2})
    with pytest.raises(Exception, match="model.planted.weights"):
        planted.PlantedSpec.of({"family": "distributed", "weights": [0, 1]})


def test_the_architecture_block_is_the_construction():
    """``conf/model/_planted.yaml``'s architecture block (the zoo lane builds from it) is the
    construction's own config."""
    built = planted.build(planted.PlantedSpec())[0].config
    data = zoo.architecture_config(zoo.zoo_config("planted-notes"))
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "intermediate_size", "tie_word_embeddings", "rms_norm_eps")
    assert {k: getattr(data, k) for k in keys} == {k: getattr(built, k) for k in keys}
    assert data.rope_parameters["rope_theta"] == built.rope_parameters["rope_theta"] == planted.ROPE_THETA


@pytest.mark.parametrize("family,alpha", [("notes", 0.0), ("mixed", 0.1), ("mixed", 0.5), ("mixed", 0.9),
                                          ("direct", 1.0)])
def test_field_refresh_recovers_the_planted_field_share(cache, monkeypatch, family, alpha):
    ctx = _context(cache, monkeypatch, family, "field_refresh", {"planted": {"alpha": alpha}}, n_instances=1)
    assert _truth(ctx)["alpha"] == alpha
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    rec = res["aggregates"]["recovery"]
    assert res["aggregates"]["n_flip"] == len(ctx.pairs.pairs) > 0
    assert rec["field"]["all"]["mean"] == pytest.approx(alpha, abs=BAR)
    assert rec["downstream"]["all"]["mean"] == pytest.approx(1 - alpha, abs=BAR)
    assert max(abs(r["r_field"] - alpha) for r in res["rows"]) < EXACT         # every pair, not only the mean


def _marker_positions(ctx, pair) -> dict[str, int]:
    tok = ctx.bundle.tokenizer
    words = tok.convert_ids_to_tokens(pair.old.ids.tolist())
    return {w: i for i, w in enumerate(words) if w in planted.MARKERS}


@pytest.mark.parametrize("family", ["distributed", "delimiter"])
def test_suffix_recovery_finds_the_planted_notes(cache, monkeypatch, family):
    """The top-1 held-out position is a planted note position on every pair, and the single-position
    map follows the planted weights (delimiter: the marker several tokens after the field, not the
    token after it). Positions transfer by their offset from the field's end: the planted scenarios'
    filler sentences differ in length between instances, so an offset from the decision does not
    name the same token in two instances (the default anchor, ``decision``, is for suites whose
    tail is shared text)."""
    ctx = _context(cache, monkeypatch, family, "suffix_recovery", probe_overrides={"topk_anchor": "field_end"},
                   scenario_ids=["delimited"] if family == "delimiter" else None)
    truth = _truth(ctx)
    weights = dict(zip(truth["notes"]["tokens"], truth["notes"]["weights"]))
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    by_id = {p.spec.id: p for p in ctx.pairs.pairs}
    held = [r for r in res["rows"] if r["split"] == "heldout" and r.get("topk_sets")]
    assert held
    for row in res["rows"]:
        pair = by_id[row["pair"]]
        markers = _marker_positions(ctx, pair)
        b, _ = row["downstream"]
        single = np.asarray(row["single"])
        for word, w in weights.items():
            assert single[markers[word] - b] == pytest.approx((1 - truth["alpha"]) * w, abs=BAR)
        others = [v for i, v in enumerate(single) if b + i not in {markers[m] for m in weights}]
        assert max(others) < BAR
        if row in held:
            assert row["topk_sets"][res["grid"].index({"kind": "count", "value": 1})] == [markers["note"]]
    if family == "delimiter":
        assert all(_marker_positions(ctx, by_id[r["pair"]])["note"] > r["field"][1] + 3 for r in res["rows"])


def test_heads_ranks_the_planted_read_and_write_heads_first(cache, monkeypatch):
    """Mixed family (alpha 0.3): the notes read head (1, 0) ranks first, the field read head (1, 1)
    second; the write head (0, 0) leads the write side; on the delimiter family the distractor
    (1, 2), which reads the field and writes nothing used, ranks below every head the decision uses."""
    ctx = _context(cache, monkeypatch, "mixed", "heads", {"planted": {"alpha": 0.3}})
    ranks = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["rankings"]
    truth = _truth(ctx)
    assert ranks["read"]["planted"]["top"][:2] == truth["read_heads"]["notes"] + truth["read_heads"]["field"]
    assert ranks["write"]["planted"]["top"][:1] == truth["write_heads"]
    ctx = _context(cache, monkeypatch, "delimiter", "heads")
    ranks = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["rankings"]["read"]["planted"]["top"]
    truth = _truth(ctx)
    used = truth["read_heads"]["notes"]                               # alpha 0: the field read head writes nothing
    assert ranks[0] == used[0] and ranks.index(truth["distractor_heads"][0]) > ranks.index(used[0])


@pytest.mark.parametrize("family,follows", [("notes", 1.0), ("direct", 0.0)])
def test_injection_follows_the_planted_source(cache, monkeypatch, family, follows):
    ctx = _context(cache, monkeypatch, family, "injection", n_instances=1)
    flipping = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["flipping"]["all"]
    for cell in flipping.values():
        assert cell["follow_notes"]["p"] == follows


def test_direction_is_found_where_the_notes_are_written(cache, monkeypatch):
    """Notes family: the layer chosen on the selection split is the write layer's output (layer 0,
    after which the markers hold the notes), and adding the held-out pairs' difference along the
    direction there recovers the decision (sufficiency 1 by construction)."""
    ctx = _context(cache, monkeypatch, "notes", "direction")
    agg = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]
    assert agg["chosen_layers"]["planted"]["layer"] == _truth(ctx)["write_heads"][0][0]
    assert agg["at_chosen"]["suff"]["direction"]["all"]["mean"] == pytest.approx(1.0, abs=BAR)


@pytest.mark.parametrize("family,alpha", [("notes", 0.0), ("mixed", 0.3), ("direct", 1.0)])
def test_read_location_knockouts_move_the_planted_shares(cache, monkeypatch, family, alpha):
    """Hiding a key group from the decision query in every layer removes exactly what the model reads
    there: the downstream notes carry ``(1 - alpha) * beta`` nats of each clean score, the field
    ``alpha * beta`` (the score moves that far towards the other run's), the sinks nothing."""
    ctx = _context(cache, monkeypatch, family, "read_location", {"planted": {"alpha": alpha}}, n_instances=1)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    beta = _truth(ctx)["beta"]
    every = next(b["name"] for b in res["bands"] if b["layers"] == [0, planted.N_LAYERS])
    share = {"downstream": 1 - alpha, "field": alpha, "sinks": 0.0}
    for run, cells in res["aggregates"]["knockout"]["flipping"]["all"].items():
        for group, part in share.items():
            moved = cells[f"{group}@{every}"]["delta_toward_other"]["mean"]
            assert moved == pytest.approx(part * beta, abs=BAR * 2 * beta), (run, group)


@pytest.mark.parametrize("family,alpha", [("notes", 0.0), ("mixed", 0.3), ("mixed", 0.7), ("direct", 1.0)])
def test_edit_refresh_fails_where_the_notes_decide_and_selective_recompute_recovers(cache, monkeypatch, family,
                                                                                     alpha):
    """The in-place field refresh moves exactly the share the model reads from the field (recovery
    ``alpha``) and so decides like the full re-prefill exactly where ``alpha > 0.5``; recomputing
    one downstream position, ranked by attention or by first-layer K/V deviation, recomputes the
    planted note and recovers the decision. The erratum (the new value restated before the request)
    recovers ``alpha / 2``: the direct read head splits its attention between the two field tokens
    and the notes keep the old value."""
    ctx = _context(cache, monkeypatch, family, "edit", {"planted": {"alpha": alpha}},
                   {"ks": [0, 1], "rankings": ["attention", "kv_deviation"], "oracle_ranking": None,
                    "max_control_pairs": 0, "sweep_max_pairs": None}, n_instances=1)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    assert res["rows"] and _truth(ctx)["notes"]["weights"] == [1.0]          # one note position
    for r in res["rows"]:
        m = r["methods"]
        assert m["refresh_field"]["r"] == pytest.approx(alpha, abs=EXACT) and m["refresh_field"]["agree"] == (alpha > 0.5)
        assert m["erratum"]["r"] == pytest.approx(alpha / 2, abs=EXACT)
        for ranking in ("attention", "kv_deviation"):
            assert r["sweep"][f"selective_{ranking}@0"]["r"] == pytest.approx(alpha, abs=EXACT)
            assert r["sweep"][f"selective_{ranking}@1"]["r"] == pytest.approx(1.0, abs=EXACT)


def test_direction_is_the_planted_value_direction(cache, monkeypatch):
    """The difference-of-means direction fitted at the write layer's output has cosine at least 0.95
    with the planted one (``note_<new> - note_<old>`` in the residual stream), for every held-out
    pair it is fitted for (the fits are read as the probe makes them)."""
    import kvnotes.circuits.direction as direction

    fits = []
    real = direction.fit_direction

    def spy(stats, row, outs, scope="all"):
        fit = real(stats, row, outs, scope)
        fits.append((outs, fit))
        return fit

    monkeypatch.setattr(direction, "fit_direction", spy)
    ctx = _context(cache, monkeypatch, "notes", "direction")
    agg = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]
    truth = _truth(ctx)
    li = agg["layers"].index(truth["write_heads"][0][0])
    assert fits and all(f is not None for _, f in fits)
    for (old, new), fit in fits:
        want = torch.zeros(planted.HIDDEN)
        want[truth["dims"][f"note_{new}"]], want[truth["dims"][f"note_{old}"]] = 1.0, -1.0
        assert float(fit.u[li] @ (want / want.norm())) >= 0.95, (old, new, float(fit.u[li] @ (want / want.norm())))
