"""``screen`` (docs/probes/screen.md): on the planted constructions every aligned pair flips under both
rules, and on Gemma-3-270M the screen of a short recall scenario and of one longer than its 512-token
sliding window counts flips and ownership by its rules."""

from __future__ import annotations

import pytest

import kvnotes.probes
from tests.planted import SCALE, planted_context, planted_truth
from tests.recall import GEMMA_WINDOW


@pytest.mark.planted("screen")
def test_screen_finds_every_planted_pair_flipping_and_owned(planted_arch, planted_cache, monkeypatch):
    """Every aligned pair of the planted suite flips under both rules: the clean scores are about
    +-beta and each clean run's top-1 token is its own value (the model owns the decision)."""
    ctx = planted_context(planted_cache, monkeypatch, "mixed", "screen", n_instances=1, arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    beta = planted_truth(ctx)["beta"]
    assert res["rows"] and all(r["flips_relative"] and r["flips_owned"] for r in res["rows"])
    assert all(abs(r["s_new"] - beta) < SCALE * beta and abs(r["s_old"] + beta) < SCALE * beta for r in res["rows"])


@pytest.mark.embedded
def test_screen(gemma, gemma_screened, gemma_pairs):
    rows, agg = gemma_screened["rows"], gemma_screened["aggregates"]
    assert len(rows) == len(gemma_pairs.pairs) == 4                # 3 value pairs (short) + 1 (long)
    by = agg["by_scenario"]
    assert set(by) == {"favourite_colour", "favourite_colour_long"}
    first = gemma.tokenizer.convert_ids_to_tokens
    for r in rows:
        assert r["expect_flip"] and r["flips"] == (r["reason"] is None)
        own = r["top1_old"] == first(r["cand_old"][0]) and r["top1_new"] == first(r["cand_new"][0])
        assert r["owned"] == own and r["flips_owned"] == (r["flips_relative"] and own)
    assert all(r["n_tokens"] > GEMMA_WINDOW + 64 for r in rows if r["scenario"] == "favourite_colour_long")
    assert all(r["n_tokens"] < GEMMA_WINDOW for r in rows if r["scenario"] == "favourite_colour")
    assert by["favourite_colour"]["n_flip"] >= 1 and by["favourite_colour_long"]["n_flip"] >= 1
