"""E1, the memory early vs late in a long prompt (probes/memory_placement.py): the two placements
hold the same tokens in another order, the document holds no user fact, the cached reading equals a
plain forward of the whole prompt, and the record's fields, on a tiny random Llama with the embedded
SmolLM2 tokenizer."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch

import kvnotes.probes
from kvnotes.harness import memory as mem
from kvnotes.ops.edit import stack
from kvnotes.probes.memory_placement import PLACEMENTS, document_entries, fit, placements
from tests.probes.test_memory import check_record_fields, fake_ctx, llama, prompt_of, suite, threads, tok  # noqa: F401

#: fp32 decision log-probs of a prefill plus a suffix forward on a batch-2 cache vs one plain forward
#: of the whole prompt (different forward shapes: BLAS blocking differs).
PLAIN_FORWARD_TOL = 1e-4


def _setup(tok, suite, target=96):  # noqa: F811
    p = prompt_of(tok, suite, target=target)
    doc = torch.cat(document_entries(tok, suite, suite.personas[0], target))
    return p, doc


def test_placements_hold_the_same_tokens_in_another_order(tok, suite):  # noqa: F811
    p, doc = _setup(tok, suite)
    ids = placements(p, doc)
    early, late = ids["early"], ids["late"]
    assert early.shape == late.shape and not torch.equal(early, late)
    assert Counter(early.tolist()) == Counter(late.tolist())
    assert torch.equal(early[:p.start], p.prefix) and torch.equal(late[:p.start], p.prefix)
    M = p.memory.shape[0]
    assert torch.equal(early[p.start:p.start + M], p.memory) and torch.equal(late[-M:], p.memory)
    assert doc.shape[0] >= 96
    text = tok.decode(doc)
    for f in suite.personas[0].facts:                            # the document carries no user fact
        assert f.render() not in text
    assert "Profile" not in text


def test_fit_keeps_whole_lines_within_the_budget():
    entries = tuple(torch.zeros(n, dtype=torch.long) for n in (5, 7, 6))
    assert [e.shape[0] for e in fit(entries, 12)] == [5, 7]
    assert [e.shape[0] for e in fit(entries, 11)] == [5]
    assert fit(entries, 4) == ()


@torch.no_grad()
def test_reading_equals_a_plain_forward_of_the_whole_prompt(llama, tok, suite):  # noqa: F811
    p, doc = _setup(tok, suite)
    ids = placements(p, doc)
    pos = int(ids["early"].shape[0])
    batch = stack([mem.prefill(llama, ids[name])[0] for name in PLACEMENTS], pos)
    for q in list(p.queries.values())[:3]:
        lps = mem.read(llama, batch, pos, q.suffix)
        for i, name in enumerate(PLACEMENTS):
            whole = torch.cat([ids[name], q.suffix]).unsqueeze(0)
            ref = torch.log_softmax(llama(input_ids=whole).logits[0, -1].float(), -1)
            assert (lps[i] - ref).abs().max() < PLAIN_FORWARD_TOL, (q.id, name)


def test_probe_record_on_a_tiny_model(llama, tok, tmp_path):  # noqa: F811
    bundle = SimpleNamespace(model=llama, tokenizer=tok)
    res = kvnotes.probes.get("memory_placement")(fake_ctx("memory_placement", bundle, lengths=[96]))
    check_record_fields("memory_placement", res, ["late"], tmp_path)
    assert res["placements"] == ["early", "late"]
    assert len(res["rows"]) == 2 * 7 and set(res["aggregates"]) == {"96"}
    agg = res["aggregates"]["96"]
    assert set(agg["by_depth"]) == {"1", "2"} and set(res["tests"]) == {"96/depth=1", "96/depth=2"}
    assert agg["by_depth"]["2"]["accuracy_early"]["n"] == 2 and agg["by_depth"]["1"]["accuracy_late"]["n"] == 12
    for r in res["rows"]:
        assert r["depth"] == (2 if r["query"] in {"sister_city", "brother_city"} else 1)
        assert r["document_tokens"] >= 96 and r["prompt_tokens"] > r["memory_tokens"] + r["document_tokens"]
    for c in res["costs"]:
        assert set(c["prefill_s"]) == {"early", "late"}
    s = res["settings"]
    assert s["reference"] == "early" and s["arm"] == "late" and s["context"] == 4096
    from kvnotes.probes.memory_placement import memory_placement_table
    rec = {"probe": "memory_placement", "model": {"name": "tiny"}, "result": res}
    text = memory_placement_table(rec)
    assert "| 96 (" in text and "depth" in text
