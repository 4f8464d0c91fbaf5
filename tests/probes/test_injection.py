"""injection: writing the other run's notes into a cache matches an independent reference, writing
field + notes reproduces the other run exactly, follow rates only count flipping pairs, the probe
runs on the embedded model, and on the planted constructions it follows the planted source."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

import kvnotes.probes
from kvnotes.harness.pairs import prepare_pairs
from kvnotes.harness.tokens import Prompt, TokenizedPair
from kvnotes.probes import ProbeContext
from kvnotes.probes.injection import DIRECTIONS, inject_pair, injection_masks
from kvnotes.probes.injection import run as run_injection
from kvnotes.scenarios import build_pairs
from tests.helpers import check_figures, probe_yaml
from tests.kv.test_cache import FIELD, T, full_logprobs, prompts, reference_patched
from tests.harness.test_tokens import scenario
from kvnotes.harness import kit
from kvnotes.harness.screened import screen_generated
from kvnotes.kv.generate import token_marker
from kvnotes.probes import injection
from tests.helpers import job_record, VOCAB, cot_tiny_ctx
from tests.planted import planted_context

CANDS = ((3,), (7,))      # candidate first tokens on the tiny vocabulary (old, new)
TOL = 1e-5


def synthetic_pair(old: torch.Tensor, new: torch.Tensor, field=FIELD) -> TokenizedPair:
    """A token-aligned pair over random ids for tiny models (text and offsets are placeholders)."""
    spec = build_pairs([scenario()], 1, 0)[0]

    def prompt(ids):
        return Prompt("", ids, torch.zeros(len(ids), 2, dtype=torch.long), (0, 0), field)

    return TokenizedPair(spec, prompt(old), prompt(new), *CANDS)


def score(lp: torch.Tensor) -> float:
    return float(lp[CANDS[1][0]] - lp[CANDS[0][0]])


def test_masks():
    """Every variant is the old cache with the new K/V where true: the new notes [b, d) and field +
    notes [a, d); the new cache with the old notes = new everywhere but [b, d); with the old field
    + notes = new only on the shared prefix [0, a)."""
    masks = injection_masks(3, (5, 8), 20)
    assert set(masks) == set(DIRECTIONS)
    spans = {"new_notes_into_old": [(8, 20), (5, 20)], "old_notes_into_new": [(0, 8), (0, 5)]}
    for name, m in masks.items():
        assert m.shape == (2, 3, 20)
        for row, (lo, hi) in zip(m, spans[name]):
            assert row.any(0).nonzero().flatten().tolist() == list(range(lo, hi)) and bool(row.all(0)[lo:hi].all())


def test_injection_matches_reference_and_field_plus_notes_reproduces_the_other_run(tiny):
    old, new = prompts()
    pair = synthetic_pair(old, new)
    cols = inject_pair(tiny, pair)
    s_old, s_new = score(full_logprobs(tiny, old)), score(full_logprobs(tiny, new))
    assert cols["s_old"] == pytest.approx(s_old, abs=TOL) and cols["s_new"] == pytest.approx(s_new, abs=TOL)
    assert abs(s_new - s_old) > 1e-4                                          # the runs differ
    L = tiny.config.num_hidden_layers
    notes = torch.zeros(L, T, dtype=torch.bool)
    notes[:, FIELD[1]:] = True
    # independent reference (full-length caches, direct indexing): old cache + new notes, and reverse
    assert cols["new_notes_into_old_s_notes"] == pytest.approx(score(reference_patched(tiny, old, new, notes)), abs=TOL)
    assert cols["old_notes_into_new_s_notes"] == pytest.approx(score(reference_patched(tiny, new, old, notes)), abs=TOL)
    # field + notes from the other run = that run, exactly
    assert cols["new_notes_into_old_s_all"] == pytest.approx(s_new, abs=TOL)
    assert cols["old_notes_into_new_s_all"] == pytest.approx(s_old, abs=TOL)
    for name in DIRECTIONS:
        assert cols[f"{name}_r_all"] == pytest.approx(1.0, abs=1e-3)
        base, src = DIRECTIONS[name]
        assert cols[f"{name}_follows_notes"] == ((cols[f"{name}_s_notes"] > 0) == (cols[f"s_{src}"] > 0))


def test_probe_runs_on_embedded_model(smol, tmp_path):
    scen = OmegaConf.merge(OmegaConf.load("conf/scenario/default.yaml"),
                           {"ids": ["favourite_colour", "request_id"], "n_instances": 1})
    pairs = prepare_pairs(smol.tokenizer, scen)
    cfg = OmegaConf.merge(probe_yaml("injection"), {"n_boot": 200, "progress": False})
    res = run_injection(ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=scen))
    rows, agg = res["rows"], res["aggregates"]
    assert len(rows) == len(pairs.pairs) == agg["n_pairs"] >= 6
    assert agg["checks"]["max_field_and_notes_score_err"] < 1e-4
    assert agg["checks"]["max_field_and_notes_recovery_err"] < 1e-3
    # exclusions: tokenisation + non-flipping pairs, counted once each; the control never flips
    flipping = [r for r in rows if r["flips"]]
    assert sum(res["exclusions"].values()) == len(pairs.excluded) + len(rows) - len(flipping)
    assert res["exclusions"] == dict(Counter(e["reason"] for e in res["excluded"]))
    assert "control" not in agg["flipping"] and "control" in res["notes"]
    # follow rates count flipping pairs only
    for fam, entry in agg["flipping"].items():
        n = len(flipping) if fam == "all" else sum(r["family"] == fam for r in flipping)
        for name in DIRECTIONS:
            assert entry[name]["follow_notes"]["n"] == n > 0
            assert entry[name]["follow_notes"]["k"] + entry[name]["follow_field"]["k"] == n
            lo, hi = entry[name]["follow_notes"]["ci"]
            assert 0 <= lo <= entry[name]["follow_notes"]["p"] <= hi <= 1
    # measured on SmolLM2-135M: favourite-colour recall pairs flip and their decision follows the
    # field, not injected notes (the decision query reads the colour from the field itself)
    recall = agg["flipping"]["recall"]
    for name in DIRECTIONS:
        assert recall[name]["follow_notes"]["k"] == 0
        assert recall[name]["r_notes"]["mean"] < 0.25
    check_figures("injection", res, tmp_path)


# -------------------- the generated readout (scenario.variant=cot)
# injection under chain of thought (issue #20): with zero new tokens the generated readout of every
# injected cache is the direct injection readout; clean chains that miss the marker exclude the pair
# by reason with their chains; ``run.py`` writes a generated-readout record with chains and
# exclusions on the embedded model.



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


@pytest.mark.planted("injection")
@pytest.mark.parametrize("family,follows", [("notes", 1.0), ("direct", 0.0)])
def test_injection_follows_the_planted_source(planted_arch, planted_cache, monkeypatch, family, follows):
    ctx = planted_context(planted_cache, monkeypatch, family, "injection", n_instances=1, arch=planted_arch)
    flipping = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["flipping"]["all"]
    for cell in flipping.values():
        assert cell["follow_notes"]["p"] == follows
