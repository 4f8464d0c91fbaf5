"""Re-positioning on MLA (DeepSeek-V2/V3) and M-RoPE (Qwen2.5-VL sectioned, Qwen3-VL interleaved) tiny
random models: a moved chunk equals the chunk prefilled at its target positions (cached K/V and the
next-token log-probs read through them), the no-rotate control does not; field refresh and selective
recompute on MLA; the adapters' cache layouts.

transformers 5.23 caches MLA as ``(keys, values) = (kv latent [B, 1, T, kv_lora_rank], k_rot [B, 1, T,
qk_rope_head_dim])``: only the second turns with position. M-RoPE positions come from the model's own
``get_rope_index``."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv.cache import AllSlotCache
from kvnotes.models.adapters import Adapter
from kvnotes.ops import compose, edit, mrope
from tests.helpers import (IMAGE_TOKEN, MLA_ARCHS, MROPE_ARCHS, VISION_END, VISION_START, VOCAB, build_tiny)

# fp32 on CPU. A delta rotation of a cached rotary key and the key computed at the target position
# differ by fp32 rounding of angles up to ~200 rad and of the second forward (measured <= 3.7e-6);
# a wrong pair layout, slot or section gives differences of order 0.1-1.
ATOL_KEYS = 1e-4
#: The position-free parts (MLA latent, values) of two prefills at different positions: same rounding.
ATOL_FREE = 1e-4
#: Next-token log-probs (nats) read through a moved chunk vs through the chunk prefilled at its target.
ATOL_LOGPROBS = 1e-4
#: The controls (no rotation; M-RoPE: only the temporal channel turned) must miss by this much.
CONTROL_MIN = 100 * ATOL_KEYS

#: An image of 1 x 4 x 6 patches (merge 2: 6 tokens on a 2 x 3 grid), its chunk with the vision markers.
GRID = torch.tensor([[1, 4, 6]])
IMAGE_CHUNK = torch.tensor([VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END])


@cache
def build(arch: str):
    return build_tiny(arch)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(1, 80, n)).long()       # below the special tokens


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _pixels(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(GRID.prod()), 3 * 2 * 14 * 14, generator=g)


@torch.no_grad()
def _suffix_logprobs(model, prefix: AllSlotCache, keys, values, suffix: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs ``[m, vocab]`` of ``suffix`` forwarded at ``pos`` (``[m]`` or M-RoPE ``[3, m]``) on
    the prefix cache followed by the given chunk K/V (per layer ``[1, heads, n, dim]``)."""
    cache = AllSlotCache.from_tensors([torch.cat([l.keys, k], 2) for l, k in zip(prefix.layers, keys)],
                                      [torch.cat([l.values, v], 2) for l, v in zip(prefix.layers, values)])
    held = cache.get_seq_length()
    mask = torch.ones(1, held + len(suffix), dtype=torch.long)
    out = model(input_ids=suffix.view(1, -1), position_ids=pos.unsqueeze(-2), attention_mask=mask,
                past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), -1)


# --------------------------------------------------------------------------------------------- MLA

@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_mla_adapter_declares_the_cache_layout(arch):
    """The adapter's cache geometry is what transformers caches; the rotary key is the values slot;
    head_dim is the o_proj head width (v_head_dim)."""
    model = build(arch)
    ad, cfg = Adapter.for_model(model), model.config
    assert (ad.cache_heads, ad.cache_key_dim, ad.cache_value_dim) == (1, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert ad.rope_slot == "values" and ad.rope_interleaved == (arch == "deepseek_v2")
    assert ad.module(model, "o_proj", 0).in_features == ad.n_heads * ad.head_dim == ad.n_heads * cfg.v_head_dim
    assert ad.module(model, "k_proj", 0) is None and ad.module(model, "v_proj", 0) is None
    chunk = compose.precompile(model, _ids(5, 1))
    assert tuple(chunk.keys[0].shape) == (1, 1, 5, ad.cache_key_dim)
    assert tuple(chunk.values[0].shape) == (1, 1, 5, ad.cache_value_dim)


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_mla_reposition_rotates_only_the_rotary_key(arch):
    """A chunk prefilled at 0.. and moved to p.. equals the chunk prefilled at p.. in every layer: the
    rotary key k_rot after the delta rotation, the latent (rest of the key, and the values' source)
    untouched and position-free. Rotating with the other pair layout, or not at all, misses."""
    model = build(arch)
    ids = _ids(12, 2)
    base = compose.precompile(model, ids)
    for p in (1, 37, 190):
        placed = compose.precompile(model, ids, offset=p)
        keys, values = compose.reposition(model, base.keys, base.values, p)
        assert all(k is b for k, b in zip(keys, base.keys))                  # the latent is not touched
        assert _max_diff(values, placed.values) < ATOL_KEYS, p
        assert _max_diff(base.keys, placed.keys) < ATOL_FREE, p
        assert _max_diff(base.values, placed.values) > CONTROL_MIN, p          # the no-rotate control
        rots = compose.delta_rotations(model, p)
        _, interleaved = compose.rope_layout(model)
        wrong = [compose.rotate_into(v, c, s, torch.empty_like(v), not interleaved)
                 for v, (c, s) in zip(base.values, rots)]
        assert _max_diff(wrong, placed.values) > CONTROL_MIN, p
    with pytest.raises(KvnotesError, match="values"):
        compose.rotate_keys(model, base.keys, 3)


@pytest.mark.parametrize("arch", MLA_ARCHS)
@torch.no_grad()
def test_mla_compose_equals_chunk_prefilled_at_its_target(arch):
    """prefix | chunk | suffix: the suffix's log-probs through the composed cache (chunk precompiled at
    0, moved after the prefix) equal those through the prefix and the chunk prefilled at its target
    positions; the no-rotate control differs; static, dynamic and one-pass compositions agree, and a
    whole-chunk seam equals the full prefill."""
    model = build(arch)
    P, prefix, chunk_ids, suffix = 5, _ids(5, 3), _ids(9, 4), _ids(6, 5)
    chunk = compose.precompile(model, chunk_ids)
    placed = compose.precompile(model, chunk_ids, offset=P)
    pre = AllSlotCache.prefill(model, prefix)
    pos = torch.arange(P + 9, P + 15)
    want = _suffix_logprobs(model, pre, placed.keys, placed.values, suffix, pos)
    moved = compose.move(model, chunk, P)
    got = _suffix_logprobs(model, pre, moved.keys, moved.values, suffix, pos)
    assert (got - want).abs().max() < ATOL_LOGPROBS
    ctrl = _suffix_logprobs(model, pre, chunk.keys, chunk.values, suffix, pos)
    assert (ctrl - want).abs().max() > 10 * max(float((got - want).abs().max()), 1e-6)
    # compose(): the last position's log-probs are the reference's
    _, static = compose.compose(model, [prefix, chunk, suffix])
    assert (torch.log_softmax(static[0], -1) - want[-1]).abs().max() < ATOL_LOGPROBS
    _, dynamic = compose.compose(model, [prefix, chunk, suffix], static=False)
    _, one = compose.compose_one_pass(model, [prefix, chunk, suffix], seam=2)
    _, two = compose.compose(model, [prefix, chunk, suffix], seam=2)
    assert (dynamic - static).abs().max() < ATOL_LOGPROBS and (one - two).abs().max() < ATOL_LOGPROBS
    _, whole = compose.compose(model, [prefix, chunk, suffix], seam=99)
    full = compose.full_logits(model, torch.cat([prefix, chunk_ids, suffix]))
    assert (whole - full).abs().max() < ATOL_LOGPROBS


@pytest.mark.parametrize("arch", MLA_ARCHS[:2])
@torch.no_grad()
def test_mla_field_refresh_and_selective_recompute(arch):
    """On the latent cache: refreshing a field and recomputing every downstream position equals the
    full re-prefill of the edited prompt (K/V and decision log-probs)."""
    model = build(arch)
    old = _ids(24, 6)
    new = old.clone()
    new[8:10] = _ids(2, 7)
    d = 23
    refreshed = edit.refresh_field(model, AllSlotCache.prefill(model, old[:d]), new, (8, 10))
    sel = edit.selective(model, refreshed, new, range(10, d))
    full = edit.full(model, new, d)
    for a, b in zip(sel.cache.layers, full.cache.layers):
        assert (a.keys - b.keys).abs().max() < ATOL_FREE and (a.values - b.values).abs().max() < ATOL_KEYS
    lp_sel = edit.decision_logprobs(model, sel.cache, int(new[d]), d)
    lp_full = edit.decision_logprobs(model, full.cache, int(new[d]), d)
    assert (lp_sel - lp_full).abs().max() < ATOL_LOGPROBS


def test_interleaved_rotation_matrix_equals_rotate_into():
    cos, sin = compose.delta_rotations(build("deepseek_v2"), 41)[0]
    keys = torch.randn(2, 1, 5, cos.shape[-1])
    R = compose.rotation_matrix(cos, sin, cos.shape[-1], interleaved=True)
    assert (keys @ R - compose.rotate_into(keys, cos, sin, torch.empty_like(keys), True)).abs().max() < ATOL_KEYS


# ------------------------------------------------------------------------------------------ M-RoPE

@pytest.mark.parametrize("arch", MROPE_ARCHS)
@torch.no_grad()
def test_mrope_text_chunk_moves_all_three_channels(arch):
    """Text tokens have equal temporal/height/width positions (the model's get_rope_index); a text
    chunk moved by p equals it prefilled at p.. (keys; values untouched), and compose() over it gives
    the log-probs read through the chunk prefilled at its target."""
    model = build(arch)
    ids = _ids(12, 8)
    pos = mrope.positions(model, ids)
    assert torch.equal(pos, torch.arange(12).expand(3, -1))
    base = compose.precompile(model, ids)
    for p in (1, 37, 190):
        placed = compose.precompile(model, ids, offset=p)
        keys, values = compose.reposition(model, base.keys, base.values, p)
        assert _max_diff(keys, placed.keys) < ATOL_KEYS and _max_diff(values, placed.values) < ATOL_FREE, p
        assert _max_diff(base.keys, placed.keys) > CONTROL_MIN, p
    P, prefix, suffix = 4, _ids(4, 9), _ids(5, 10)
    pre = AllSlotCache.prefill(model, prefix)
    placed = compose.precompile(model, ids, offset=P)
    want = _suffix_logprobs(model, pre, placed.keys, placed.values, suffix, torch.arange(P + 12, P + 17))
    _, got = compose.compose(model, [prefix, base, suffix])
    err = float((torch.log_softmax(got[0], -1) - want[-1]).abs().max())
    assert err < ATOL_LOGPROBS
    _, ctrl = compose.compose(model, [prefix, base, suffix], rotate=False)
    assert (torch.log_softmax(ctrl[0], -1) - want[-1]).abs().max() > 10 * max(err, 1e-6)


@pytest.mark.parametrize("arch", MROPE_ARCHS)
@torch.no_grad()
def test_mrope_image_chunk_equals_prefill_at_its_target(arch):
    """An image chunk (vision markers + 6 image tokens on a 2 x 3 grid) precompiled alone and moved
    to the 3-D positions the model's get_rope_index gives it after a text prefix equals the chunk
    prefilled at those positions (keys; values untouched), and so do the suffix's log-probs; the
    no-rotate control differs. In transformers 5.23 get_rope_index adds the start to the height and
    width channels too, so turning only the temporal channels also misses."""
    model = build(arch)
    P, prefix, suffix = 5, _ids(5, 11), _ids(4, 12)
    image = dict(pixel_values=_pixels(), image_grid_thw=GRID)
    prompt = torch.cat([prefix, IMAGE_CHUNK, suffix])
    pos = mrope.positions(model, prompt, image_grid_thw=GRID)
    n = len(IMAGE_CHUNK)
    target = pos[:, P:P + n]
    chunk = compose.precompile(model, IMAGE_CHUNK, **image)
    assert torch.equal(chunk.positions, mrope.positions(model, IMAGE_CHUNK, image_grid_thw=GRID))
    placed = compose.precompile(model, IMAGE_CHUNK, positions=target, **image)
    moved = compose.move(model, chunk, target)
    assert _max_diff(moved.keys, placed.keys) < ATOL_KEYS
    assert _max_diff(moved.values, placed.values) < ATOL_FREE
    assert _max_diff(chunk.keys, placed.keys) > CONTROL_MIN
    delta = mrope.deltas(chunk.positions, target)
    assert torch.equal(delta, torch.full_like(delta, P))          # every channel moves by the prefix length
    temporal = delta.clone()
    temporal[1:] = 0
    keys, _ = compose.reposition(model, chunk.keys, chunk.values, temporal)
    assert _max_diff(keys, placed.keys) > CONTROL_MIN
    # the suffix after the image: its positions resume after the image's extent (get_rope_index)
    pre = AllSlotCache.prefill(model, prefix)
    want = _suffix_logprobs(model, pre, placed.keys, placed.values, suffix, pos[:, P + n:])
    got = _suffix_logprobs(model, pre, moved.keys, moved.values, suffix, pos[:, P + n:])
    assert (got - want).abs().max() < ATOL_LOGPROBS
    ctrl = _suffix_logprobs(model, pre, chunk.keys, chunk.values, suffix, pos[:, P + n:])
    assert (ctrl - want).abs().max() > 10 * max(float((got - want).abs().max()), 1e-6)


def test_mrope_errors_are_one_line():
    """3-D deltas or positions on a 1-D model, and mismatched bookkeepings, are refused in one line."""
    llama = build_tiny("llama")
    chunk = compose.precompile(llama, _ids(4, 13))
    for call in (lambda: compose.reposition(llama, chunk.keys, chunk.values, torch.zeros(3, 4, dtype=torch.long)),
                 lambda: compose.precompile(llama, _ids(4, 13), positions=torch.zeros(3, 4, dtype=torch.long)),
                 lambda: mrope.positions(llama, _ids(4, 13)),
                 lambda: mrope.deltas(torch.zeros(3, 4), torch.zeros(3, 5))):
        with pytest.raises(KvnotesError) as err:
            call()
        assert "\n" not in str(err.value)
    assert VOCAB > IMAGE_TOKEN
