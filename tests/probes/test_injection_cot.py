"""injection under chain of thought (issue #20): with zero new tokens the generated readout of every
injected cache is the direct injection readout; clean chains that miss the marker exclude the pair
by reason with their chains; ``run.py`` writes a generated-readout record with chains and
exclusions on the embedded model."""

from __future__ import annotations


import pytest

from kvnotes.harness import kit
from kvnotes.harness.protocol import screen_generated
from kvnotes.kv.generate import token_marker
from kvnotes.probes import injection
from kvnotes.probes.injection import DIRECTIONS, inject_pair
from tests.helpers import job_record, VOCAB, cot_tiny_ctx
from tests.kv.test_cache import prompts
from tests.probes.test_injection import synthetic_pair

TOL = 1e-5


@pytest.fixture
def tiny_ctx(tiny, monkeypatch):
    return cot_tiny_ctx(tiny, monkeypatch, injection)


def test_zero_new_tokens_is_the_direct_injection(tiny, tiny_ctx, monkeypatch):
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    old, new = prompts()
    pair = synthetic_pair(old, new)
    sp, row = screen_generated(tiny_ctx, pair, 0)
    direct = inject_pair(tiny, pair)
    assert sp is not None                                  # both clean chains reached their (absent) marker
    row |= injection.inject(sp)
    assert row["s_old"] == pytest.approx(direct["s_old"], abs=TOL) and row["s_new"] == pytest.approx(direct["s_new"], abs=TOL)
    for name in DIRECTIONS:
        for what in ("notes", "all"):
            assert row[f"{name}_s_{what}"] == pytest.approx(direct[f"{name}_s_{what}"], abs=TOL)
            assert row[f"{name}_chain_{what}"] == {"ids": [], "length": 0, "marker_at": None, "reached": True,
                                                   "stopped": "marker"}
        assert isinstance(row[f"{name}_follows_notes"], bool)
        assert row[f"{name}_r_all"] == pytest.approx(1.0, abs=1e-3)          # field + notes = the source run


def test_clean_chains_without_the_marker_exclude_the_pair(tiny_ctx, monkeypatch):
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: token_marker([VOCAB + 5]))   # never generated
    old, new = prompts()
    sp, row = screen_generated(tiny_ctx, synthetic_pair(old, new), 3)
    assert sp is None and row["reason"] == "old_no_marker" and row["s_old"] is None and not row["flips"]
    for side in ("old", "new"):
        assert row[f"chain_{side}"]["length"] == 3 and row[f"chain_{side}"]["marker_at"] is None
    assert not any(k.endswith("_s_notes") for k in row)                        # never injected, never scored


@pytest.mark.embedded
def test_run_py_writes_a_generated_readout_record(smol, tmp_path):
    rec = job_record(smol, tmp_path, "probe=injection", "scenario=small", "scenario.variant=cot", "scenario.n_instances=1",
               "scenario.ids=[favourite_colour]", "probe.cot_max_pairs=1", "probe.cot_max_new_tokens=40",
               "probe.n_boot=50", "plot=false")
    res = rec["result"]
    agg = res["aggregates"]
    assert agg["readout"] == "generated" and agg["n_screened"] == 1
    assert res["exclusions"]["beyond_max_pairs"] == rec["scenario"]["n_pairs_aligned"] - 1
    assert agg["n_reached"] + sum(v for k, v in res["exclusions"].items() if k.endswith("_no_marker")) == 1
    for r in res["rows"]:
        assert r["chain_old"]["reached"] and r["chain_old"]["marker_at"] == r["chain_old"]["length"] - 1
        for name in DIRECTIONS:
            chain = r[f"{name}_chain_notes"]
            assert len(chain["ids"]) == chain["length"] and (r[f"{name}_follows_notes"] is None) != chain["reached"]
