"""Invariants on the real embedded model (SmolLM2-135M-Instruct) with a real recall pair (tests/recall.py;
the probes' own numbers on it are checked in each probe's test file)."""

from __future__ import annotations

import pytest
import torch


from kvnotes.kv import patch as kvpatch
from kvnotes.harness.readout import flip_status, variant_scores
from tests.helpers import BATCH_TOL


def test_clean_scores_equal_full_forward(smol, smol_recall_pair, smol_pair_run):
    for prompt, s in ((smol_recall_pair.old, smol_pair_run.s_old), (smol_recall_pair.new, smol_pair_run.s_new)):
        with torch.no_grad():
            lp = torch.log_softmax(smol.model(prompt.ids[None]).logits[0, -1].float(), -1)
        assert s == pytest.approx(float(lp[smol_recall_pair.cand_new[0]] - lp[smol_recall_pair.cand_old[0]]), abs=1e-4)
    assert flip_status(smol_pair_run.s_old, smol_pair_run.s_new) is None          # this recall pair flips
    # ... and it is the model's own answer: each run's vocabulary top-1 is its expected candidate,
    # read from the same full forward
    for prompt, dec, cand in ((smol_recall_pair.old, smol_pair_run.decisions[0], smol_recall_pair.cand_old),
                              (smol_recall_pair.new, smol_pair_run.decisions[1], smol_recall_pair.cand_new)):
        with torch.no_grad():
            p = torch.softmax(smol.model(prompt.ids[None]).logits[0, -1].float(), -1)
        assert dec.top1 == int(p.argmax()) == cand[0] and dec.owns
        assert dec.p_top1 == pytest.approx(float(p.max()), abs=1e-5)
        mass = p[smol_recall_pair.cand_old[0]] + p[smol_recall_pair.cand_new[0]]
        assert dec.cand_mass == pytest.approx(float(mass), abs=1e-5)
    status = smol_pair_run.status(1.0, "owned")
    assert status["flips"] and status["flips_owned"] and status["flips_relative"] and status["owned"]


def test_recovery_invariants(smol, smol_recall_pair, smol_pair_run):
    a, b = smol_recall_pair.field
    d = smol_recall_pair.decision
    L = len(smol_pair_run.old_cache.layers)
    sets = [list(range(d)), [], list(range(a)), list(range(a, d)), list(range(a, b)), list(range(b, d))]
    masks = kvpatch.position_masks(L, d, sets)
    s = variant_scores(smol.model, smol_recall_pair, smol_pair_run.old_cache, smol_pair_run.new_cache, masks)
    r = smol_pair_run.recovery(s)
    assert r[0] == pytest.approx(1.0, abs=1e-4)       # all positions from the new run
    assert r[1] == pytest.approx(0.0, abs=BATCH_TOL)  # nothing (batched vs clean run: kernel rounding)
    assert r[2] == pytest.approx(0.0, abs=1e-4)       # positions before the field
    assert r[3] == pytest.approx(1.0, abs=1e-4)       # field + downstream
    # field-only and downstream-only are findings, not invariants: they are only required to be
    # finite and to differ (recall copies from the field, so its field-only recovery is high)
    assert torch.isfinite(r[4:]).all() and abs(float(r[4] - r[5])) > 1e-3
