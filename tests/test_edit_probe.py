"""The ``edit`` probe end to end on the embedded model, the prompt edits of kvnotes.harness.edit_prompts, and the
CoT decision reader."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes.harness.selection import round_robin
from probes.edit import decision_after_marker
from tests.helpers import check_figures, recall_pairs

# fp32 CPU: K=0 selective and the field refresh are the same cache; the KL of the same
# distribution computed twice is rounding only.
KL_TOL = 1e-5


def test_decision_after_marker_is_the_owned_top1():
    """After the marker the decision is read as at the decision position: the outcome whose
    candidate's first token is the top-1; another top-1 is no (owned) decision."""
    from types import SimpleNamespace

    pair = SimpleNamespace(cand_old=(5, 9), cand_new=(7,))
    lp = torch.log_softmax(torch.tensor([0.0, 0, 0, 0, 0, 1.0, 0, 3.0, 0, 0]), -1)
    assert decision_after_marker(lp, pair, "London", "Paris") == "Paris"
    lp[5] = 10.0
    assert decision_after_marker(lp, pair, "London", "Paris") == "London"
    lp[2] = 20.0
    assert decision_after_marker(lp, pair, "London", "Paris") is None


def test_round_robin_keeps_every_scenario():
    rows = [{"scenario": s} for s in "aaabbc"]
    assert [rows[i]["scenario"] for i in round_robin(rows)][:3] == ["a", "b", "c"]


@pytest.mark.embedded
def test_prompt_edits_align_with_the_cached_prompt(smol):
    from kvnotes.harness import edit_prompts as edits

    pair = recall_pairs(smol, ["home_city"], 1).pairs[0]
    inst, tok = pair.spec.instance, smol.tokenizer
    same = edits.edited_prompt(tok, inst, pair.spec.old, pair.old)
    assert torch.equal(same.prompt.ids, pair.old.ids)
    notice = edits.erratum_text(inst, pair.spec.new)
    err = edits.edited_prompt(tok, inst, pair.spec.old, pair.old, notice=notice)
    assert notice in err.prompt.text and err.prompt.text.index(notice) < err.prompt.text.index(inst.scenario.request)
    assert pair.field[1] <= err.reuse < pair.old.decision
    assert torch.equal(err.prompt.ids[: err.reuse], pair.old.ids[: err.reuse])
    old_h, new_h = edits.hoisted_pair(tok, inst, pair.spec.old, pair.spec.new)
    assert new_h.reuse == old_h.field[0]                          # reuse ends where the field starts
    assert len(old_h.ids) - new_h.reuse < len(pair.old.ids) - pair.field[0]
    irr = edits.length_matched_notice(tok, edits.notice_tokens(tok, notice))
    assert abs(edits.notice_tokens(tok, irr) - edits.notice_tokens(tok, notice)) <= 2


@pytest.mark.embedded
def test_edit_probe_end_to_end(smol, tmp_path):
    import probes

    from kvnotes.harness.pairs import PairSet

    full_set = recall_pairs(smol, ["home_city"], 1)
    pairs = PairSet(full_set.pairs[:1], [], full_set.scenarios)          # one pair keeps the test short
    cfg = OmegaConf.load("conf/probe/edit.yaml")
    cfg.update({"ks": [0, 4], "rankings": ["last"], "oracle_ranking": "last", "max_pairs": 1,
                "sweep_max_pairs": 1, "max_control_pairs": 1, "n_boot": 100, "progress": False})
    sc = OmegaConf.create({"variant": "direct", "chat_template": True})
    res = probes.get("edit")(probes.ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=sc))
    agg = res["aggregates"]
    assert agg["n_flip"] == len(res["rows"]) == 1 and not res["exclusions"]
    for r in res["rows"]:
        m = r["methods"]
        assert m["full"]["agree"] and m["full"]["kl"] == 0.0 and m["full"]["frac"] == 1.0
        assert not m["stale"]["agree"] and m["stale"]["tokens"] == 0
        assert m["refresh_field"]["tokens"] == r["field"][1] - r["field"][0]
        assert 0 < m["erratum"]["tokens"] < m["full"]["tokens"]
    swept = [r for r in res["rows"] if r["swept"]]
    assert len(swept) == 1
    s = swept[0]
    assert set(s["sweep"]) == {"selective_last@0", "selective_last@4", "oracle_copy@0", "oracle_copy@4"}
    assert abs(s["sweep"]["selective_last@0"]["kl"] - s["methods"]["refresh_field"]["kl"]) < KL_TOL
    assert s["sweep"]["oracle_copy@4"]["flops_frac"] is None                    # upper bound: no cost
    assert agg["upper_bounds"] == ["oracle_copy"]
    assert set(agg["controls"]) == {"wrong_erratum", "irrelevant_notice", "overcorrection"}
    check_figures("edit", res, tmp_path)
