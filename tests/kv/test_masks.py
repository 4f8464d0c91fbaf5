"""Factored patch masks (:mod:`kvnotes.kv.masks`): the same variants as their dense masks, read the
same way by every readout path, on tiny random models whose prompts pass the sliding window."""

from __future__ import annotations

import pytest
import torch

from kvnotes.kv import cache as kvcache
from kvnotes.kv import masks as kvmasks
from kvnotes.kv import patch as kvpatch
from tests.helpers import LOGPROB_TOL, VOCAB, WINDOW

T = 3 * WINDOW


def factored(n_layers: int) -> kvmasks.FactoredMasks:
    """Single positions in every layer, a span in a band of layers, nothing, and a span in one layer."""
    sets = [([p], range(n_layers)) for p in range(T - 6, T)] + [(range(4, T), range(1, n_layers)), ([], range(n_layers)),
                                                               (range(2, 9), [0])]
    pos = torch.zeros(len(sets), T, dtype=torch.bool)
    lay = torch.zeros(len(sets), n_layers, dtype=torch.bool)
    for v, (p, ls) in enumerate(sets):
        pos[v, list(p)] = True
        lay[v, list(ls)] = True
    return kvmasks.FactoredMasks(pos, lay)


def test_factored_masks_reduce_as_their_dense_mask():
    """Union, per-variant count, patched positions, per-layer view and chunk selection agree with the
    dense mask's, computed the plain way."""
    f = factored(4)
    d = f.dense()
    assert d.shape == f.shape == (9, 4, T)
    assert kvmasks.union_slots(f) == kvmasks.union_slots(d) == int(d.any(0).sum(1).max()) == T - 4
    assert kvmasks.most_slots(f) == kvmasks.most_slots(d) == int(d.sum(2).max()) == T - 4
    assert torch.equal(kvmasks.patched_positions(f), d.any(1))
    for layer in range(4):
        assert torch.equal(kvmasks.layer_mask(f, layer), d[:, layer])
    idx = torch.tensor([7, 0, 8])
    assert torch.equal(f[idx].dense(), d[idx])
    empty = f[torch.tensor([], dtype=torch.long)]
    assert kvmasks.union_slots(empty) == kvmasks.most_slots(empty) == 0


@pytest.mark.parametrize("method", ["shared", "substitute"])
def test_factored_masks_patch_as_their_dense_mask(tiny, method):
    """Both readout paths and the materialised variant caches give the factored masks the dense
    masks' numbers (sliding layers hold fewer slots than positions)."""
    model = tiny
    if method == "shared" and model.config._attn_implementation not in kvpatch.SHARED_PREFIX_ATTENTION:
        pytest.skip("the shared prefix needs sdpa or eager attention")
    g = torch.Generator().manual_seed(5)
    old = torch.randint(0, VOCAB, (T + 1,), generator=g)
    new = old.clone()
    new[4:9] = (old[4:9] + 1) % VOCAB
    c_old, c_new = kvcache.prefill(model, old[:T]), kvcache.prefill(model, new[:T])
    f = factored(len(c_old.layers))
    got = kvpatch.patched_logits(model, c_old, c_new, f, old[T:], method=method)
    want = kvpatch.patched_logits(model, c_old, c_new, f.dense(), old[T:], method=method)
    assert torch.equal(got, want)
    built = kvcache.build_variants(model.config, c_old, c_new, f)
    ref = kvcache.build_variants(model.config, c_old, c_new, f.dense())
    for a, b in zip(built.layers, ref.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.allclose(torch.log_softmax(got[:, -1], -1),
                          kvcache.continuation_logprobs(model, built, old[T:], T)[:, -1], atol=LOGPROB_TOL)
