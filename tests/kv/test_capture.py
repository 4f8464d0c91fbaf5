"""Attention hooks: a hooked forward is numerically the unhooked one, recompute is exact, and the
original implementation runs alone again after the hook block (a dispatcher registered with the
public AttentionInterface.register, no private mapping touched)."""

from __future__ import annotations

import torch

from kvnotes.kv import capture
from kvnotes.kv.capture import attention_hook, capture_attention


def test_capture_is_transparent_and_recompute_exact(tiny):
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(20)[None]
    with torch.no_grad():
        ref = tiny(ids[None], position_ids=pos).logits
    layers, logprobs = capture_attention(tiny, ids)
    assert not any(capture._ACTIVE.values())     # no hook left active after the block
    assert len(layers) == tiny.config.num_hidden_layers
    with torch.no_grad():
        after = tiny(ids[None], position_ids=pos).logits
    assert torch.equal(ref, after)              # the same forward, same shapes, same machine: identical
    assert torch.allclose(logprobs, torch.log_softmax(ref[0, -1], -1), atol=1e-6)
    for la in layers:
        assert la.query.shape[1] == 4 and la.key.shape[1] == 2      # GQA not expanded
        assert torch.allclose(la.recompute(), la.output, atol=1e-6)


def test_wrapped_function_receives_keyword_arguments(tiny):
    seen = []

    def fn(base, module, query, key, value, attention_mask, **kwargs):
        seen.append(set(kwargs))
        return base(module, query, key, value, attention_mask, **kwargs)

    with attention_hook(tiny, fn), torch.no_grad():
        tiny(torch.arange(10)[None], position_ids=torch.arange(10)[None])
    assert seen and all({"dropout", "scaling"} <= s for s in seen)


def test_uniform_attention_would_be_detected(tiny):
    """A hook that breaks attention (e.g. a positional call that swaps scaling and dropout) must
    change the output: guards the transparency test above against a vacuous pass."""
    def broken(base, module, query, key, value, attention_mask, **kwargs):
        kwargs["scaling"] = 1e-9         # ~uniform attention over visible keys
        return base(module, query, key, value, attention_mask, **kwargs)

    ids = torch.arange(12)[None]
    with torch.no_grad():
        ref = tiny(ids, position_ids=ids).logits
        with attention_hook(tiny, broken):
            bad = tiny(ids, position_ids=ids).logits
    assert (ref - bad).abs().max() > 1e-4
