"""Invariants of the cache edit operations (kvnotes.ops.edit) on the five tiny random architectures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvnotes.kv.cache import AllSlotCache, check_all_slots, extend
from kvnotes.ops import edit
from tests.helpers import VOCAB

# fp32 on CPU: the same computation in different batch/mask shapes (one 4-D masked forward vs
# a sequential or full prefill) differs by float rounding only, ~1e-6 on these tiny models.
TOL = 1e-4
# selective recompute and oracle_copy must differ by clearly more than rounding when only a few
# downstream positions are recomputed (the copy also brings the new states of unselected positions'
# influence); random tiny models move log-probs by >1e-3 for a changed field.
DIFFERENT = 1e-3

T = 20            # prompt positions [0, T) plus a decision token: windows (8) fill
FIELD = (4, 7)
D = T


def tiny_pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(3, VOCAB, (T + 1,), generator=g)
    new = old.clone()
    new[FIELD[0]:FIELD[1]] = (old[FIELD[0]:FIELD[1]] + 7) % VOCAB
    return old, new


def kv_diff(a, b, n):
    return max(max(float((la.keys[:, :, :n] - lb.keys[:, :, :n]).abs().max()),
                   float((la.values[:, :, :n] - lb.values[:, :, :n]).abs().max()))
               for la, lb in zip(a.layers, b.layers))


def lp(model, e, tok):
    return edit.decision_logprobs(model, e.cache, int(tok), e.pos)


def test_selective_all_downstream_equals_full(tiny):
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(tiny, old[:D])
    ref = edit.full(tiny, new, D)
    refreshed = edit.refresh_field(tiny, stale, new, FIELD)
    sel = edit.selective(tiny, refreshed, new, range(FIELD[1], D))
    assert kv_diff(sel.cache, ref.cache, D) < TOL
    assert float((lp(tiny, sel, new[D]) - lp(tiny, ref, new[D])).abs().max()) < TOL
    assert sel.tokens == D - FIELD[0]


def test_selective_k0_equals_refresh_field(tiny):
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(tiny, old[:D])
    refreshed = edit.refresh_field(tiny, stale, new, FIELD)
    sel = edit.selective(tiny, refreshed, new, [])
    assert kv_diff(sel.cache, refreshed.cache, D) == 0.0
    # the refreshed field equals the full re-prefill's field (it only attends to the prefix)
    ref = edit.full(tiny, new, D)
    for la, lb in zip(refreshed.cache.layers, ref.cache.layers):
        assert float((la.keys[:, :, :FIELD[1]] - lb.keys[:, :, :FIELD[1]]).abs().max()) < TOL
    # downstream stays stale
    for la, lb in zip(refreshed.cache.layers, stale.layers):
        assert torch.equal(la.keys[:, :, FIELD[1]:], lb.keys[:, :, FIELD[1]:])


def test_erratum_path_equals_full_prefill_of_edited_prompt(tiny):
    old, _ = tiny_pair()
    notice = torch.arange(10, 22)
    cut = 20                                       # notice inserted before position 20
    edited = torch.cat([old[:cut], notice, old[cut:]])
    d = len(edited) - 1
    stale = AllSlotCache.prefill(tiny, old[:D])
    e = edit.extend_from(tiny, stale, edited, cut, d)
    ref = AllSlotCache.prefill(tiny, edited[:d])
    assert e.tokens == d - cut
    assert kv_diff(e.cache, ref, d) < TOL
    ref_lp = edit.decision_logprobs(tiny, ref, int(edited[d]), d)
    assert float((lp(tiny, e, edited[d]) - ref_lp).abs().max()) < TOL


def test_4d_recompute_of_one_position_equals_recomputing_it_alone(tiny):
    old, new = tiny_pair()
    refreshed = edit.refresh_field(tiny, AllSlotCache.prefill(tiny, old[:D]), new, FIELD)
    for p in (FIELD[1], D - 1):                   # first downstream (window not full) and last
        check_one_position(tiny, refreshed, new, p)


def check_one_position(tiny, refreshed, new, p):
    got = edit.recompute_positions(tiny, refreshed.cache, new, torch.tensor([p]))
    alone = extend(tiny, refreshed.cache, new[p:p + 1], p)          # plain forward on [0, p)
    for lg, la in zip(got.layers, alone.layers):
        assert float((lg.keys[:, :, p] - la.keys[:, :, p]).abs().max()) < TOL
        assert float((lg.values[:, :, p] - la.values[:, :, p]).abs().max()) < TOL
    # every other slot is untouched
    for lg, lr in zip(got.layers, refreshed.cache.layers):
        keep = [i for i in range(D) if i != p]
        assert torch.equal(lg.keys[:, :, keep], lr.keys[:, :, keep])


def sequential_reference(model, refreshed, ids, positions):
    """Independent reference: recompute the selected positions one at a time, in order, each by a
    plain forward on the cache as edited so far truncated to its position, writing it back."""
    cache = refreshed.cache
    for p in sorted(positions):
        alone = extend(model, cache, ids[p:p + 1], p)
        cache = edit.splice(cache, torch.tensor([p]), [l.keys[:, :, p:p + 1] for l in alone.layers],
                            [l.values[:, :, p:p + 1] for l in alone.layers])
    return cache


def test_selective_is_a_true_recompute_not_a_copy(tiny):
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(tiny, old[:D])
    ref = edit.full(tiny, new, D)
    refreshed = edit.refresh_field(tiny, stale, new, FIELD)
    positions = [9, 13, 14, 18]
    sel = edit.selective(tiny, refreshed, new, positions)
    seq = sequential_reference(tiny, refreshed, new, positions)
    assert kv_diff(sel.cache, seq, D) < TOL
    oracle = edit.oracle_copy(refreshed, ref.cache, positions)
    assert kv_diff(sel.cache, oracle.cache, D) > DIFFERENT
    assert np.isnan(oracle.flops)                  # the upper bound has no honest cost


def test_all_slot_cache_required(tiny):
    from kvnotes.kv import cache as kvcache

    old, _ = tiny_pair()
    hybrid = kvcache.prefill(tiny, old[:D])
    if any(getattr(l, "is_sliding", False) for l in hybrid.layers):
        with pytest.raises(ValueError, match="every position"):
            check_all_slots(hybrid)


def test_rankings_cover_downstream(tiny):
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(tiny, old[:D])
    refreshed = edit.refresh_field(tiny, stale, new, FIELD)
    down = (FIELD[1], D)
    att, cost = edit.rank_attention(tiny, stale, int(old[D]), down)
    dev, cost2 = edit.rank_kv_deviation(tiny, refreshed, new, down)
    for order in (att, dev, edit.rank_last(down), edit.rank_random(down, np.random.default_rng(0))):
        assert sorted(order) == list(range(*down))
    assert cost["tokens"] == 1 and 0 < cost2["tokens"] < D - FIELD[1]
    # the truncated decoder was restored
    assert len(tiny.model.layers) == tiny.config.num_hidden_layers


#: fp32 attention probabilities of the same query and keys through two forwards (a hook on one row,
#: the knockout capture's batched rows).
PROB_TOL = 1e-6


def test_attention_ranking_reads_the_probabilities_every_probe_reads(tiny):
    """``rank_attention`` orders downstream positions by the decision row's layer- and head-mean
    attention as the knockout capture computes it (one attention-probability computation:
    :func:`kvnotes.kv.knockout.eager_probabilities`): its order is non-increasing in those masses."""
    from kvnotes.errors import KvnotesError
    from kvnotes.kv.cache import prefill
    from kvnotes.kv.knockout import decision_forward
    from kvnotes.ops.slots import has_sliding_layers

    old, _ = tiny_pair()
    stale = AllSlotCache.prefill(tiny, old[:D])
    down = (FIELD[1], D)
    order, _ = edit.rank_attention(tiny, stale, int(old[D]), down)
    read = decision_forward(tiny, prefill(tiny, old[:D]), old[D:D + 1], capture=True)   # the prefix cache holds the window
    if has_sliding_layers(tiny):               # the all-slot cache would let the row attend past it: refused
        with pytest.raises(KvnotesError, match="sliding-window"):
            decision_forward(tiny, stale, old[D:D + 1], capture=True)
    mass = read.probs[0, :, :D].mean(0)                   # [D]: mean over layers of the head-mean row
    ranked = mass[order]
    assert (ranked[1:] - ranked[:-1]).max() <= PROB_TOL, ranked
    assert ranked[0] - ranked[-1] > 10 * PROB_TOL        # the masses differ: the order is not vacuous


def test_flops_formula():
    from tests.helpers import tiny_config

    cfg = tiny_config("llama")
    per = cfg.num_hidden_layers * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 96)
    assert edit.params_per_token(cfg) == per
    assert edit.forward_flops(cfg, 10, 55) == 2 * per * 10 + 4 * 3 * 4 * 16 * 55
    assert edit.span_pairs(0, 10) == 55 and edit.span_pairs(3, 5) == 4 + 5
