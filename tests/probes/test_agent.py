"""The edit + compose agent loop (probes/agent.py) and multi-turn rendering on the embedded model."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from kvnotes import CONF_DIR
from kvnotes.probes import ProbeContext
from tests.helpers import check_figures, check_schema

#: fp32 on CPU: with whole chunks recomputed (seam >= chunk length) the agent's composed-then-
#: appended cache is the transcript's full prefill computed in several forwards; measured KL ~1e-9.
EXACT_KL = 1e-5


def scenario_cfg(families=("recall",), ids=("home_city",)):
    sc = OmegaConf.load(os.path.join(CONF_DIR, "scenario", "default.yaml"))
    sc.families, sc.ids, sc.n_instances = list(families), list(ids), 1
    return sc


def run_agent(smol, seam: int, turns: int = 3, **scenario):
    from kvnotes.harness.pairs import prepare_pairs
    from kvnotes.probes.agent import run

    cfg = OmegaConf.load("conf/probe/agent.yaml")
    cfg.progress, cfg.n_boot, cfg.turns, cfg.seam = False, 200, turns, seam
    sc = scenario_cfg(**scenario)
    ctx = ProbeContext(bundle=smol, pairs=prepare_pairs(smol.tokenizer, sc), cfg=cfg, seed=0, scenario_cfg=sc)
    return run(ctx)


def test_conversation_rendering_extends_the_single_turn_prompt(smol):
    from kvnotes.harness.tokens import build_conversation, build_prompt, render_conversation, render_text

    tok = smol.tokenizer
    one, _ = render_text(tok, "Where is it?", "It is in", True, "Be brief.")
    assert render_conversation(tok, ["Where is it?"], [], "It is in", True, "Be brief.")[0] == one
    two, start = render_conversation(tok, ["Where is it?", "Update: moved."], [" Paris"], "It is in", True)
    assert "It is in Paris" in two and two.endswith("It is in") and two.index("Update: moved.") > start
    plain, _ = render_conversation(tok, ["A?", "B?"], [" x"], "Ans:", False)
    assert plain == "A?\nAns: x\nB?\nAns:"
    with pytest.raises(ValueError):
        render_conversation(tok, ["A?", "B?"], [], "Ans:", False)
    p1 = build_prompt(tok, "The city is Lyon.", (12, 16), "It is in")
    p2 = build_conversation(tok, ["The city is Lyon.", "Update."], [" Lyon"], (12, 16), "It is in")
    assert p2.ids[:len(p1.ids)].tolist() == p1.ids.tolist()            # ChatML: a later turn only appends
    assert tok.decode(p2.ids[p2.field[0]:p2.field[1]]).strip() == "Lyon"


def test_trajectory_values_change_every_turn_and_are_seeded(smol):
    from kvnotes.probes.agent import trajectory_values
    from kvnotes.scenarios.instances import draw_instances
    from kvnotes.scenarios.schema import load_suite

    sc = load_suite(list(scenario_cfg().paths), ["recall"], ["home_city"])[0]
    inst = draw_instances(sc, 1, 0)[0]
    vals = trajectory_values(inst, 6, 0)
    assert len(vals) == 6 and all(a != b for a, b in zip(vals, vals[1:])) and set(vals) <= set(sc.values)
    assert trajectory_values(inst, 6, 0) == vals


def test_agent_with_whole_chunks_recomputed_equals_its_transcript(smol):
    """seam >= chunk length recomputes the chunks: the incremental agent must then decide exactly
    like a full prefill of its own conversation, every turn reusing the whole previous one."""
    res = run_agent(smol, seam=10_000)
    check_schema("agent", res)
    rows = res["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and not res["excluded"]
    assert all(r["kl_transcript"] < EXACT_KL and r["agree_transcript"] for r in rows)
    for prev, r in zip(rows, rows[1:]):
        assert r["reused_tokens"] == prev["conversation_tokens"] and r["value"] != prev["value"]
    assert rows[0]["reused_tokens"] == 0 and rows[0]["precompile_ms"] > 0 == rows[1]["precompile_ms"]


def test_agent_record_aggregates(smol, tmp_path):
    res = run_agent(smol, seam=0, families=("recall", "lookup"), ids=("home_city", "driver_depot"))
    check_figures("agent", res, tmp_path)
    rows, agg = res["rows"], res["aggregates"]["by_family"]
    assert {r["family"] for r in rows} == {"recall", "lookup"} and len(rows) == 6
    for r in rows:
        assert r["agent_correct"] == (r["agent_top1"] == r["expected_first_token"])
        assert r["agree_oracle"] == (r["agent_top1"] == r["oracle_top1"]) and r["kl_oracle"] >= 0
    a = agg["all"]["all"]
    assert a["n_turns"] == 6 and a["n_trajectories"] == 2
    assert a["agent_accuracy"]["k"] == sum(r["agent_correct"] for r in rows)
    assert a["agreement_oracle_owned"]["n"] == sum(r["oracle_owned"] for r in rows)
    assert agg["recall"]["turn2+"]["n_turns"] == 2 and agg["lookup"]["turn1"]["n_turns"] == 1
    t = a["time"]
    assert t["ratio_oracle_over_agent"] == pytest.approx(t["oracle_ms_total"] / t["agent_ms_total"])
