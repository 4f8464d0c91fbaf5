"""dissociation: polarity pairs differ only in the trigger span, spans come from character offsets,
exclusions and skipped scenarios are counted, patching trigger + notes reproduces the inverted run,
and the probe runs on the embedded model (which does not flip policy gates: the record says so)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes.harness.pairs import prepare_polarity_pairs
from kvnotes.harness.tokens import UNEQUAL_TRIGGER_LENGTH, PolarityPair, tokenize_pair, tokenize_polarity_pair
from kvnotes.probes import ProbeContext
from kvnotes.probes.dissociation import VARIANTS, orientation, variant_masks
from kvnotes.probes.dissociation import run as run_dissociation
from kvnotes.scenarios import build_pairs, draw_instances, load_suite, render_user_text
from kvnotes.scenarios.instances import NO_POLARITY_BLOCK, build_polarity_pairs, render_user_text_spans, slot_char_spans
from tests.helpers import check_figures, probe_yaml
from tests.harness.test_tokens import scenario

POLARITY = {"rule": "Colour rules {gate} apply.", "polarity": {"slot": "gate", "values": {"normal": "always", "inverted": "never"}}}

#: fp32 noise on a first-token score (nats) between forwards of different batch shapes.
SCORE_TOL = 1e-4


def test_slot_spans_locate_every_slot_and_keep_render_user_text():
    sc = scenario(**POLARITY)
    inst = draw_instances(sc, 1, 0)[0]
    text, spans, prefix = render_user_text_spans(inst, "red")
    assert render_user_text(inst, "red") == (text, spans["colour"][0], prefix)
    (t0, t1), = spans["gate"]
    assert text[t0:t1] == "always" and text[slice(*spans["colour"][0])] == "red"
    assert [text[s:e] for s, e in spans["name"]] == [dict(inst.slots)["name"]]
    inv = build_polarity_pairs([sc], 1, 0)[0][0].inverted
    (u0, u1), = slot_char_spans(inv, "red", "gate")
    assert render_user_text_spans(inv, "red")[0][u0:u1] == "never"
    assert slot_char_spans(inst, "red", "nonexistent") == []


def test_polarity_pairs_and_skipped_scenarios():
    specs, skipped = build_polarity_pairs([scenario(**POLARITY), scenario()], 2, 0)
    assert skipped == [{"scenario": "test", "family": "recall", "reason": NO_POLARITY_BLOCK}]
    assert len(specs) == 2 * 2                                   # instances x field values
    for s in specs:
        sc = s.instance.scenario
        assert s.instance.polarity == "normal" and s.inverted.polarity == "inverted"
        assert s.cand_old == sc.candidates[sc.outcome(s.value, "normal")] != s.cand_new
        assert s.inverted.slots == s.instance.slots and s.expect_flip


def test_tokenized_polarity_pair_differs_only_in_the_trigger(smol):
    tok = smol.tokenizer
    sc = load_suite(["scenarios/suites"], ids=["account_role"])
    specs, _ = build_polarity_pairs(sc, 1, 0)
    for spec in specs:
        tp = tokenize_polarity_pair(tok, spec)
        assert isinstance(tp, PolarityPair)
        t0, t1 = tp.trigger
        a, b = tp.value_field
        assert tok.decode(tp.old.ids[t0:t1]).strip() == "allowed" and tok.decode(tp.new.ids[t0:t1]).strip() == "forbidden"
        assert tok.decode(tp.old.ids[a:b]).strip() == spec.value == tok.decode(tp.new.ids[a:b]).strip()
        assert b <= t0 and tp.downstream == (t1, tp.decision)
        same = torch.ones(len(tp.old.ids), dtype=torch.bool)
        same[t0:t1] = False
        assert torch.equal(tp.old.ids[same], tp.new.ids[same]) and not torch.equal(tp.old.ids, tp.new.ids)
        assert tok.convert_ids_to_tokens([tp.cand_old[0], tp.cand_new[0]]) in (["ĠYes", "ĠNo"], ["ĠNo", "ĠYes"])
        # the field pair of the same instance is still tokenised as before
        fp = tokenize_pair(tok, build_pairs(sc, 1, 0)[0])
        same_value = fp.old if spec.value == fp.spec.old else fp.new
        assert fp.field == (a, b) and torch.equal(same_value.ids, tp.old.ids)


def test_unequal_trigger_length_is_excluded(smol):
    sc = scenario(rule="Colour rules {gate} apply.",
                  polarity={"slot": "gate", "values": {"normal": "always", "inverted": "absolutely never ever"}})
    spec = build_polarity_pairs([sc], 1, 0)[0][0]
    assert tokenize_polarity_pair(smol.tokenizer, spec) == UNEQUAL_TRIGGER_LENGTH


def test_variant_masks_and_orientation(smol):
    sc = load_suite(["scenarios/suites"], ids=["visa_status"])
    specs, _ = build_polarity_pairs(sc, 1, 0)
    tp = tokenize_polarity_pair(smol.tokenizer, specs[0])
    m = variant_masks(3, tp)
    t0, t1 = tp.trigger
    d = tp.decision
    cover = {v: m[i, 0].nonzero().flatten().tolist() for i, v in enumerate(VARIANTS)}
    assert cover == {"trigger": list(range(t0, t1)), "notes": list(range(t1, d)), "both": list(range(t0, d)),
                     "prefix": list(range(t0))}
    assert bool((m == m[:, :1]).all())                           # every layer
    signs = {s.value: orientation(tokenize_polarity_pair(smol.tokenizer, s)) for s in specs}
    assert sorted(signs.values()) == [-1.0, 1.0]


def test_probe_runs_on_embedded_model(smol, tmp_path):
    scen = OmegaConf.merge(OmegaConf.load("conf/scenario/default.yaml"),
                           {"ids": ["account_role", "visa_status", "favourite_colour"], "n_instances": 1})
    # one more scenario whose trigger words tokenise to different lengths
    odd = scenario(rule="Colour rules {gate} apply.",
                   polarity={"slot": "gate", "values": {"normal": "always", "inverted": "absolutely never ever"}})
    pairs = prepare_polarity_pairs(smol.tokenizer, scen, scenarios=load_suite(list(scen.paths), None, scen.ids) + [odd])
    cfg = OmegaConf.merge(probe_yaml("dissociation"), {"n_boot": 200, "progress": False})
    res = run_dissociation(ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=scen))
    rows, agg = res["rows"], res["aggregates"]
    assert res["skipped_scenarios"] == {NO_POLARITY_BLOCK: 1}                  # favourite_colour
    assert len(rows) == 4 and {r["family"] for r in rows} == {"policy_gate"}
    assert Counter(e["reason"] for e in res["excluded"])[UNEQUAL_TRIGGER_LENGTH] == 2   # both field values
    assert res["exclusions"] == dict(Counter(e["reason"] for e in res["excluded"]))
    assert sum(res["exclusions"].values()) == 2 + sum(not r["flips"] for r in rows)
    checks = agg["checks"]
    # patching the identical prefix changes nothing but fp32 summation order (batch shapes differ)
    assert checks["max_both_score_err"] < SCORE_TOL and checks["max_prefix_shift"] < SCORE_TOL
    for r in rows:
        assert r["shift_both"] == pytest.approx(r["effect"], abs=1e-4)
        sgn = -1.0 if r["value_outcome"] == "A" else 1.0
        assert r["s_fixed_normal"] == pytest.approx(sgn * r["s_old"]) and r["s_fixed_inverted"] == pytest.approx(sgn * r["s_new"])
    # measured on SmolLM2-135M: flipping the trigger word does not flip the decision (|effect| < 0.1
    # nats), so recovery is not reported and the record says why, with counts
    pg = agg["policy_gate"]
    assert pg["n_pairs"] == 4 and pg["n_flip"] == 0 and pg["flip_rate"]["k"] == 0
    assert all(pg["recovery"][v]["n"] == 0 and pg["recovery"][v]["mean"] is None for v in ("trigger", "notes", "both"))
    assert max(abs(r["effect"]) for r in rows) < 0.1
    assert "policy_gate" in res["notes"] and "4 aligned pairs" in res["notes"]["policy_gate"]
    assert agg["policy_gate"]["two_by_two"]["interaction"]["n"] == 2
    check_figures("dissociation", res, tmp_path)
