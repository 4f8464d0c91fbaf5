"""EditRunner (kvnotes.ops.edit_runner, eager on CPU): every edit as one forward on a reused pool
gives the K/V and decision of kvnotes.ops.edit's eager operations, on tiny architectures without
sliding windows, a one-KV-head one included."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit
from kvnotes.ops.edit_runner import EditRunner
from tests.helpers import VOCAB, build_tiny
from tests.ops.test_edit import FIELD, TOL, kv_diff, tiny_pair

D = 20


def one_kv_head():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=1, max_position_embeddings=256, num_hidden_layers=3)
    return T.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["llama", "qwen3", "one_kv_head"])
def model(request):
    return one_kv_head() if request.param == "one_kv_head" else build_tiny(request.param)


def decision(model, cache, token, pos):
    return edit.decision_logprobs(model, cache, int(token), pos)


def pool_view(pool, n):
    """The pool's first ``n`` positions as an all-slot cache (copies, so the next call cannot change it)."""
    view = pool.all_slot_view(n)
    return AllSlotCache.from_tensors([l.keys.clone() for l in view.layers], [l.values.clone() for l in view.layers])


@torch.no_grad()
def test_each_edit_equals_the_eager_operation(model):
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(model, old[:D])
    before = [l.keys.clone() for l in stale.layers]
    runner = EditRunner(model, 48)
    a, b = FIELD
    refreshed = edit.refresh_field(model, stale, new, FIELD)
    pool, _ = runner.refresh_field(stale, new, FIELD)
    got = pool_view(pool, D)
    assert int(pool.get_seq_length()) == D
    assert kv_diff(got, refreshed.cache, D) < TOL
    assert float((decision(model, got, new[D], D) - decision(model, refreshed.cache, new[D], D)).abs().max()) < TOL
    # the refresh changed the field's K/V (the check can fail) and left the stale cache alone
    assert kv_diff(got, stale, D) > 10 * TOL
    assert all(torch.equal(k, l.keys) for k, l in zip(before, stale.layers))

    # an erratum appended after position 14 (the eager op on the old prompt; the runner the same)
    erratum = torch.cat([old[:14], new[a:b], old[14:D + 1]])
    de = len(erratum) - 1
    ext = edit.extend_from(model, stale, erratum, 14, de)
    pool, logits = runner.extend_from(stale, erratum, 14, de)
    assert kv_diff(pool_view(pool, de), ext.cache, de) < TOL and int(pool.get_seq_length()) == de
    ref_logits = model(erratum[de - 1:de].view(1, -1), past_key_values=AllSlotCache.from_tensors(
        [l.keys[:, :, :de - 1] for l in ext.cache.layers], [l.values[:, :, :de - 1] for l in ext.cache.layers]),
        position_ids=torch.tensor([[de - 1]])).logits[:, -1]
    assert float((logits - ref_logits).abs().max()) < TOL

    # field refresh plus erratum in one forward = refresh, then extend
    both = edit.extend_from(model, refreshed.cache, torch.cat([new[:14], new[a:b], old[14:D + 1]]), 14, de)
    pool, _ = runner.extend_from(stale, torch.cat([new[:14], new[a:b], old[14:D + 1]]), 14, de, field=FIELD)
    assert kv_diff(pool_view(pool, de), both.cache, de) < TOL

    # selective recompute of scattered downstream positions (runs of 1 and 2) after the refresh
    picks = [9, 12, 13, 18]
    sel = edit.selective(model, refreshed, new, picks)
    pool, _ = runner.selective(stale, new, FIELD, picks)
    assert kv_diff(pool_view(pool, D), sel.cache, D) < TOL
    assert kv_diff(pool_view(pool, D), refreshed.cache, D) > 10 * TOL      # the picks did change


def test_bad_requests_are_refused():
    model = build_tiny("llama")
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(model, old[:D])
    runner = EditRunner(model, 24)
    with pytest.raises(ValueError, match="at least one"):
        runner.recompute(stale, D, new, [])
    with pytest.raises(ValueError, match="without a gap"):
        runner.recompute(stale, 10, new, [12, 13])
    with pytest.raises(ValueError, match="holds"):
        runner.recompute(stale, D + 1, new, [3])
    with pytest.raises(ValueError, match="pool"):
        runner.extend_from(stale, torch.arange(30) % VOCAB, D, 30)
    with pytest.raises(ValueError, match="sliding"):
        EditRunner(build_tiny("gemma3"), 24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("name", ["qwen3", "one_kv_head"])
@torch.no_grad()
def test_graph_replays_equal_the_eager_operations_on_cuda(name):
    """On CUDA (fp32): the captured graphs (EditRunner's edits, ComposeRunner's composition), replayed
    on a second call with other token ids, give what the eager operations give."""
    from kvnotes.ops import compose

    model = (one_kv_head() if name == "one_kv_head" else build_tiny(name)).cuda()
    runner = EditRunner(model, 48, graphs=True)
    assert runner.runner.graphs
    for seed in (0, 1):                    # the first call captures, the second replays
        old, new = (x.cuda() for x in tiny_pair(seed))
        stale = AllSlotCache.prefill(model, old[:D])
        refreshed = edit.refresh_field(model, stale, new, FIELD)
        pool, _ = runner.refresh_field(stale, new, FIELD)
        assert kv_diff(pool_view(pool, D), refreshed.cache, D) < TOL
        assert kv_diff(pool_view(pool, D), stale, D) > 10 * TOL
        sel = edit.selective(model, refreshed, new, [9, 12, 13, 18])
        pool, _ = runner.selective(stale, new, FIELD, [9, 12, 13, 18])
        assert kv_diff(pool_view(pool, D), sel.cache, D) < TOL
    comp = compose.ComposeRunner(model, 48, graphs=True)
    chunk = compose.precompile(model, torch.arange(5, 17, device="cuda") % VOCAB)
    for seed in (0, 1):
        prefix, suffix = (torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + n)).cuda()
                          for n in (4, 3))
        _, got = comp([prefix, chunk, suffix], True, 2)
        _, ref = compose.compose_one_pass(model, [prefix, chunk, suffix], True, 2)
        assert float((got - ref).abs().max()) < TOL
