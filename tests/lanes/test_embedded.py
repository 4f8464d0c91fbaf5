"""Invariants on the real embedded model (SmolLM2-135M-Instruct) with a real recall pair."""

from __future__ import annotations

import pytest
import torch


from kvnotes.kv import patch as kvpatch
from kvnotes.harness.readout import flip_status, run_pair, variant_scores
from kvnotes.harness.tokens import tokenize_pair
from kvnotes.probes.blast_radius import deviation_maps, summarize_pair
from kvnotes.scenarios import build_pairs, load_suite
from tests.helpers import BATCH_TOL


@pytest.fixture(scope="module")
def recall_pair(smol):
    specs = build_pairs(load_suite(["scenarios/suites"], ids=["favourite_colour"]), 1, 0)
    return tokenize_pair(smol.tokenizer, specs[0])


@pytest.fixture(scope="module")
def pair_run(smol, recall_pair):
    return run_pair(smol.model, recall_pair)


def test_clean_scores_equal_full_forward(smol, recall_pair, pair_run):
    for prompt, s in ((recall_pair.old, pair_run.s_old), (recall_pair.new, pair_run.s_new)):
        with torch.no_grad():
            lp = torch.log_softmax(smol.model(prompt.ids[None]).logits[0, -1].float(), -1)
        assert s == pytest.approx(float(lp[recall_pair.cand_new[0]] - lp[recall_pair.cand_old[0]]), abs=1e-4)
    assert flip_status(pair_run.s_old, pair_run.s_new) is None          # this recall pair flips
    # ... and it is the model's own answer: each run's vocabulary top-1 is its expected candidate,
    # read from the same full forward
    for prompt, dec, cand in ((recall_pair.old, pair_run.decisions[0], recall_pair.cand_old),
                              (recall_pair.new, pair_run.decisions[1], recall_pair.cand_new)):
        with torch.no_grad():
            p = torch.softmax(smol.model(prompt.ids[None]).logits[0, -1].float(), -1)
        assert dec.top1 == int(p.argmax()) == cand[0] and dec.owns
        assert dec.p_top1 == pytest.approx(float(p.max()), abs=1e-5)
        assert dec.cand_mass == pytest.approx(float(p[recall_pair.cand_old[0]] + p[recall_pair.cand_new[0]]), abs=1e-5)
    status = pair_run.status(1.0, "owned")
    assert status["flips"] and status["flips_owned"] and status["flips_relative"] and status["owned"]


def test_recovery_invariants(smol, recall_pair, pair_run):
    a, b = recall_pair.field
    d = recall_pair.decision
    L = len(pair_run.old_cache.layers)
    sets = [list(range(d)), [], list(range(a)), list(range(a, d)), list(range(a, b)), list(range(b, d))]
    masks = kvpatch.position_masks(L, d, sets)
    s = variant_scores(smol.model, recall_pair, pair_run.old_cache, pair_run.new_cache, masks)
    r = pair_run.recovery(s)
    assert r[0] == pytest.approx(1.0, abs=1e-4)       # all positions from the new run
    assert r[1] == pytest.approx(0.0, abs=BATCH_TOL)  # nothing (batched vs clean run: kernel rounding)
    assert r[2] == pytest.approx(0.0, abs=1e-4)       # positions before the field
    assert r[3] == pytest.approx(1.0, abs=1e-4)       # field + downstream
    # field-only and downstream-only are findings, not invariants: they are only required to be
    # finite and to differ (recall copies from the field, so its field-only recovery is high)
    assert torch.isfinite(r[4:]).all() and abs(float(r[4] - r[5])) > 1e-3


def test_blast_radius_maps(smol, recall_pair, pair_run):
    maps, lps = deviation_maps(smol.model, recall_pair)
    scores = [float(lp[recall_pair.cand_new[0]] - lp[recall_pair.cand_old[0]]) for lp in lps]
    assert scores == pytest.approx([pair_run.s_old, pair_run.s_new], abs=1e-4)
    assert [int(lp.argmax()) for lp in lps] == [d.top1 for d in pair_run.decisions]
    a, b = recall_pair.field
    d = recall_pair.decision
    assert maps["k_rel"].shape == (30, d + 1)
    assert float(maps["k_rel"][:, :a].max()) < 1e-5                      # prefix does not move
    assert float(maps["k_rel"][:, a:b].min()) > 1e-2                     # the field's own keys change
    assert float(maps["k_rel"][0, b:].max()) < 1e-5                      # layer 0 KV depends only on the token
    assert float(maps["k_rel"][1:, b:d].mean()) > 1e-3                  # deeper layers carry it downstream
    assert float(maps["attn_rel"][:, :b].max()) < 1e-5                   # field-only refresh is exact up to b
    summary = summarize_pair(maps, (a, b), d, [0.001, 0.01])
    assert 0 <= summary["k_rel_share"][1] <= summary["k_rel_share"][0] <= 1
