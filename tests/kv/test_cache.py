"""Cache-surgery invariants on tiny random models of every supported architecture (docs/design.md §4).

Prompts are longer than the sliding window, so sliding layers hold fewer slots than positions and
an off-by-one in the slot <-> position map changes the numbers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvnotes.kv import cache as kvcache

from kvnotes.kv import patch as kvpatch
from tests.helpers import BATCH_TOL, LOGPROB_TOL, VOCAB, WINDOW

T = 3 * WINDOW            # prefix length
FIELD = (5, 8)            # field span [a, b)
TOL = LOGPROB_TOL


def prompts(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, VOCAB, (T + 1,), generator=g)
    new = old.clone()
    new[FIELD[0]:FIELD[1]] = (old[FIELD[0]:FIELD[1]] + 1 + torch.randint(0, VOCAB - 1, (FIELD[1] - FIELD[0],), generator=g)) % VOCAB
    return old, new


def full_logprobs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None])
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def reference_patched(model, old_ids, new_ids, mask):
    """Independent reference: full-length caches without config (slot == position), patched by
    direct indexing; the model's sliding masks are position-based, so window semantics hold."""
    with torch.no_grad():
        caches = []
        for ids in (old_ids, new_ids):
            c = DynamicCache()
            model(input_ids=ids[None, :T], position_ids=torch.arange(T)[None], past_key_values=c, use_cache=True)
            caches.append(c)
        c_old, c_new = caches
        for l, (lo, ln) in enumerate(zip(c_old.layers, c_new.layers)):
            pos = mask[l].nonzero().flatten()
            lo.keys[:, :, pos] = ln.keys[:, :, pos]
            lo.values[:, :, pos] = ln.values[:, :, pos]
        out = model(input_ids=old_ids[None, T:], position_ids=torch.tensor([[T]]), past_key_values=c_old,
                    attention_mask=torch.ones(1, T + 1, dtype=torch.long))
    return torch.log_softmax(out.logits[0, -1].float(), -1)


@pytest.fixture(scope="module")
def caches(tiny):
    old, new = prompts()
    return tiny, old, new, kvcache.prefill(tiny, old[:T]), kvcache.prefill(tiny, new[:T])


def test_sliding_layers_hold_fewer_slots_than_positions(caches):
    model, old, new, c_old, _ = caches
    assert kvcache.seq_length(c_old) == T
    sliding = [l for l in c_old.layers if getattr(l, "is_sliding", False)]
    if model.config.model_type in ("mistral", "gemma2", "gemma3_text"):
        assert sliding and all(l.keys.shape[-2] == WINDOW - 1 for l in sliding)
        assert torch.equal(kvcache.slot_positions(sliding[0]), torch.arange(T - WINDOW + 1, T))
    else:
        assert not sliding


def test_decode_on_prefix_cache_equals_full_forward(caches):
    model, old, _, c_old, _ = caches
    lp = kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), old[T:], T)[0, -1]
    assert torch.allclose(lp, full_logprobs(model, old), atol=TOL)


def test_view_leaves_source_cache_unchanged(caches):
    model, old, _, c_old, _ = caches
    before = [l.keys.clone() for l in c_old.layers]
    kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), old[T:], T)
    assert all(torch.equal(b, l.keys) for b, l in zip(before, c_old.layers))
    assert kvcache.seq_length(c_old) == T


def test_patch_all_none_and_prefix(caches):
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    masks = kvpatch.position_masks(L, T, [list(range(T)), [], list(range(FIELD[0])), list(range(FIELD[0], T))])
    lp = kvpatch.patched_logprobs(model, c_old, c_new, masks, old[T:])[:, 0]
    ref_old, ref_new = full_logprobs(model, old), full_logprobs(model, new)
    assert torch.allclose(lp[0], ref_new, atol=TOL)          # everything patched = the new run
    assert torch.allclose(lp[1], ref_old, atol=TOL)          # nothing patched = the old run
    # positions before the field change nothing (rows of one batch: equal up to kernel rounding)
    assert torch.allclose(lp[2], lp[1], atol=BATCH_TOL)
    assert torch.allclose(lp[3], ref_new, atol=TOL)          # field + downstream = everything that differs
    assert (ref_new - ref_old).abs().max() > 1e-3            # the pair actually differs


@pytest.mark.parametrize("positions", [[FIELD[0]], [T - 1], [T - WINDOW + 1], [T - WINDOW], [FIELD[1], T - 2]])
def test_single_positions_match_independent_reference(caches, positions):
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    masks = kvpatch.position_masks(L, T, [positions])
    lp = kvpatch.patched_logprobs(model, c_old, c_new, masks, old[T:])[0, 0]
    assert torch.allclose(lp, reference_patched(model, old, new, masks[0]), atol=TOL)


def test_layer_patches_match_reference_and_differ_by_layer(caches):
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    down = list(range(FIELD[0], T))
    masks = torch.cat([kvpatch.position_masks(L, T, [down], layers=[l]) for l in range(L)])
    lp = kvpatch.patched_logprobs(model, c_old, c_new, masks, old[T:])[:, 0]
    for l in range(L):
        assert torch.allclose(lp[l], reference_patched(model, old, new, masks[l]), atol=TOL)
    # the reference is sensitive to the layer index: at least two layers' patches give different
    # results (layer 0's downstream KV never differs: it depends only on each position's token)
    assert max((lp[i] - lp[j]).abs().max() for i in range(L) for j in range(L)) > 1e-4


def test_batched_equals_unbatched_and_chunking(caches):
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    sets = [[p] for p in range(T)] + [list(range(FIELD[0], T))]
    masks = kvpatch.position_masks(L, T, sets)
    big = kvpatch.patched_logprobs(model, c_old, c_new, masks, old[T:])
    one = kvpatch.patched_logprobs(model, c_old, c_new, masks, old[T:], budget_bytes=1)  # chunks of 1
    assert torch.allclose(big, one, atol=BATCH_TOL)
    singles = torch.cat([kvpatch.patched_logprobs(model, c_old, c_new, masks[i:i + 1], old[T:]) for i in range(3)])
    assert torch.allclose(big[:3], singles, atol=BATCH_TOL)


def test_multi_token_continuation_matches_full_forward(caches):
    model, old, _, c_old, _ = caches
    tail = torch.tensor([int(old[T]), 3, 7])
    lp = kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), tail, T)[0]
    ids = torch.cat([old[:T], tail])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids[None], position_ids=torch.arange(len(ids))[None]).logits[0, T:].float(), -1)
    assert torch.allclose(lp, ref, atol=TOL)


def test_mask_shape_mismatch_raises(caches):
    model, old, _, c_old, c_new = caches
    with pytest.raises(ValueError):
        kvcache.build_variants(model.config, c_old, c_new, torch.zeros(1, len(c_old.layers), T - 1, dtype=torch.bool))


def test_shared_prefix_decode_matches_materialised_variant_caches(caches):
    """The cache-free shared-prefix path (sparse patches, :class:`kvnotes.kv.patch.SharedPrefix`)
    gives the logits of the materialised variant caches, for a teacher-forced continuation too
    (sliding windows, soft-capping, GQA); candidate-only logits are those columns of the full ones."""
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    masks = kvpatch.position_masks(L, T, [[p] for p in range(T)] + [[FIELD[0], T - 1], []])
    tail = torch.cat([old[T:], new[FIELD[0]:FIELD[0] + 2]])                 # 3 fed tokens
    got = kvpatch.patched_logits(model, c_old, c_new, masks, tail, method="shared")
    ref = kvcache.continuation_logprobs(model, kvcache.build_variants(model.config, c_old, c_new, masks), tail, T)
    assert torch.allclose(torch.log_softmax(got, -1), ref, atol=TOL)
    for method in ("shared", "substitute"):
        cand = kvpatch.patched_logits(model, c_old, c_new, masks, tail, vocab_ids=[3, 11], method=method)
        assert torch.allclose(cand, got[..., [3, 11]], atol=TOL)
    # chunked (budget of one variant cache) = one chunk
    one = kvpatch.patched_logits(model, c_old, c_new, masks, tail, budget_bytes=1, method="shared")
    assert torch.allclose(one, got, atol=BATCH_TOL)
    # a call mixing sparse variants and a dense one (every position, every layer) routes each to its
    # path and keeps the order of the masks
    dense = torch.cat([masks[:3], torch.ones(1, L, T, dtype=torch.bool), masks[3:5]])
    mixed = kvpatch.patched_logits(model, c_old, c_new, dense, tail)        # auto
    mixed_shared = kvpatch.patched_logits(model, c_old, c_new, dense, tail, method="shared")
    assert torch.allclose(mixed_shared, mixed, atol=TOL)
    assert torch.allclose(mixed[[0, 1, 2, 4, 5]], got[:5], atol=TOL)
    ref_dense = kvcache.continuation_logprobs(model, kvcache.view(c_new, model.config), tail, T)[0]
    assert torch.allclose(torch.log_softmax(mixed[3], -1), ref_dense, atol=TOL)
    # patching nothing = the old run's own continuation
    plain = kvcache.continuation_logprobs(model, kvcache.view(c_old, model.config), tail, T)[0]
    assert torch.allclose(torch.log_softmax(got[-1], -1), plain, atol=TOL)


def test_auto_runs_variants_cache_free_on_a_long_prefix(monkeypatch):
    """On a prefix long enough for chunks of MIN_SHARED_CHUNK, auto runs every variant (single
    positions and a dense one: each substituted slot enters the keys once) on the shared prefix,
    with the batch-view path's numbers; with many fed tokens per variant it takes the batch view."""
    from tests.helpers import build_tiny

    model = build_tiny("llama")
    g = torch.Generator().manual_seed(3)
    old = torch.randint(0, VOCAB, (81,), generator=g)
    new = old.clone()
    new[5:8] = (old[5:8] + 1) % VOCAB
    c_old, c_new = kvcache.prefill(model, old[:80]), kvcache.prefill(model, new[:80])
    L = len(c_old.layers)
    masks = torch.cat([kvpatch.position_masks(L, 80, [[p] for p in range(40)]), torch.ones(1, L, 80, dtype=torch.bool)])
    used = []
    real = kvpatch.SharedPrefix.__init__
    monkeypatch.setattr(kvpatch.SharedPrefix, "__init__", lambda self, *a: used.append(a[2].shape[0]) or real(self, *a))
    auto = kvpatch.patched_logits(model, c_old, c_new, masks, old[80:], vocab_ids=[1, 2])
    ref = kvpatch.patched_logits(model, c_old, c_new, masks, old[80:], vocab_ids=[1, 2], method="substitute")
    assert used == [41]                                      # one cache-free forward, the dense variant too
    assert torch.allclose(auto, ref, atol=TOL)
    assert kvpatch.shared_prefix_chunk(masks, c_old, 1) == 2 * 80 + 3 - 80     # every slot substituted somewhere
    used.clear()
    many = torch.cat([old[80:], new[:30]])                   # 31 fed tokens: chunks of (160 + 93 - 80) // 31 = 5
    kvpatch.patched_logits(model, c_old, c_new, masks, many, vocab_ids=[1, 2])
    assert used == []


def test_a_long_prompt_on_a_gpu_budget_keeps_the_map_cache_free():
    """At 8,251 tokens one Qwen3-8B-shaped bf16 variant cache takes 1.2 GB: under a fixed 1 GiB budget
    the single-position map ran one variant per batch-view forward (found on an H200: ``suffix_recovery``
    did not finish one pair in 45 s). ``budget_mb: auto`` gives a GPU a quarter of its free memory,
    under which the map runs cache-free in chunks of thousands of variants; the CPU keeps 1 GiB.
    Shapes only (a meta-device cache)."""
    from transformers import Qwen3Config

    layers, heads, kv_heads, hd, t = 36, 32, 8, 128, 8251
    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd)
    base = DynamicCache(config=config)
    for layer in range(layers):
        kv = torch.empty(1, kv_heads, t, hd, dtype=torch.bfloat16, device="meta")
        base.update(kv, kv, layer)
    assert kvcache.variant_bytes(base) > kvcache.DEFAULT_BUDGET_BYTES
    masks = kvpatch.position_masks(layers, t, [[p] for p in range(t - 64, t)])      # 64 single-position variants
    assert kvpatch.variant_chunks(config, "sdpa", base, masks, 1, kvcache.DEFAULT_BUDGET_BYTES) == (1, False)
    gpu = kvcache.GPU_BUDGET_SHARE * 120 * 2**30                 # an H200 with the model and its caches loaded
    size, shared = kvpatch.variant_chunks(config, "sdpa", base, masks, 1, int(gpu))
    assert shared and size == 64
    assert kvcache.budget_bytes("auto", "cpu") == kvcache.DEFAULT_BUDGET_BYTES
    assert kvcache.budget_bytes(2048, "cpu") == 2048 * 2**20


def test_cache_free_chunks_are_sized_by_what_they_allocate(caches):
    """The shared-prefix path's chunk is the most variants whose forward fits the budget
    (:func:`kvnotes.kv.patch.shared_prefix_bytes`, which grows with the chunk), not the budget
    divided by a variant cache it never builds; any chunking gives the same scores."""
    model, old, new, c_old, c_new = caches
    L = len(c_old.layers)
    masks = kvpatch.position_masks(L, T, [[p] for p in range(T)])
    assert int(masks.sum(2).max()) == 1         # one slot per variant: a chunk of v variants substitutes v slots
    need = [kvpatch.shared_prefix_bytes(model.config, c_old, v, 1, v) for v in range(1, T + 1)]
    assert need == sorted(need) and need[0] > 0
    one = kvpatch.patched_logits(model, c_old, c_new, masks, old[T:T + 1], budget_bytes=1, method="shared")
    for want in (1, 3, T):
        budget = need[want - 1]
        assert kvpatch.shared_prefix_budget_chunk(model.config, c_old, masks, 1, budget, T) == want
        assert kvpatch.shared_prefix_budget_chunk(model.config, c_old, masks, 1, budget - 1, T) == max(1, want - 1)
        got = kvpatch.patched_logits(model, c_old, c_new, masks, old[T:T + 1], budget_bytes=budget, method="shared")
        assert torch.allclose(got, one, atol=BATCH_TOL)
