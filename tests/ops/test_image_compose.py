"""Image-KV composition on tiny random M-RoPE VLMs (Qwen2.5-VL sectioned, Qwen3-VL interleaved; issue #24
item 3): an image chunk precompiled once with the vision tower, at other positions, spliced into a text
context by :func:`kvnotes.ops.compose.compose` without re-encoding the image.

A chunk's K/V are what its tokens computed attending to what preceded them when it was precompiled. So
the transplant is exact against (1) the **full prefill** of the prompt when the image opens it (nothing
for it to attend to in either), and (2) with text before it, the image **prefilled at its target
positions** in isolation, read with the same text before and after (the issue's criterion); the full
prefill of that prompt (the image attending to the text) is the composition's own approximation gap,
not a position error, and is only reported (:func:`test_image_chunk_mid_prompt_gap_to_full_is_finite`).
"""

from __future__ import annotations

import pytest
import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import compose, mrope
from tests.helpers import IMAGE_TOKEN, MROPE_ARCHS
from tests.ops.test_reposition_arch import GRID, IMAGE_CHUNK, _ids, _pixels, _suffix_logprobs, build

#: fp32 next-token log-probs (nats) of the composed prompt vs its reference: the delta rotation of a
#: cached key and the key computed at the target differ by fp32 rounding (measured <= 4.8e-7 on both
#: models); a wrong channel, section or text position gives >= 1e-3.
ATOL_IMAGE = 1e-5
#: The no-rotate control must miss by this much (measured 1.2e-3 .. 6e-2).
CONTROL_MIN = 10 * ATOL_IMAGE
#: Where the image chunk is precompiled: behind nothing, as if after this many tokens of other text.
ELSEWHERE = 23


def _image():
    return dict(pixel_values=_pixels(), image_grid_thw=GRID)


@torch.no_grad()
def _full(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's own prefill of ``ids`` ``[T]`` with the image (pixels encoded, positions from its
    get_rope_index): fp32 log-probs ``[vocab]`` at the last position."""
    ids = ids.view(1, -1)
    out = model(input_ids=ids, mm_token_type_ids=mrope.token_types(model, ids), **_image())
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def _lp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("arch", MROPE_ARCHS)
@torch.no_grad()
def test_image_chunk_opening_the_prompt_equals_full_prefill(arch):
    """image | text B: the image chunk precompiled at positions 23.. and moved to 0.. gives the full
    prefill's next-token log-probs (static and dynamic caches); the no-rotate control misses."""
    model = build(arch)
    suffix = _ids(6, 22)
    chunk = compose.precompile(model, IMAGE_CHUNK, offset=ELSEWHERE, **_image())
    assert torch.equal(chunk.image_grid_thw, GRID) and chunk.start == ELSEWHERE
    want = _full(model, torch.cat([IMAGE_CHUNK, suffix]))
    for static in (True, False):
        _, got = compose.compose(model, [chunk, suffix], static=static)
        _, ctrl = compose.compose(model, [chunk, suffix], rotate=False, static=static)
        err = float((_lp(got[0]) - want).abs().max())
        assert err < ATOL_IMAGE, (static, err)
        assert float((_lp(ctrl[0]) - want).abs().max()) > CONTROL_MIN


@pytest.mark.parametrize("arch", MROPE_ARCHS)
@torch.no_grad()
def test_image_chunk_mid_prompt_equals_image_prefilled_at_its_target(arch):
    """text A | image | text B: the image chunk precompiled elsewhere (behind nothing, at 23..), moved
    into the prompt, equals the image prefilled at its target 3-D positions (the model's
    get_rope_index of the whole prompt) read behind A's cache, with B at the positions that resume
    after the image's extent; the no-rotate control misses. Rows of one batch may differ in
    ``rotate`` (per-row chunk lists) and give the same rows."""
    model = build(arch)
    prefix, suffix = _ids(5, 21), _ids(6, 22)
    prompt = torch.cat([prefix, IMAGE_CHUNK, suffix])
    pos = mrope.positions(model, prompt, image_grid_thw=GRID)
    P, n = len(prefix), len(IMAGE_CHUNK)
    placed = compose.precompile(model, IMAGE_CHUNK, positions=pos[:, P:P + n], **_image())
    want = _suffix_logprobs(model, AllSlotCache.prefill(model, prefix), placed.keys, placed.values, suffix,
                            pos[:, P + n:])[-1]
    chunk = compose.precompile(model, IMAGE_CHUNK, offset=ELSEWHERE, **_image())
    for static in (True, False):
        _, got = compose.compose(model, [prefix, chunk, suffix], static=static)
        err = float((_lp(got[0]) - want).abs().max())
        assert err < ATOL_IMAGE, (static, err)
        _, ctrl = compose.compose(model, [prefix, chunk, suffix], rotate=False, static=static)
        assert float((_lp(ctrl[0]) - want).abs().max()) > CONTROL_MIN
    _, rows = compose.compose(model, [prefix, [chunk, chunk], suffix], rotate=[True, False])
    assert (_lp(rows[0]) - want).abs().max() < ATOL_IMAGE and (rows[1] - ctrl[0]).abs().max() < ATOL_IMAGE


@pytest.mark.parametrize("arch", MROPE_ARCHS)
@torch.no_grad()
def test_text_chunk_after_an_image_moves_by_the_model_bookkeeping(arch):
    """text A | image | text chunk | text B: the text chunk after the image sits at positions that
    resume after the image's extent (not at its slot); composed, it equals both chunks prefilled at
    their target 3-D positions; against the model's full prefill (the image and text attending to
    what precedes them) the gap is finite (the composition's approximation, which the compose probe
    reports)."""
    model = build(arch)
    prefix, text, suffix = _ids(5, 21), _ids(7, 24), _ids(6, 22)
    prompt = torch.cat([prefix, IMAGE_CHUNK, text, suffix])
    pos = mrope.positions(model, prompt, image_grid_thw=GRID)
    P, n, m = len(prefix), len(IMAGE_CHUNK), len(text)
    assert int(pos[0, P + n]) < P + n                   # the text resumes before its slot index
    image = compose.precompile(model, IMAGE_CHUNK, positions=pos[:, P:P + n], **_image())
    placed = compose.precompile(model, text, positions=pos[:, P + n:P + n + m])
    keys = [torch.cat([a, b], 2) for a, b in zip(image.keys, placed.keys)]
    values = [torch.cat([a, b], 2) for a, b in zip(image.values, placed.values)]
    want = _suffix_logprobs(model, AllSlotCache.prefill(model, prefix), keys, values, suffix, pos[:, P + n + m:])[-1]
    chunk = compose.precompile(model, IMAGE_CHUNK, offset=ELSEWHERE, **_image())
    _, got = compose.compose(model, [prefix, chunk, compose.precompile(model, text), suffix])
    assert float((_lp(got[0]) - want).abs().max()) < ATOL_IMAGE
    full = _full(model, prompt)
    assert torch.isfinite(got).all() and float((_lp(got[0]) - full).abs().max()) < 1.0


def test_image_chunk_refusals_are_one_line():
    """Image tokens in a live part, seam repair of an image chunk, one-pass composition of an image
    chunk, and image tokens that do not match the grid are refused in one line."""
    model = build("qwen2_5_vl")
    chunk = compose.precompile(model, IMAGE_CHUNK, **_image())
    text = _ids(4, 25)
    calls = (lambda: compose.compose(model, [IMAGE_CHUNK, chunk, text]),
             lambda: compose.compose(model, [text, chunk, text], seam=2),
             lambda: compose.compose_one_pass(model, [text, chunk, text]),
             lambda: compose.precompile(model, IMAGE_CHUNK[:-2], pixel_values=_pixels(),
                                        image_grid_thw=GRID))
    for call in calls:
        with pytest.raises(KvnotesError) as err:
            call()
        assert "\n" not in str(err.value)
    assert int((IMAGE_CHUNK == IMAGE_TOKEN).sum()) == mrope.grid_tokens(model, GRID)[0]
