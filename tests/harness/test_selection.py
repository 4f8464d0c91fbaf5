"""Selection that represents its family and positions carried by alignment (issue #53): the
stratified map draw, its coverage, token alignment of downstream spans, and verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from kvnotes.harness import stats
from kvnotes.harness.kit import verdicts
from kvnotes.harness.selection import (align_positions, coverage, coverage_warnings, offset_profiles, position_values,
                                       rank_positions, sample_pairs)
from kvnotes.records.tables import verdict_summary, verdicts_table


def _rows(scenarios=("a", "b", "c"), instances=3, pairs=6, family="f"):
    return [{"pair": f"{s}/{i}:{p}", "scenario": s, "instance": f"{s}/{i}", "family": family}
            for s in scenarios for i in range(instances) for p in range(pairs)]


@pytest.mark.parametrize("seed", range(5))
def test_a_cap_covers_scenarios_then_instances_never_one_instance_first(seed):
    rows = _rows()
    for cap in (1, 2, 3, 5, 9):
        got = sample_pairs(rows, cap, seed)
        assert len(got) == cap
        by = [p.split(":")[0] for p in got]
        assert len({b.split("/")[0] for b in by}) == min(cap, 3)              # scenarios first
        assert len(set(by)) == min(cap, 9)                                     # then a new instance each turn
    assert sample_pairs(rows, None, seed) == {r["pair"] for r in rows}
    assert sample_pairs(rows, 4, seed) == sample_pairs(rows, 4, seed)
    # groups are capped apart
    two = rows + _rows(family="g")
    got = sample_pairs(two, 2, seed, by=("family",))
    assert len(got) == 4


def test_coverage_says_when_a_subset_does_not_represent_its_family():
    rows = _rows(scenarios=("a", "b"))
    one_scenario = {r["pair"] for r in rows if r["instance"] in ("a/0", "a/1")}
    one_instance = {r["pair"] for r in rows if r["instance"] == "a/0"}
    good = {"a/0:0", "b/1:3"}
    cov = coverage(rows, one_scenario)["f"]
    assert cov == {"n_scenarios": 2, "n_scenarios_used": 1, "n_instances_used": 2, "represents": False}
    assert coverage(rows, good)["f"]["represents"]
    assert coverage_warnings("p", coverage(rows, good), "ranking") == []
    [line] = coverage_warnings("p", coverage(rows, one_scenario), "ranking")
    assert "from 1 of its 2 scenarios" in line
    solo = [r for r in rows if r["scenario"] == "a"]
    [line] = coverage_warnings("p", coverage(solo, one_instance), "ranking")
    assert "single selection instance" in line
    by_scenario = coverage(rows, one_instance | {"b/0:0"}, ("scenario",))
    assert [c["represents"] for c in by_scenario.values()] == [False, False]
    [line] = coverage_warnings("p", by_scenario, "ranking")                 # one line for every such group
    assert line.startswith("p: the ranking of a, b comes from a single selection instance each")


def test_alignment_carries_a_position_past_a_filler_of_another_length():
    # selection downstream: 5 6 N 7 8 9 D ; held-out: 5 5 6 N 7 8 8 9 D (one token more before and after the note)
    N = 99
    sel, held = [5, 6, N, 7, 8, 9, 1], [5, 5, 6, N, 7, 8, 8, 9, 1]
    pairs = align_positions(sel, held)
    assert all(sel[i] == held[j] for i, j in pairs)
    assert (2, 3) in pairs and (6, 8) in pairs                                  # the note and the decision's neighbour
    assert [i for i, _ in pairs] == sorted(i for i, _ in pairs) and [j for _, j in pairs] == sorted(j for _, j in pairs)
    single = [0.0, 0.0, 0.9, 0.0, 0.0, 0.05, 0.05]
    row = {"pair": "s/0:0", "scenario": "s", "family": "f", "single": single, "downstream": [10, 17],
           "downstream_ids": sel}
    prof = offset_profiles([row], "aligned")
    assert prof["anchor"] == "aligned"
    p = prof["scenario"]["s"]
    vals = position_values(p, (20, 29), "aligned", held)
    assert vals[3] == pytest.approx(0.9) and np.isnan(vals).sum() == len(held) - len(pairs)
    assert rank_positions(p, (20, 29), "aligned", held)[0] == 23
    # an offset carries it to the wrong token
    offs = offset_profiles([row], "decision")["scenario"]["s"]
    assert rank_positions(offs, (20, 29), "decision")[0] != 23
    with pytest.raises(ValueError, match="downstream token ids"):
        position_values(p, (20, 29), "aligned")
    with pytest.raises(ValueError, match="topk_anchor"):
        offset_profiles([row], "middle")


def test_verdicts_need_an_interval_above_zero_and_scenarios_that_agree():
    assert stats.verdict_of({"ci_mean": [0.1, 0.3]}) == stats.SUPPORTED
    assert stats.verdict_of({"ci_mean": [-0.3, -0.1]}) == stats.CONTRADICTED
    assert stats.verdict_of({"ci_mean": [-0.1, 0.3]}) == stats.INCONCLUSIVE
    assert stats.verdict_of({"ci_mean": None, "mean": 0.9}) == stats.INCONCLUSIVE     # one instance supports nothing
    def s(lo, hi):
        return {"ci_mean": [lo, hi], "mean": (lo + hi) / 2}

    assert stats.disagreeing({"a": s(0.8, 0.9), "b": s(0.1, 0.3)}) == ["a", "b"]
    assert stats.disagreeing({"a": s(0.2, 0.9), "b": s(0.1, 0.3)}) is None
    assert stats.disagreeing({"a": s(0.8, 0.9), "b": {"ci_mean": None, "mean": 0.1}}) is None
    assert stats.disagreeing({"a": s(0.96, 0.98), "b": s(0.89, 0.91)}) is None           # apart, but by < 0.1
    assert stats.disagreeing({"a": s(0.96, 0.98), "b": s(0.89, 0.91)}, margin=0.05) == ["a", "b"]

    def rows(sel_by_scenario, control=0.1, jitter=0.01):
        out = []
        for s, v in sel_by_scenario.items():
            for i in range(3):
                out += [{"scenario": s, "instance": f"{s}/{i}", "family": "f", "s": v + jitter * i, "c": control}]
        return out

    agree = verdicts(rows({"a": 0.9, "b": 0.88}), "s", "c", ["f"], "claim", 200, 0)
    cell = agree["by_family"]["f"]
    assert cell["verdict"] == "supported" and cell["disagree"] is None
    assert cell["difference"]["mean"] == pytest.approx(np.mean([0.9, 0.91, 0.92, 0.88, 0.89, 0.90]) - 0.1)
    assert set(cell["scenarios"]) == {"a", "b"}
    mixed = verdicts(rows({"a": 0.9, "b": 0.3}), "s", "c", ["f"], "claim", 200, 0)["by_family"]["f"]
    assert mixed["verdict"] == "inconclusive" and mixed["disagree"] == ["a", "b"] and "disagree" in mixed["reason"]
    worse = verdicts(rows({"a": 0.0, "b": 0.02}, control=0.5), "s", "c", ["f"], "claim", 200, 0)["by_family"]["f"]
    assert worse["verdict"] == "contradicted"
    none = verdicts([], "s", "c", ["f"], "claim", 200, 0)["by_family"]["f"]
    assert none["verdict"] == "inconclusive" and none["reason"] == "no held-out pairs"
    rec = {"result": {"aggregates": {"verdicts": {"v": agree, "w": {"claim": "x", "by_family": {"all": none}}}}}}
    text = verdicts_table(rec)
    assert "**Verdict `v`**: claim." in text and "| **f** | supported |" in text and "no held-out pairs" in text
    assert verdict_summary(rec) == "v: supported; w: inconclusive"
    assert verdicts_table({"result": {"aggregates": {}}}) == "" and verdict_summary({"result": {}}) == ""


def test_a_family_mean_carries_its_scenarios_and_flags_them_when_they_disagree():
    from kvnotes.harness.kit import summaries_by_family
    from kvnotes.records.tables import aggregates_table, ci

    rows = [{"scenario": s, "instance": f"{s}/{i}", "family": "f", "r": v + 0.01 * i, "fl": True}
            for s, v in (("notes", 0.9), ("no_notes", 0.2)) for i in range(3)]
    rows += [{"scenario": "solo", "instance": f"solo/{i}", "family": "g", "r": 0.5, "fl": False} for i in range(2)]
    got = summaries_by_family(rows, "r", "fl", ["f", "g"], 200, 0)
    f = got["f"]
    assert f["mean"] == pytest.approx(np.mean([r["r"] for r in rows if r["family"] == "f"]))
    assert f["by_scenario"]["notes"]["mean"] == pytest.approx(0.91) and f["by_scenario"]["no_notes"]["n"] == 3
    assert f["disagree"] == ["notes", "no_notes"]
    assert "⚠ scenarios disagree: notes 0.91 vs no_notes 0.21" in ci(f)
    assert "by_scenario" not in got["g"] and "by_scenario" not in got["all"]       # one scenario: nothing to break down
    assert "⚠" not in ci(got["g"])
    table = aggregates_table({"result": {"aggregates": {"x": got}}, "config": {"flip_rule": "owned"}})
    assert "| &nbsp;&nbsp;x/f · notes | 0.91 [" in table and "x/f · no_notes |" in table
