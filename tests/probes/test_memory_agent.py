"""E5, the memory agent over many turns (probes/memory_agent.py): the toggle schedule, the per-turn
rows against the re-prefill of the rewritten prompt, cumulative times, and the record's statistics,
on a tiny random Llama with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvnotes.probes
from kvnotes.probes.memory_agent import drift, toggle_schedule
from kvnotes.scenarios.memory import load_memory
from tests.probes.test_memory import SUITE, check_record_fields, fake_ctx, llama, threads, tok  # noqa: F401

#: KL of a re-prefill against itself (identical forwards): float noise only.
SELF_KL_TOL = 1e-6


def test_schedule_toggles_single_fact_queries():
    suite = load_memory(SUITE, ["maria"])
    persona = suite.personas[0]
    plan = toggle_schedule(suite, persona)
    assert plan and all(orig != other for _, _, orig, other in plan)
    for fid, qid, orig, other in plan:
        q = persona.query(qid)
        assert list(q.uses) == [fid] and {orig, other} <= set(suite.candidates(q))
    assert ("pet", "pet", "cat", "dog") in plan                  # the suite's own edit of that fact
    assert all(fid != "sister_city" for fid, *_ in plan)         # cross-referential: not toggled


def test_sessions_and_long_horizon_on_a_tiny_model(llama, tok):  # noqa: F811
    bundle = SimpleNamespace(model=llama, tokenizer=tok)
    ctx = fake_ctx("memory_agent", bundle, lengths=[96], turns=3, long_turns=5, long_length=96,
                   personas=["maria", "tom"], arms=["in_place", "erratum", "auto"])
    res = kvnotes.probes.get("memory_agent")(ctx)
    check_record_fields("memory_agent", res, ["in_place", "erratum", "auto"])
    assert set(res["aggregates"]) == {"session/96", "long/96"}
    session = [r for r in res["rows"] if r["run"] == "session"]
    long = [r for r in res["rows"] if r["run"] == "long"]
    assert len(session) == 2 * 3 and len(long) == 2 * 5
    for persona in ("maria", "tom"):
        rows = sorted((r for r in long if r["persona"] == persona), key=lambda r: r["turn"])
        plan = toggle_schedule(load_memory(SUITE, [persona]), load_memory(SUITE, [persona]).personas[0])
        # turn t toggles plan[t % n]; a fact's first toggle takes the other value, the next one restores it
        assert [r["fact"] for r in rows] == [plan[t % len(plan)][0] for t in range(5)]
        assert rows[0]["value"] == plan[0][3]
        for arm in ("in_place", "erratum", "auto"):
            cum = [r["arms"][arm]["cum"] for r in rows]
            assert all(b > a for a, b in zip(cum, cum[1:]))          # cumulative time grows
            assert cum[-1] == pytest.approx(sum(r["arms"][arm]["ttft"] for r in rows))
        assert all(r["arms"]["erratum"]["applied"] == "erratum" for r in rows)
    agg = res["aggregates"]["long/96"]["arms"]["in_place"]
    d = agg["drift"]
    assert d["turns"] == [1, 2, 3, 4, 5] and len(d["kl_mean"]) == 5
    assert np.allclose(d["kl_mean"], [np.mean([r["arms"]["in_place"]["kl"] for r in long if r["turn"] == t])
                                      for t in d["turns"]])
    # auto falls back to a re-prefill when it judges the in-place edit insufficient: exact then
    for r in res["rows"]:
        a = r["arms"]["auto"]
        if a["applied"] == "full":
            assert a["kl"] < SELF_KL_TOL and a["top1_agree"]


def test_drift_slope_sees_a_trend():
    rows = [{"turn": t, "owned": True, "arms": {"a": {"kl": 0.1 * t, "top1_agree": t < 3}}} for t in range(1, 6)]
    d = drift(rows, "a")
    assert d["kl_slope"] == pytest.approx(0.1) and d["kl_slope_p"] < 1e-6
    assert d["agreement"] == [1.0, 1.0, 0.0, 0.0, 0.0]
