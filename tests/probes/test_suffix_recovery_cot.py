"""suffix_recovery under chain of thought (issue #20): with zero new tokens the generated readout of
every coarse-curve variant is the direct readout of the same position set; clean chains that miss
the marker exclude the pair, never score it; the direct-only parts are refused in one line; and
``run.py`` writes a generated-readout record on the embedded model."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import kvnotes.probes.suffix_recovery as sr
from kvnotes.errors import KvnotesError
from kvnotes.harness import kit
from kvnotes.harness.protocol import ScreenedPair, screen_generated
from kvnotes.harness.readout import PairRun
from kvnotes.harness.tokens import Prompt, TokenizedPair
from kvnotes.kv import cache as kvcache
from kvnotes.kv.generate import token_marker
from kvnotes.scenarios import build_pairs
from tests.helpers import job_record, VOCAB, cot_tiny_ctx
from tests.kv.test_cache import FIELD, full_logprobs, prompts
from tests.harness.test_tokens import scenario

#: nats / recovery units: the generated readout at zero new tokens against the direct readout
TOL = 1e-4
FRACTIONS = [0.25, 0.5, 1.0]


def owned_pair(model) -> TokenizedPair:
    """A token-aligned pair over random ids whose candidates are the tiny model's own top-1s, so
    its clean runs own a flip (the screen keeps it)."""
    for seed in range(1, 50):
        old, new = prompts(seed)
        t_old, t_new = int(full_logprobs(model, old).argmax()), int(full_logprobs(model, new).argmax())
        if t_old != t_new:
            break
    spec = build_pairs([scenario()], 1, 0)[0]

    def prompt(ids):
        return Prompt("", ids, torch.zeros(len(ids), 2, dtype=torch.long), (0, 0), FIELD)

    return TokenizedPair(spec, prompt(old), prompt(new), (t_old,), (t_new,))


@pytest.fixture
def tiny_ctx(tiny, monkeypatch):
    return cot_tiny_ctx(tiny, monkeypatch, sr)


def test_zero_new_tokens_is_the_direct_readout(tiny, tiny_ctx, monkeypatch):
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    pair = owned_pair(tiny)
    n_layers = len(kvcache.prefill(tiny, pair.old.ids[:2]).layers)
    bands = kit.layer_bands(n_layers, 2)
    grid = sr.grid_points(FRACTIONS, [])
    sp, row = screen_generated(tiny_ctx, pair, 0)
    assert sp is not None and row["flips"]
    row |= sr.evaluate_pair(sp, grid, bands, np.random.default_rng(0), 1, None, True, families=sr.COT_FAMILIES,
                            single=False)
    assert row["n_unreached"] == 0 and "single" not in row and "random_draws" not in row
    d = pair.decision
    run = PairRun(pair, kvcache.prefill(tiny, pair.old.ids[:d]), kvcache.prefill(tiny, pair.new.ids[:d]),
                  row["s_old"], row["s_new"])
    direct = sr.evaluate_pair(ScreenedPair(run, tiny), grid, bands, np.random.default_rng(0), 1, None, True)
    assert row["k"] == direct["k"]
    for name in ("suffix", "prefix", "field+suffix", "field+prefix"):
        assert row["curves"][name] == pytest.approx(direct["curves"][name], abs=TOL)
    assert row["bands"] == pytest.approx(direct["bands"], abs=TOL)
    for ref in sr.REFERENCES:
        assert row[f"r_{ref}"] == pytest.approx(direct[f"r_{ref}"], abs=TOL)
    assert row["r_none"] == pytest.approx(0.0, abs=TOL) and row["r_field_downstream"] == pytest.approx(1.0, abs=TOL)
    assert all(c["reached"] and c["length"] == 0 for c in row["chains"].values())
    assert row["chains"].keys() >= {"ref:none", "suffix@0", "prefix@2", "band@1"}


def test_clean_chains_without_the_marker_exclude_the_pair(tiny, tiny_ctx, monkeypatch):
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: token_marker([VOCAB + 5]))   # never generated
    pair = owned_pair(tiny)
    sp, row = screen_generated(tiny_ctx, pair, 3)
    assert sp is None and row["reason"] == "old_no_marker" and row["s_old"] is None and not row["flips"]
    assert row["chain_old"]["length"] == 3 and row["chain_old"]["marker_at"] is None
    assert "curves" not in row and "chains" not in row                      # never patched, never scored


def test_direct_only_sets_are_refused_in_one_line():
    from kvnotes.harness.registry import load_config

    with pytest.raises(KvnotesError, match="probe.cot_families.1: .*single-position map") as err:
        load_config("suffix_recovery", {"cot_families": ["suffix", "topk"]})
    assert "\n" not in str(err.value)
    with pytest.raises(KvnotesError, match="probe.cot_fractions.0: Input should be greater than 0"):
        load_config("suffix_recovery", {"cot_fractions": [0.0, 1.0]})


@pytest.mark.embedded
def test_run_py_writes_a_generated_readout_record(smol, tmp_path):
    rec = job_record(smol, tmp_path, "probe=suffix_recovery", "scenario=small", "scenario.variant=cot", "scenario.n_instances=1",
               "scenario.ids=[favourite_colour]", "probe.cot_max_pairs=2", "probe.cot_fractions=[0.5,1.0]",
               "probe.layer_bands=2", "probe.n_boot=50", "plot=false")
    res = rec["result"]
    agg = res["aggregates"]
    assert agg["readout"] == "generated" and agg["n_screened"] == 2 and agg["direct_only"] == ["single", "topk", "random"]
    screened_out = sum(v for k, v in res["exclusions"].items() if k.endswith("_no_marker") or k == "no_cot_flip")
    assert agg["n_flip"] + screened_out == 2 and all(r["flips"] for r in res["rows"])
    assert res["exclusions"]["beyond_max_pairs"] == rec["scenario"]["n_pairs_aligned"] - 2
    for r in res["rows"]:
        assert r["chain_old"]["reached"] and r["chain_new"]["reached"]
        assert set(r["curves"]) == {"suffix", "prefix", "field+suffix", "field+prefix"}
        for name, chain in r["chains"].items():
            assert len(chain["ids"]) == chain["length"] <= 40
        assert all((v is None) == (not r["chains"][f"suffix@{i}"]["reached"]) for i, v in enumerate(r["curves"]["suffix"]))
        assert sum(not c["reached"] for c in r["chains"].values()) == r["n_unreached"]
