"""Held-out splits never share instances; recovery summaries carry n and the flip share."""

from __future__ import annotations

import pytest

from kvnotes.harness.kit import recovery_summary
from kvnotes.harness.selection import split_instances
from kvnotes.harness.readout import Decision, pair_status


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


def _dec(top1, expected):
    return Decision(top1=top1, p_top1=0.4, expected=expected, cand_mass=0.5)


def test_flip_rules_owned_and_relative():
    owned = (_dec(7, 7), _dec(9, 9))
    not_owned = (_dec(3, 7), _dec(9, 9))            # the old run's top-1 is a distractor
    st = pair_status(-2.0, 1.5, 1.0, "owned", owned)
    assert st["flips"] and st["flips_owned"] and st["flips_relative"] and st["reason"] is None and st["owned"]
    st = pair_status(-2.0, 1.5, 1.0, "owned", not_owned)
    assert not st["flips"] and st["flips_relative"] and st["flips_owned"] is False and st["reason"] == "not_owned"
    assert st["top1_id_old"] == 3 and st["owns_old"] is False and st["owns_new"] is True
    st = pair_status(-2.0, 1.5, 1.0, "relative", not_owned)
    assert st["flips"] and st["reason"] is None and st["flips_owned"] is False
    # the margin still applies under both rules; a sign change is still needed
    assert pair_status(-0.2, 0.3, 1.0, "owned", owned)["reason"] == "small_effect"
    assert pair_status(1.0, 3.0, 1.0, "owned", owned)["reason"] == "no_decision_change"
    with pytest.raises(ValueError):
        pair_status(-2.0, 1.5, 1.0, "owned", None)
    with pytest.raises(ValueError):
        pair_status(-2.0, 1.5, 1.0, "bogus", owned)
