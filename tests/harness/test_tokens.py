"""Rendering, tokenisation and span location on the embedded model's tokenizer and chat template."""

from __future__ import annotations

import pytest
import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness.tokens import UNEQUAL_FIELD_LENGTH, char_span_to_tokens, tokenize, tokenize_pair
from kvnotes.scenarios import build_pairs
from kvnotes.scenarios.schema import validate

BASE = {
    "family": "recall", "domain": "test", "field": {"slot": "colour", "values": ["red", "blue"]},
    "candidates": {"red": " red", "blue": " blue"}, "slots": {"name": ["Ana", "Bo", "Cy"]},
    "context": "Profile of {name}. Colour: {colour}.", "filler": ["One.", "Two.", "Three."], "n_filler": 2,
    "rule": "Repeat details exactly.", "request": "What is the colour?",
    "variants": {"direct": {"decision": "Reply with the colour only.", "answer_prefix": "The colour is"}},
}


def scenario(**over):
    raw = {**BASE, **over}
    return validate(raw, "test.yaml")


def test_field_span_decodes_to_the_value_and_pair_is_aligned(smol):
    tok = smol.tokenizer
    spec = build_pairs([scenario()], 1, 0)[0]
    tp = tokenize_pair(tok, spec)
    a, b = tp.field
    assert tok.decode(tp.old.ids[a:b]).strip() == "red" and tok.decode(tp.new.ids[a:b]).strip() == "blue"
    assert torch.equal(tp.old.ids[:a], tp.new.ids[:a]) and torch.equal(tp.old.ids[b:], tp.new.ids[b:])
    assert tp.decision == len(tp.old.ids) - 1 and tp.downstream == (b, tp.decision)
    assert tp.old.text.startswith("<|im_start|>system") and tp.old.text.endswith("<|im_start|>assistant\nThe colour is")


def test_bos_exactly_once(smol):
    tok = smol.tokenizer
    tp = tokenize_pair(tok, build_pairs([scenario()], 1, 0)[0])
    assert int(tp.old.ids[0]) == tok.bos_token_id and int(tp.old.ids[1]) != tok.bos_token_id
    ids, _ = tokenize(tok, "hello there")          # text without BOS: the tokenizer's own rule
    assert (ids == tok.bos_token_id).sum() <= 1


def test_candidates_tokenised_in_context_keep_the_leading_space(smol):
    tok = smol.tokenizer
    tp = tokenize_pair(tok, build_pairs([scenario()], 1, 0)[0])
    assert tok.convert_ids_to_tokens([tp.cand_old[0], tp.cand_new[0]]) == ["Ġred", "Ġblue"]


def test_unequal_field_length_is_excluded(smol):
    sc = scenario(field={"slot": "colour", "values": ["red", "ultramarine-ish"]},
                  candidates={"red": " red", "ultramarine-ish": " ultramarine"})
    assert tokenize_pair(smol.tokenizer, build_pairs([sc], 1, 0)[0]) == UNEQUAL_FIELD_LENGTH


def test_char_span_to_tokens_overlap_rule():
    offsets = torch.tensor([[0, 0], [0, 3], [3, 7], [7, 8]])   # a special token then three tokens
    assert char_span_to_tokens(offsets, 4, 6) == (2, 3)
    assert char_span_to_tokens(offsets, 2, 4) == (1, 3)
    with pytest.raises(KvnotesError):
        char_span_to_tokens(offsets, 20, 22)


def test_instances_vary_surface_content_and_are_seeded():
    from kvnotes.scenarios import draw_instances

    sc = scenario()
    a, b = draw_instances(sc, 3, seed=0), draw_instances(sc, 3, seed=0)
    assert a == b
    assert len({i.slots for i in a}) == 3                       # names drawn without replacement
    assert draw_instances(sc, 3, seed=1) != a
