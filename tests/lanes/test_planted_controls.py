"""The ground-truth lane for a probe's own controls (issue #53): planted scenarios written apart from
the planted suite (``conf/scenario/planted_varied.yaml``). ``planted_spaced`` varies the distance
between the field and the note between instances (a name of one to three words, fillers of
different lengths); ``planted_mechanisms`` holds a scenario with a note and one without. The probes
must find the planted note with their default settings, rank the planted read heads first from a
map that represents the family, and say so in a verdict when it does not."""

from __future__ import annotations


import pytest

import kvnotes.probes
from tests.lanes.test_planted import _context, _truth, arch, cache  # noqa: F401  (fixtures)

#: the issue's bar: held-out pairs (of 12) whose top note position is the planted note
FOUND = 10


def _note(ctx, pair_id: str) -> int:
    pair = next(p for p in ctx.pairs.pairs if p.spec.id == pair_id)
    return ctx.bundle.tokenizer.convert_ids_to_tokens(pair.old.ids.tolist()).index("note")


def _spaced(cache, monkeypatch, probe: str, arch: str, overrides: dict | None = None):  # noqa: F811
    ctx = _context(cache, monkeypatch, "mixed", probe, {"planted": {"alpha": 0.3}}, overrides, ["spaced"],
                   n_instances=4, arch=arch, suite="planted_varied")
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    held = [r for r in res["rows"] if r["split"] == "heldout"]
    distances = {_note(ctx, r["pair"]) - r["field"][1] for r in res["rows"]}     # selection and held-out
    return ctx, res, held, distances


def test_suffix_recovery_carries_the_note_by_alignment_across_distances(arch, cache, monkeypatch):  # noqa: F811
    """The default anchor (``aligned``) puts the held-out top-1 on the planted note although the
    note's distance from the field and from the decision differs between instances; an offset
    anchor, on the same pairs, does not (the case the alignment exists for)."""
    def found(overrides=None):
        cheap = {"with_field": False, "random": {"n_draws": 1}, "layer_bands": 1}
        ctx, res, held, distances = _spaced(cache, monkeypatch, "suffix_recovery", arch, cheap | (overrides or {}))
        k1 = res["grid"].index({"kind": "count", "value": 1})
        return sum(r["topk_sets"][k1] == [_note(ctx, r["pair"])] for r in held), len(held), distances

    hit, n, distances = found()
    assert n == 12 and len(distances) > 1
    assert hit >= FOUND
    if arch == "llama":                              # the failure it fixes (the same on Gemma-3; one is enough)
        assert found({"topk_anchor": "field_end"})[0] < FOUND


def test_components_places_the_note_by_alignment_across_distances(arch, cache, monkeypatch):  # noqa: F811
    ctx, _, held, distances = _spaced(cache, monkeypatch, "components", arch)
    assert len(held) == 12 and len(distances) > 1
    assert sum(r["note_position"] == _note(ctx, r["pair"]) for r in held) >= FOUND


def _heads(cache, monkeypatch, arch, cap: int, seed: int):  # noqa: F811
    ctx = _context(cache, monkeypatch, "mixed", "heads", {"planted": {"alpha": 0.3}},
                   {"max_map_pairs_per_family": cap, "modes": ["read"]}, ["with_notes", "without_notes"],
                   n_instances=4, arch=arch, suite="planted_varied", seed=seed)
    return ctx, kvnotes.probes.get(ctx.cfg)(ctx)


def test_heads_maps_both_mechanisms_and_a_one_scenario_map_is_not_supported(arch, cache, monkeypatch):  # noqa: F811
    """With the default cap the map pairs are stratified over the family's scenarios: the planted
    read heads rank first. A cap of one pair maps one scenario; drawn from the scenario without
    notes (seed 3; on Llama, the Gemma-3 case being the same) the notes read head falls behind heads that read nothing, and the record says
    so: a warning, and no ``supported`` verdict, naming the scenarios that disagree."""
    ctx, res = _heads(cache, monkeypatch, arch, 2, 0)
    truth = _truth(ctx)
    read = [list(h) for h in truth["read_heads"]["notes"] + truth["read_heads"]["field"]]
    rank = res["aggregates"]["rankings"]["read"]["planted_mechanisms"]
    assert sorted(rank["top"][:2]) == sorted(read)
    assert {p.split("/")[0] for p in rank["pairs"]} == {"with_notes", "without_notes"}
    assert res["aggregates"]["map_coverage"]["planted_mechanisms"]["represents"]
    if arch != "llama":                              # the failure case once (it is the same on Gemma-3)
        return

    ctx, res = _heads(cache, monkeypatch, arch, 1, 3)
    rank = res["aggregates"]["rankings"]["read"]["planted_mechanisms"]
    assert [p.split("/")[0] for p in rank["pairs"]] == ["without_notes"]
    assert rank["top"].index(read[0]) > 1                                    # the notes read head is not in the top 2
    assert any("comes from 1 of its 2 scenarios" in w for w in res["warnings"])
    cell = res["aggregates"]["verdicts"]["read"]["by_family"]["planted_mechanisms"]
    assert cell["verdict"] != "supported"
    assert sorted(cell["disagree"]) == ["with_notes", "without_notes"] and "scenarios disagree" in cell["reason"]
    with_notes = cell["scenarios"]["with_notes"]["selected"]["mean"]
    without = cell["scenarios"]["without_notes"]["selected"]["mean"]
    assert with_notes < without - 0.1                                        # the ranking fits one scenario only


def test_field_refresh_follows_the_construction_at_every_field_placement(arch, cache, monkeypatch):  # noqa: F811
    """``scenario.field_placement`` moves the field's line after the filler or just before the
    request (the paper's dose-response, issue #52); the planted decision reads the field with weight
    ``alpha`` wherever it sits, and the notes the rest."""
    starts = set()
    for placement in ("first", "after_filler", "before_request"):
        ctx = _context(cache, monkeypatch, "mixed", "field_refresh", {"planted": {"alpha": 0.3}}, n_instances=1,
                       scenario_ids=["adjacent"], arch=arch)
        ctx.scenario_cfg.field_placement = placement
        from kvnotes.harness.pairs import prepare_pairs
        ctx.pairs = prepare_pairs(ctx.bundle.tokenizer, ctx.scenario_cfg)
        assert {p.spec.instance.placement for p in ctx.pairs.pairs} == {placement}
        starts.add(ctx.pairs.pairs[0].field[0])
        res = kvnotes.probes.get(ctx.cfg)(ctx)
        assert res["aggregates"]["n_flip"] == len(ctx.pairs.pairs) > 0
        assert max(abs(r["r_field"] - 0.3) for r in res["rows"]) < 2e-3
        assert max(abs(r["r_downstream"] - 0.7) for r in res["rows"]) < 2e-3
    assert len(starts) == 3                                                   # the field moved each time


def test_erratum_wording_cannot_matter_where_only_the_value_is_read(arch, cache, monkeypatch):  # noqa: F811
    """``probe.erratum_wordings`` runs the registry's erratum with each wording (issue #52). The planted
    model reads role words only (every other word is ``<unk>``), so every wording is the new value
    plus words it cannot read: each recovers the construction's ``alpha / 2`` (the field read head
    splits its attention between the stale field and the erratum's value; the notes are never
    re-read), and none takes the decision at ``alpha`` 0.3."""
    from kvnotes.context import ERRATUM_WORDINGS

    ctx = _context(cache, monkeypatch, "mixed", "edit", {"planted": {"alpha": 0.3}},
                   {"erratum_wordings": list(ERRATUM_WORDINGS), "ks": [], "rankings": [], "oracle_ranking": None,
                    "max_control_pairs": 0, "sweep_max_pairs": 0}, ["adjacent"], n_instances=1, arch=arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    got = res["aggregates"]["wordings"]
    assert list(got) == list(ERRATUM_WORDINGS) and res["rows"]
    for wording, m in got.items():
        rec = m["recovery"]["all"]
        assert rec["n"] == len(res["rows"]) and rec["mean"] == pytest.approx(0.15, abs=2e-3), wording
        assert rec["decision_flipped"]["k"] == 0
    assert all(abs(r["wordings"][w]["r"] - 0.15) < 2e-3 for r in res["rows"] for w in ERRATUM_WORDINGS)
