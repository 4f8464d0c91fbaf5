"""Held-out splits never share instances; recovery summaries carry n and the flip share."""

from __future__ import annotations

from kvnotes.probing import recovery_summary, split_instances


def rows(n_scen=5, n_inst=4, n_pair=3):
    return [{"scenario": f"s{s}", "instance": f"s{s}/{i}", "r": 0.1 * i, "f": i % 2 == 0}
            for s in range(n_scen) for i in range(n_inst) for _ in range(n_pair)]


def test_split_is_disjoint_per_scenario_and_seeded():
    rs = rows()
    sel, held = split_instances(rs, 0.5, seed=0)
    assert not sel & held and sel | held == {r["instance"] for r in rs}
    for s in range(5):
        assert sum(i.startswith(f"s{s}/") for i in sel) == 2
    assert split_instances(rs, 0.5, seed=0) == (sel, held)
    assert split_instances(rs, 0.5, seed=1) != (sel, held)


def test_single_instance_scenarios_are_held_out():
    sel, held = split_instances(rows(n_scen=2, n_inst=1), 0.5)
    assert not sel and len(held) == 2


def test_recovery_summary():
    out = recovery_summary(rows(), "r", "f")
    assert out["n"] == 60 and out["n_scenarios"] == 5
    assert out["decision_flipped"]["k"] == 30 and out["ci_mean"][0] <= out["mean"] <= out["ci_mean"][1]
