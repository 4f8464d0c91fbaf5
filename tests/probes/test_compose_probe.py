"""The chunked scenario layout (kvnotes/harness/chunks.py) and the ``compose`` probe on the embedded model."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from kvnotes import CONF_DIR
from kvnotes.probes import ProbeContext
from tests.helpers import check_figures

# fp32 on CPU: recomputing whole chunks (seam >= chunk length) is the full prefill done in three
# forwards instead of one; measured differences are ~3e-5 in logits of magnitude ~20.
FULL_SEAM_ATOL = 1e-3

pytestmark = pytest.mark.embedded


def scenario_cfg():
    sc = OmegaConf.load(os.path.join(CONF_DIR, "scenario", "default.yaml"))
    sc.families, sc.ids, sc.n_instances = ["recall"], ["home_city"], 1
    return sc


@pytest.fixture(scope="module")
def result(smol):
    from kvnotes.harness.pairs import prepare_pairs
    from kvnotes.probes.compose import run

    cfg = OmegaConf.load("conf/probe/compose.yaml")
    cfg.progress, cfg.n_boot, cfg.seams, cfg.sinks, cfg.edit_arm_seams = False, 200, [0, 4], ["bos"], [0]
    ctx = ProbeContext(bundle=smol, pairs=prepare_pairs(smol.tokenizer, scenario_cfg()), cfg=cfg, seed=0,
                       scenario_cfg=scenario_cfg())
    return run(ctx)


def test_chunk_spans_hold_the_rule_and_filler(smol):
    from kvnotes.harness.chunks import chunked_pairs

    ps = chunked_pairs(smol.tokenizer, scenario_cfg())
    assert ps.pairs and not ps.excluded
    for p in ps.pairs:
        (a1, b1), (a2, b2) = p.chunks
        assert p.chunk_names == ("rule", "filler") and b1 <= a2 and b2 <= p.field[0]
        rule = smol.tokenizer.decode(p.old.ids[a1:b1])
        assert rule.strip() == p.spec.instance.scenario.rule.strip()
        assert (p.old.ids[:p.field[0]] == p.new.ids[:p.field[0]]).all()


def test_embedded_compose_record(result, tmp_path):
    agg = result["aggregates"]
    assert agg["checks"]["max_abs_logit_diff_full_seam"] < FULL_SEAM_ATOL
    names = result["variant_names"]
    assert set(names) == {f"{r}/sink=bos/seam={s}" for r in ("rotate", "no_rotate") for s in (0, 4)}
    assert agg["n_prompts"] == len(result["prompts"]) == 3          # 3 field values, 1 instance
    for v in names:
        da = agg["variants"][v]["decision_agreement"]["all"]
        assert da["n"] == agg["n_owned_prompts"]
        assert 0 <= agg["variants"][v]["kl"]["all"]["mean"]
    assert len(result["rows"]) == 3 and all(len(r["s_full"]) == 2 for r in result["rows"])
    check_figures("compose", result, tmp_path)


def test_edit_arms_are_judged_against_the_edited_text(result):
    arms = result["aggregates"]["edit_arms"]
    for arm, keys in (("erratum", ("composed/seam=0", "full")), ("field_in_chunk", ("refreshed/seam=0", "stale/seam=0"))):
        assert arms[arm]["n"] + arms[arm]["excluded"] == len(result["rows"])
        for k in keys:
            assert arms[arm][k]["accuracy"]["n"] == arms[arm]["n"]
    # the refreshed field must move the decision towards the oracle: KL no larger than the stale cache's
    fic = arms["field_in_chunk"]
    if fic["n"]:
        assert fic["refreshed/seam=0"]["kl"]["mean"] <= fic["stale/seam=0"]["kl"]["mean"] + 1e-6


def test_edit_arms_shared_work_equals_each_pair_alone(smol, result):
    """The probe shares work between an instance's pairs (precompiled chunks, the erratum oracle from
    the composed prompts' full prefill, one stale cache per old value); each pair's arms must equal
    the arms computed for that pair alone, from scratch."""
    from kvnotes.harness.chunks import chunked_pairs
    from kvnotes.probes.compose import edit_arms

    ps = chunked_pairs(smol.tokenizer, scenario_cfg())
    for pair, row in zip(ps.pairs, result["rows"]):
        assert row["pair"] == pair.spec.id
        alone = edit_arms(smol.model, smol.tokenizer, pair, [0], {})
        for arm, methods in (("erratum", ("composed", "full")), ("field_in_chunk", ("refreshed", "stale"))):
            got, want = row["arms"][arm], alone[arm]
            assert got.keys() == want.keys() and got["oracle_top1"] == want["oracle_top1"]
            for m in methods:
                assert got[m]["top1_agree"] == want[m]["top1_agree"]
                assert got[m]["kl"] == pytest.approx(want[m]["kl"], abs=FULL_SEAM_ATOL)
