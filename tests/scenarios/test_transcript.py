"""Scenarios rendered as multi-turn agent transcripts (``scenario.transcript``,
:mod:`kvnotes.scenarios.transcript`): old and new prompts differ in the field alone, the field sits
in the tool result, the unrelated exchanges hold no scenario's field value, and the suite configs
give the lengths they promise."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes import CONF_DIR
from kvnotes.harness.pairs import prepare_pairs, prepare_polarity_pairs
from kvnotes.harness.tokens import render_prompt, tokenize_pair
from kvnotes.scenarios import build_pairs
from kvnotes.scenarios.schema import SUITES_DIR, load_suite
from kvnotes.scenarios.transcript import render_transcript

pytestmark = pytest.mark.embedded


def suite(name: str, **over):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "scenario" / "default.yaml"),
                          OmegaConf.load(CONF_DIR / "scenario" / f"{name}.yaml"), over)
    cfg.pop("defaults", None)
    return cfg


def test_pairs_differ_in_the_field_alone_which_sits_in_the_tool_result(smol):
    tok = smol.tokenizer
    (spec,) = [s for s in build_pairs(load_suite([str(SUITES_DIR)], ids=["account_role"]), 1, 0)][:1]
    tp = tokenize_pair(tok, spec, turns=6)
    a, b = tp.field
    assert tok.decode(tp.old.ids[a:b]).strip() == spec.old and tok.decode(tp.new.ids[a:b]).strip() == spec.new
    assert torch.equal(tp.old.ids[:a], tp.new.ids[:a]) and torch.equal(tp.old.ids[b:], tp.new.ids[b:])
    before = tp.old.text[:tp.old.field_chars[0]]
    assert before.rindex("<|im_start|>tool") > before.rindex("<|im_start|>assistant")      # inside the tool result
    assert tp.old.text.endswith("<|im_start|>assistant\nAnswer:") and tp.decision == len(tp.old.ids) - 1
    messages, spans, _ = render_transcript(spec.instance, spec.old, spec.variant, 6)
    assert [m.role for m in messages[:5]] == ["system", "user", "assistant", "tool", "assistant"]
    assert len(messages) == 5 + 4 * 6 + 1 and messages[-1].role == "user" and messages[-1].content.endswith("Yes or No.")
    (i, s, e), = spans[spec.instance.scenario.field_slot]
    assert i == 3 and messages[3].content[s:e] == spec.old
    again, _, _ = render_transcript(spec.instance, spec.new, spec.variant, 6)      # the same draws for both values
    assert [m for k, m in enumerate(again) if k != 3] == [m for k, m in enumerate(messages) if k != 3]


def test_the_unrelated_exchanges_hold_no_field_value_of_any_scenario():
    scenarios = load_suite([str(SUITES_DIR)])
    words = {w.lower() for sc in scenarios for v in sc.values for w in re.findall(r"[A-Za-z]+", v)}
    for spec in build_pairs(scenarios, 2, 0)[::7]:
        messages, _, _ = render_transcript(spec.instance, spec.old, spec.variant, 12)
        exchanges = " ".join(m.content for m in messages[5:-1])
        assert not words & {w.lower() for w in re.findall(r"[A-Za-z]+", exchanges)}


def test_the_suites_give_the_papers_lengths_and_4k(smol):
    for name, lo, hi in (("long", 770, 1000), ("long4k", 3700, 4300)):
        ps = prepare_pairs(smol.tokenizer, suite(name, ids=["favourite_colour", "account_role"], n_instances=2))
        lengths = [len(p.old.ids) for p in ps.pairs]
        assert ps.pairs and not ps.excluded and lo <= min(lengths) and max(lengths) <= hi, (name, lengths)


def test_polarity_pairs_and_the_plain_rendering(smol):
    pol = prepare_polarity_pairs(smol.tokenizer, suite("long", ids=["account_role"], n_instances=1))
    tp = pol.pairs[0]
    a, b = tp.field
    assert tok_text(smol.tokenizer, tp.old.ids[a:b]) == "allowed" and tok_text(smol.tokenizer, tp.new.ids[a:b]) == "forbidden"
    va, vb = tp.value_field
    assert tok_text(smol.tokenizer, tp.old.ids[va:vb]) == tp.spec.value and vb <= a
    spec = build_pairs(load_suite([str(SUITES_DIR)], ids=["favourite_colour"]), 1, 0)[0]
    text, spans, prefix = render_prompt(smol.tokenizer, spec.instance, spec.old, chat_template=False, turns=1)
    (s, e), = spans["colour"]
    assert text[s:e] == spec.old and text.startswith("System: ") and "\nTool: {" in text
    assert text.endswith("\n" + prefix) and "<|im_start|>" not in text


def tok_text(tok, ids) -> str:
    return tok.decode(ids).strip()


def test_edited_transcripts_keep_the_cached_prefix_and_move_only_what_the_edit_names(smol):
    """The edit probe's prompts on a transcript: the erratum goes into the last user message (or the
    record's tool result), so everything before that message is the cached prompt's; the hoisted
    layout moves the record's exchange after the unrelated ones, which stay the same draws; the old
    value re-rendered without an edit is the pair's own prompt (the probe checks this)."""
    from kvnotes.harness.edit_prompts import erratum_text, edited_prompt, hoisted_pair

    tok = smol.tokenizer
    spec = build_pairs(load_suite([str(SUITES_DIR)], ids=["favourite_colour"]), 1, 0)[0]
    tp = tokenize_pair(tok, spec, turns=6)
    same = edited_prompt(tok, spec.instance, spec.old, tp.old, spec.variant, turns=6)
    assert torch.equal(same.prompt.ids, tp.old.ids) and same.reuse == tp.decision
    notice = erratum_text(spec.instance, spec.new)
    last_user = tp.old.text.rindex("<|im_start|>user")
    for placement in ("before_request", "before_decision"):
        ep = edited_prompt(tok, spec.instance, spec.old, tp.old, spec.variant, notice=notice, placement=placement,
                           turns=6)
        assert notice in ep.prompt.text and ep.prompt.text.rindex(notice) > last_user
        assert int(tp.old.offsets[ep.reuse - 1, 1]) >= last_user          # reused: everything before that message
        assert torch.equal(ep.prompt.ids[:tp.field[1]], tp.old.ids[:tp.field[1]]) and ep.prompt.field == tp.field
    after = edited_prompt(tok, spec.instance, spec.old, tp.old, spec.variant, notice=notice, placement="after_context",
                          turns=6)
    assert tp.field[1] <= after.reuse < tp.decision and after.prompt.text.index(notice) < last_user
    old_h, new_h = hoisted_pair(tok, spec.instance, spec.old, spec.new, spec.variant, turns=6)
    messages, spans, _ = render_transcript(spec.instance, spec.old, spec.variant, 6, hoist=True)
    flat, _, _ = render_transcript(spec.instance, spec.old, spec.variant, 6)
    assert messages[1:25] == flat[5:29] and messages[25:29] == flat[1:5] and messages[-1] == flat[-1]
    assert spans[spec.instance.scenario.field_slot][0][0] == 27                    # the field's tool result, moved
    assert len(old_h.ids) == len(tp.old.ids) and old_h.field[0] > tp.field[0] + 500
    assert new_h.reuse == old_h.field[0] and new_h.prompt.field == old_h.field
    with pytest.raises(ValueError):
        render_transcript(spec.instance, spec.old, spec.variant, 6, notice=notice, placement="nowhere")
