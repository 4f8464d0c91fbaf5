"""Head patches and head knockouts in the mask vocabulary (:func:`kvnotes.kv.masks.site_masks`):
every readout path against K/V caches edited by hand, head by head, on tiny random GQA models
(4 query heads on 2 KV heads) whose prompts pass the sliding window."""

from __future__ import annotations

import pytest
import torch

from kvnotes.kv import cache as kvcache
from kvnotes.kv import knockout as kvknock
from kvnotes.kv import masks as kvmasks
from kvnotes.kv import patch as kvpatch
from tests.helpers import LOGPROB_TOL, VOCAB, WINDOW

T = 3 * WINDOW
#: A head's effect must exceed the tolerance by this factor for the comparisons to mean anything.
EFFECT = 10 * LOGPROB_TOL
FIELD = range(T - 6, T - 1)      # inside the sliding window of the fed tokens


def _runs(model):
    g = torch.Generator().manual_seed(7)
    old = torch.randint(0, VOCAB, (T + 2,), generator=g)
    new = old.clone()
    new[FIELD.start: FIELD.stop] = (old[FIELD.start: FIELD.stop] + 1) % VOCAB
    return old, kvcache.prefill(model, old[:T]), kvcache.prefill(model, new[:T])


def _by_hand(model, c_old, c_new, positions, layers, head) -> kvcache.DynamicCache:
    """The old cache with ``head``'s K/V at ``positions`` of ``layers`` copied from the new run."""
    keys, values = [], []
    for l, (lo, ln) in enumerate(zip(c_old.layers, c_new.layers)):
        k, v = lo.keys.clone(), lo.values.clone()
        if l in layers:
            slots = [i for i, p in enumerate(kvcache.slot_positions(lo).tolist()) if p in positions]
            k[:, head, slots], v[:, head, slots] = ln.keys[:, head, slots], ln.values[:, head, slots]
        keys.append(k)
        values.append(v)
    return kvcache.cache_from_tensors(model.config, keys, values, T)


def test_site_masks_name_positions_layers_and_heads():
    """A site without heads acts on every head (and equals its dense mask); with heads, only on those."""
    m = kvmasks.site_masks(3, 10, [([1, 2], None), ([4], [1], [1]), ([5], [0, 2], [])], kv_heads=2)
    assert m.shape == (3, 3, 10)
    assert torch.equal(kvmasks.head_layer_mask(m, 1, 2)[1], torch.tensor([[False] * 10, [i == 4 for i in range(10)]]))
    assert not kvmasks.head_layer_mask(m, 0, 2)[2].any() and not kvmasks.head_layer_mask(m, 1, 2)[1, 0].any()
    assert kvmasks.head_layer_mask(m, 2, 2)[0].sum() == 4
    plain = kvmasks.site_masks(3, 10, [([1, 2], None)])
    assert plain.heads is None and torch.equal(plain.dense(), kvpatch.position_masks(3, 10, [[1, 2]]))
    with pytest.raises(ValueError):
        m.dense()
    with pytest.raises(ValueError):
        kvmasks.site_masks(3, 10, [([1], None, [0])])
    with pytest.raises(ValueError):
        kvmasks.head_layer_mask(m, 0, 4)
    for bad in [([-1], None), ([10], None), ([1], [3]), ([1], None, [2])]:
        with pytest.raises(ValueError, match="outside"):
            kvmasks.site_masks(3, 10, [bad], kv_heads=2)


@pytest.mark.parametrize("method", ["shared", "substitute"])
def test_head_patches_equal_caches_edited_by_hand(tiny, method):
    """Each KV head's patch, by both readout paths and by build_variants, equals decoding on the old
    cache with that head's field K/V copied from the new run by hand; every head together equals the
    position patch; no head equals the old run. Each head moves the decision, and differently from
    every head together."""
    model = tiny
    if method == "shared" and model.config._attn_implementation not in kvpatch.SHARED_PREFIX_ATTENTION:
        pytest.skip("the shared prefix needs sdpa or eager attention")
    old, c_old, c_new = _runs(model)
    n_layers, kvh = len(c_old.layers), c_old.layers[0].keys.shape[1]
    assert kvh == 2 and model.config.num_attention_heads == 4
    band = range(1, n_layers)
    sites = [(FIELD, band, [h]) for h in range(kvh)] + [(FIELD, band, list(range(kvh))), (FIELD, band, [])]
    masks = kvmasks.site_masks(n_layers, T, sites, kv_heads=kvh)
    got = torch.log_softmax(kvpatch.patched_logits(model, c_old, c_new, masks, old[T:], method=method), -1)
    built = kvcache.build_variants(model.config, c_old, c_new, masks)
    from_built = kvcache.continuation_logprobs(model, built, old[T:], T)
    plain = kvpatch.patched_logprobs(model, c_old, c_new, kvpatch.position_masks(n_layers, T, [FIELD], band), old[T:])
    clean = kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), old[T:], T)[0]
    for h in range(kvh):
        ref = kvcache.continuation_logprobs(model, _by_hand(model, c_old, c_new, set(FIELD), set(band), h),
                                            old[T:], T)[0]
        assert torch.allclose(got[h], ref, atol=LOGPROB_TOL)
        assert torch.allclose(from_built[h], ref, atol=LOGPROB_TOL)
        assert (ref - clean).abs().max() > EFFECT and (ref - plain[0]).abs().max() > EFFECT
    assert torch.allclose(got[kvh], plain[0], atol=LOGPROB_TOL)
    assert torch.allclose(got[kvh + 1], clean, atol=LOGPROB_TOL)


def test_head_knockouts_agree_across_paths(tiny):
    """A head knockout of the decision row: the shared prefix (its per-KV-head additive masks) equals
    the decision-row hook on the cache (a per-query-head mask), every head equals the position
    knockout, no head the clean row, and one head lies strictly between."""
    model = tiny
    if model.config._attn_implementation not in kvpatch.SHARED_PREFIX_ATTENTION:
        pytest.skip("knockouts need sdpa or eager attention")
    old, c_old, _ = _runs(model)
    n_layers, kvh = len(c_old.layers), c_old.layers[0].keys.shape[1]
    keys = range(0, T - 2)            # most of the prefix: a visible effect on a random model
    sites = [(keys, None, [h]) for h in range(kvh)] + [(keys, None, list(range(kvh))), (keys, None, [])]
    knock = kvmasks.site_masks(n_layers, T, sites, kv_heads=kvh)
    shared = kvknock.decision_forward(model, c_old, old[T:T + 1], knock).logprobs[:, -1]
    gen, _ = kvknock.generate_knocked(model, c_old, int(old[T]), 0, None, knock=knock)
    by_hook = gen.logprobs
    position = kvknock.decision_forward(model, c_old, old[T:T + 1],
                                        kvmasks.site_masks(n_layers, T, [(keys, None)])).logprobs[0, -1]
    clean = kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), old[T:T + 1], T)[0, -1]
    assert torch.allclose(shared, by_hook.to(shared.dtype), atol=LOGPROB_TOL)
    assert torch.allclose(shared[kvh], position, atol=LOGPROB_TOL)
    assert torch.allclose(shared[kvh + 1], clean, atol=LOGPROB_TOL)
    for h in range(kvh):
        assert (shared[h] - clean).abs().max() > EFFECT and (shared[h] - position).abs().max() > EFFECT
