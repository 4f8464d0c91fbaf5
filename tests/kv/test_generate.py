"""The generated readout on every tiny architecture: zero new tokens is the direct readout; batched
decoding equals a per-variant loop token for token; a chain without its marker is excluded."""

from __future__ import annotations

import math

import pytest
import torch

from kvnotes.kv.generate import generate, token_marker
from kvnotes.kv import cache as kvcache
from tests.helpers import BATCH_TOL, VOCAB

T = 12
NEVER = token_marker([VOCAB + 5])          # a token id outside the vocabulary: never generated


def _prompts(V: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (V, T), generator=torch.Generator().manual_seed(seed))


def _batch_cache(model, prompts: torch.Tensor):
    """One batch-V windowed cache over ``[0, T-1)`` from per-prompt prefills (one copy)."""
    caches = [kvcache.prefill(model, p[:-1]) for p in prompts]
    keys = [torch.cat([c.layers[l].keys for c in caches]) for l in range(len(caches[0].layers))]
    values = [torch.cat([c.layers[l].values for c in caches]) for l in range(len(caches[0].layers))]
    return kvcache.cache_from_tensors(model.config, keys, values, T - 1), caches


def test_zero_new_tokens_is_the_direct_readout(tiny):
    prompts = _prompts(3)
    batch, caches = _batch_cache(tiny, prompts)
    out = generate(tiny, batch, prompts[:, -1], T - 1, max_new_tokens=0)
    assert all(c.reached and c.ids == [] for c in out.chains)
    for v, c in enumerate(caches):
        direct = kvcache.continuation_logprobs(tiny, kvcache.view(c, tiny.config), prompts[v, -1:], T - 1)[0, -1]
        assert (out.logprobs[v] - direct).abs().max() < BATCH_TOL
    assert kvcache.seq_length(batch) == T - 1                      # the variants' cache is left unchanged


def test_batched_chains_equal_a_per_variant_loop(tiny):
    # greedy tokens compared across batch shapes: seed 9 leaves no near-tie on any tiny architecture
    # (every step's top-1 leads the top-2 by >= 1.9e-3 nats, ~200x BATCH_TOL; seed 1 had 1.2e-5)
    prompts = _prompts(4, seed=9)
    batch, caches = _batch_cache(tiny, prompts)
    loop = [generate(tiny, c, prompts[v, -1], T - 1, 6, NEVER) for v, c in enumerate(caches)]
    both = generate(tiny, batch, prompts[:, -1], T - 1, 6, NEVER)
    assert [c.ids for c in both.chains] == [g.chains[0].ids for g in loop]
    assert all(len(c.ids) == 6 and not c.reached and c.stopped == "max_new_tokens" for c in both.chains)
    assert torch.isnan(both.logprobs).all()                        # unreached chains are never scored
    # a marker the loop's chain 0 emits at its third token: read right after it, as the loop reads it
    marker = token_marker(loop[0].chains[0].ids[2:3])
    again = generate(tiny, batch, prompts[:, -1], T - 1, 6, marker)
    first = next(i for i, t in enumerate(loop[0].chains[0].ids) if t == loop[0].chains[0].ids[2])
    assert again.chains[0].reached and again.chains[0].ids == loop[0].chains[0].ids[: first + 1]
    alone = generate(tiny, caches[0], prompts[0, -1], T - 1, 6, marker)
    assert (again.logprobs[0] - alone.logprobs[0]).abs().max() < BATCH_TOL * 10
    assert math.isfinite(float(again.logprobs[0].sum()))


def test_shared_prefix_is_not_copied_and_end_tokens_stop_unreached(tiny):
    prompts = _prompts(1, seed=2)
    prefix = kvcache.prefill(tiny, prompts[0, :-1])
    keys0 = prefix.layers[0].keys.clone()
    firsts = torch.tensor([3, 7, 11, 13])
    shared = generate(tiny, prefix, firsts, T - 1, 4, NEVER)
    for v, t in enumerate(firsts):
        one = generate(tiny, prefix, int(t), T - 1, 4, NEVER)
        assert shared.chains[v].ids == one.chains[0].ids
    assert kvcache.seq_length(prefix) == T - 1 and torch.equal(prefix.layers[0].keys, keys0)
    stop = shared.chains[1].ids[0]
    ended = generate(tiny, prefix, firsts, T - 1, 4, NEVER, stop_ids=[stop])
    assert ended.chains[1].stopped == "end_token" and not ended.chains[1].reached
    assert torch.isnan(ended.logprobs[1]).all()


def test_sampling_is_seeded_and_a_marker_test_is_required(tiny):
    prompts = _prompts(2, seed=3)
    batch, _ = _batch_cache(tiny, prompts)
    a = generate(tiny, batch, prompts[:, -1], T - 1, 5, NEVER, temperature=1.0, generator=torch.Generator().manual_seed(4))
    b = generate(tiny, batch, prompts[:, -1], T - 1, 5, NEVER, temperature=1.0, generator=torch.Generator().manual_seed(4))
    assert [c.ids for c in a.chains] == [c.ids for c in b.chains]
    with pytest.raises(ValueError, match="marker test"):
        generate(tiny, batch, prompts[:, -1], T - 1, 5)


def test_one_kv_head_and_sliding_window_shape():
    """The zoo's Gemma-3-270M shape (one KV head, a window shorter than prompt + chain): batched
    chains equal the per-variant loop."""
    from kvnotes.models.zoo import random_model, zoo_config

    model = random_model(zoo_config("gemma-3-270m"), seed=0)
    assert model.config.get_text_config().num_key_value_heads == 1
    prompts = _prompts(3, seed=5)
    batch, caches = _batch_cache(model, prompts)
    loop = [generate(model, c, prompts[v, -1], T - 1, 8, NEVER) for v, c in enumerate(caches)]
    both = generate(model, batch, prompts[:, -1], T - 1, 8, NEVER)
    assert [c.ids for c in both.chains] == [g.chains[0].ids for g in loop]
    zero = generate(model, batch, prompts[:, -1], T - 1, 0)
    direct = kvcache.continuation_logprobs(model, kvcache.view(caches[2], model.config), prompts[2, -1:], T - 1)[0, -1]
    assert (zero.logprobs[2] - direct).abs().max() < BATCH_TOL
