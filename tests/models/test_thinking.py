"""Thinking models (issue #20 item 3): ``model.thinking`` renders through the chat template's thinking
switch, the decision is read only after the closing think tag, and a chain cut inside the think block
is excluded with its own reason. The template is a Qwen3-style one written here (the Qwen3 tokenizer
is not available offline), on the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

from kvnotes.kv.generate import Chain, answer_marker, generate, stop_tokens, unreached_reason
from kvnotes.models.text import THINK_OPEN, render_text, thinking_kwargs
from tests.helpers import tiny_config

#: Qwen3's generation prompt, reduced to what the switch changes: thinking off pre-fills an empty
#: think block; thinking on leaves the block to the model.
QWEN3_STYLE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n"
               "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
               "{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from kvnotes.models.loading import load_tokenizer
    from kvnotes.models.zoo import zoo_config

    t = copy.deepcopy(load_tokenizer(zoo_config("smollm2-135m")))
    t.chat_template = QWEN3_STYLE
    return t


def test_thinking_switch_maps_to_the_template_argument():
    assert thinking_kwargs(None, None) == {}
    assert thinking_kwargs({"x": 1}, True) == {"x": 1, "enable_thinking": True}
    assert thinking_kwargs({"enable_thinking": True}, False) == {"enable_thinking": False}


def test_the_zoo_exposes_the_switch():
    from kvnotes.harness.pairs import template_kwargs
    from kvnotes.models.zoo import zoo_config

    cfg = zoo_config("qwen3-8b")
    assert cfg.thinking is False and template_kwargs(cfg) == {"enable_thinking": False}
    cfg.thinking = True
    assert template_kwargs(cfg) == {"enable_thinking": True}
    assert template_kwargs(zoo_config("smollm2-135m")) == {}


def test_rendering_opens_the_think_block_only_when_thinking(tok):
    on, _ = render_text(tok, "Where does Ana live?", "Let me check.", template_kwargs={"enable_thinking": True})
    off, _ = render_text(tok, "Where does Ana live?", "Let me check.", template_kwargs={"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n" + THINK_OPEN + "Let me check.")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.")
    assert on.count("<think>") == 1 and off.count("<think>") == 1


def test_the_decision_is_read_only_after_the_closing_tag(tok):
    enc = lambda s: tok(s, add_special_tokens=False).input_ids          # noqa: E731
    test = answer_marker(tok, "lives in", thinking=True)
    assert not test(enc("Ana lives in"))                                 # inside the think block
    assert not test(enc("She said Ana lives in</think>"))               # marker before the tag
    assert test(enc("Ana lives in Porto?</think>\n\nAna lives in"))
    assert answer_marker(tok, "lives in")(enc("Ana lives in"))          # thinking off: as before
    chain = Chain(enc("Ana lives in Porto, or"), False, "max_new_tokens")
    assert unreached_reason(tok, chain, thinking=True) == "truncated_in_think"
    assert unreached_reason(tok, Chain(enc("x</think> no marker"), False, "max_new_tokens"), thinking=True) \
        == "no_answer_marker"
    assert unreached_reason(tok, chain, thinking=False) == "no_answer_marker"
    assert unreached_reason(tok, Chain([], True, "marker"), thinking=True) is None


def test_a_chain_cut_inside_the_think_block_is_never_scored(tok):
    """A random model never closes its think block within 6 tokens: the chain is unreached (its
    decision row is NaN) and the reason is the think block, not a missing marker."""
    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    text, _ = render_text(tok, "Where does Ana live?", "", template_kwargs={"enable_thinking": True})
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids)
    from kvnotes.kv.cache import AllSlotCache

    d = len(ids) - 1
    gen = generate(model, AllSlotCache.prefill(model, ids[:d]), int(ids[d]), d, 6,
                   answer_marker(tok, "lives in", thinking=True), stop_tokens(tok))
    chain = gen.chains[0]
    assert not chain.reached and chain.length == 6 and torch.isnan(gen.logprobs[0]).all()
    assert unreached_reason(tok, chain, thinking=True) == "truncated_in_think"


def test_thinking_without_the_cot_variant_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from tests.cli.test_cli import one_line_error, run_main

    proc = run_main(monkeypatch, capsys, "model=smollm2-135m", "model.thinking=true", "probe=screen", "scenario=small",
                    f"out_root={tmp_path}")
    one_line_error(proc, "model.thinking=true", "scenario.variant=cot")
