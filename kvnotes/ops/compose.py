"""Composing caches: splice precompiled chunks after a prefix (paper §5), and judge the result.

A chunk (:class:`kvnotes.ops.chunk.Chunk`, prefilled once in isolation by
:func:`kvnotes.ops.chunk.precompile`) is used at another position by rotating its keys by the
position delta (:mod:`kvnotes.kv.rope`: the rotation taken from the model's own rotary module) and
splicing its K/V after the real prefix; the live tokens that follow are computed normally against
the composed cache.

**Splice and seam repair.** :func:`compose` walks the parts of a prompt in order: live token
tensors are forwarded at their positions; a chunk has its first ``seam`` tokens recomputed against
the real prefix (one forward of those tokens), and the rest of its K/V are rotated and written
after them. ``rotate=False`` is the no-rotate control (the keys keep the positions they were
precompiled at). Tokens after a chunk are always computed live against the composed cache.

**Caches.** For models without sliding-window layers the composed cache is a ``StaticCache``
preallocated to the final length: prefix and live forwards write their K/V into it, and the chunk's
rotated keys and values are written in place into their slots (no per-layer concatenation of the
whole cache). Models with sliding-window layers (Gemma-2/3, Mistral) use a ``DynamicCache`` built
with ``config=``; a splice then concatenates per layer and a sliding layer keeps only the last
``window - 1`` slots, as ``DynamicSlidingWindowLayer`` does.

**One forward (the serving path).** :func:`compose_one_pass` computes the same prompt with one
model forward instead of one per live part: the chunks' K/V are written first into a
:class:`kvnotes.ops.slots.SlotCache` (keys of every layer rotated by one batched GEMM with
:func:`kvnotes.kv.rope.rotation_matrix`), then all live and seam tokens are forwarded together at
their positions, each attending lower-right causally to every slot before its own
(:mod:`kvnotes.ops.slots`). :class:`ComposeRunner` runs it on a reused KV pool and, on CUDA, replays
that forward as a CUDA graph captured once per token layout. Both need a model without
sliding-window layers and one chunk, seam and rotation for every row.

**Metrics.** :func:`full_logits` is the reference (the full prefill) and :func:`decision_metrics`
the agreement of a composed run with it at the decision position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from kvnotes.kv import cache as kvcache
from kvnotes.kv.decision import kl_nats
from kvnotes.kv.rope import _rotated, delta_rotations, rope_layout, rotate_into, rotation_matrix
from kvnotes.ops.chunk import Chunk, move
from kvnotes.ops.slots import SlotCache, SlotRunner, _forward_one_pass, has_sliding_layers, position_runs
from kvnotes.errors import KvnotesError

# Re-exported, defined in kvnotes.ops.chunk and kvnotes.kv.rope: precompile is documented with composition
# (docs/composition.md) and called as kvnotes.ops.compose.precompile by the probes; reposition and rotate_keys
# are called as compose.<name> by the tests.
from kvnotes.ops.chunk import precompile  # noqa: F401
from kvnotes.kv.rope import reposition, rotate_keys  # noqa: F401


def _forward(model, cache, ids: torch.Tensor, start: int, logits: bool, positions: torch.Tensor | None = None):
    """Feed ``ids`` ``[B, m]`` at slots ``start ..`` on ``cache`` (positions ``start ..``, or the
    M-RoPE ``positions`` ``[3, m]`` of every row); return the fp32 logits of the last position
    ``[B, vocab]`` when ``logits``."""
    B, m = ids.shape
    if positions is None:
        pos = torch.arange(start, start + m, device=model.device).unsqueeze(0).expand(B, -1)
    else:
        pos = positions.to(model.device).unsqueeze(1).expand(-1, B, -1)
    mask = None if isinstance(cache, StaticCache) else torch.ones(B, start + m, dtype=torch.long, device=model.device)
    out = model(input_ids=ids.to(model.device), position_ids=pos, attention_mask=mask, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float() if logits else None


def _per_row(value, B: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{what}: {len(value)} values for {B} rows")
        return list(value)
    return [value] * B


def _tail(model, chunk: Chunk, s: int, rotate: bool, delta: int, rots_cache: dict):
    """Per layer ``(keys, values)`` of chunk tokens ``s ..``, the rotary part (:func:`rope_layout`)
    rotated by ``delta`` when ``rotate``."""
    keys = [k[:, :, s:] for k in chunk.keys]
    values = [v[:, :, s:] for v in chunk.values]
    if rotate and delta:
        if delta not in rots_cache:
            rots_cache[delta] = delta_rotations(model, delta)
        keys, values = _rotated(model, keys, values, rots_cache[delta])
    return keys, values


def _splice_static(model, cache: StaticCache, chunks, seams, rotate, pos: int, rots_cache: dict) -> None:
    """Write each row's chunk K/V (tokens ``seam_r ..``) into the preallocated slots ``pos + seam_r ..``.

    With one row (or every row the same chunk, seam and rotation) the rotated keys are written
    directly into the cache slice; otherwise each group of equal rows gets its tail by index."""
    B = len(chunks)
    n = len(chunks[0])
    slot, interleaved = rope_layout(model)
    groups: dict = {}
    for r in range(B):
        groups.setdefault((id(chunks[r]), seams[r], rotate[r]), []).append(r)
    for (_, s, rot), rows in groups.items():
        if s >= n:
            continue
        chunk = chunks[rows[0]]
        delta = pos - chunk.start
        whole = len(rows) == B
        if whole and rot and delta:
            if delta not in rots_cache:
                rots_cache[delta] = delta_rotations(model, delta)
        else:
            keys, values = _tail(model, chunk, s, rot, delta, rots_cache)
        idx = torch.tensor(rows, device=model.device)
        for l, layer in enumerate(cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(chunk.keys[l].expand(B, -1, -1, -1), chunk.values[l].expand(B, -1, -1, -1))
            if whole:
                dst_k, dst_v = layer.keys[:, :, pos + s: pos + n], layer.values[:, :, pos + s: pos + n]
                src_k, src_v = chunk.keys[l][:, :, s:], chunk.values[l][:, :, s:]
                if slot == "values":        # MLA: the rotary key is the values slot (swap roles)
                    src_k, src_v, dst_k, dst_v = src_v, src_k, dst_v, dst_k
                if rot and delta:
                    rotate_into(src_k, *rots_cache[delta][l], out=dst_k, interleaved=interleaved)
                else:
                    dst_k.copy_(src_k.expand_as(dst_k))
                dst_v.copy_(src_v.expand_as(dst_v))
            else:
                layer.keys[idx, :, pos + s: pos + n] = keys[l].to(layer.keys.dtype).expand(len(rows), -1, -1, -1)
                layer.values[idx, :, pos + s: pos + n] = values[l].to(layer.values.dtype).expand(len(rows), -1, -1, -1)
    for layer in cache.layers:
        layer.cumulative_length.fill_(pos + n)


def _splice_dynamic(model, cache: DynamicCache, chunks, seams, rotate, pos: int, rots_cache: dict,
                    all_slots: bool = False) -> DynamicCache:
    """Append each row's chunk K/V to a DynamicCache that holds ``[0, pos + max(seam))``: positions
    ``pos + max(seam) ..`` are concatenated, and rows with a smaller seam have their recomputed
    slots ``[pos + seam_r, pos + max(seam))`` overwritten with the precompiled K/V. Sliding layers
    keep the last ``window - 1`` slots."""
    B = len(chunks)
    n = len(chunks[0])
    s_max = max(seams)
    tails = [_tail(model, chunks[r], seams[r], rotate[r], pos - chunks[r].start, rots_cache) for r in range(B)]
    new_k, new_v = [], []
    for l, layer in enumerate(cache.layers):
        ref = chunks[0].keys[l]
        k_app = ref.new_empty(B, ref.shape[1], n - s_max, ref.shape[3])
        v_app = chunks[0].values[l].new_empty(B, ref.shape[1], n - s_max, chunks[0].values[l].shape[3])
        held = layer.keys is not None and layer.keys.numel() > 0
        if held:
            k_old, v_old = layer.keys, layer.values
            slot_pos = kvcache.slot_positions(layer)
        for r, (tk, tv) in enumerate(tails):
            s = seams[r]
            k_app[r] = tk[l][0, :, s_max - s:]
            v_app[r] = tv[l][0, :, s_max - s:]
            if s < s_max and held:
                hit = ((slot_pos >= pos + s) & (slot_pos < pos + s_max)).nonzero().flatten()
                if len(hit):
                    first = int(slot_pos[hit[0]]) - (pos + s)
                    k_old[r, :, hit] = tk[l][0, :, first:first + len(hit)].to(k_old.dtype)
                    v_old[r, :, hit] = tv[l][0, :, first:first + len(hit)].to(v_old.dtype)
        if held:
            k2 = torch.cat([k_old, k_app.to(k_old.dtype)], dim=2)
            v2 = torch.cat([v_old, v_app.to(v_old.dtype)], dim=2)
        else:
            k2, v2 = k_app, v_app
        if getattr(layer, "is_sliding", False):
            k2, v2 = k2[:, :, -layer.sliding_window + 1:], v2[:, :, -layer.sliding_window + 1:]
        new_k.append(k2.contiguous())
        new_v.append(v2.contiguous())
    return kvcache.cache_from_tensors(None if all_slots else model.config, new_k, new_v, pos + n)


def _broadcast(model, cache, B: int, n: int):
    """The batch-1 cache over ``[0, n)`` repeated to ``B`` rows (a new cache of the same kind)."""
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            layer.lazy_initialization(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1))
            layer.keys[:, :, :n] = k[:, :, :n]
            layer.values[:, :, :n] = v[:, :, :n]
            layer.cumulative_length.fill_(n)
        return cache
    sliding = any(getattr(l, "is_sliding", False) for l in cache.layers)       # else all slots, kept so
    return kvcache.cache_from_tensors(model.config if sliding else None,
                                      [l.keys.expand(B, -1, -1, -1).contiguous() for l in cache.layers],
                                      [l.values.expand(B, -1, -1, -1).contiguous() for l in cache.layers], n)


def _image_positions(model, items: list, seams_of: dict) -> torch.Tensor | None:
    """The model's 3-D positions ``[3, L]`` (CPU) of a composed prompt holding image chunks
    (:attr:`Chunk.image_grid_thw`), from its ``get_rope_index`` over the whole token sequence with
    the chunks' grids in order (:func:`kvnotes.ops.mrope.positions`); None when no chunk holds an
    image (then every path is the 1-D one, unchanged).

    Raises:
        KvnotesError: a live part holding image/video tokens (its pixels are not there), seam
            repair of an image chunk (it would re-encode the image), or the chunks of one part
            with different image grids.
    """
    if not any(not isinstance(it, torch.Tensor) and it[0].image_grid_thw is not None for it in items):
        return None
    from kvnotes.ops import mrope

    pieces, grids = [], []
    for i, it in enumerate(items):
        if isinstance(it, torch.Tensor):
            if bool((mrope.token_types(model, it) != mrope.TEXT).any()):
                raise KvnotesError("compose: a live part holds image/video tokens; precompile the image as a chunk "
                                   "(precompile(model, ids, pixel_values=..., image_grid_thw=...))")
            pieces.append(it[0].cpu())
            continue
        grid = it[0].image_grid_thw
        if any((c.image_grid_thw is None) != (grid is None) or (grid is not None and not torch.equal(c.image_grid_thw, grid))
               for c in it):
            raise KvnotesError("compose: the chunks of one part hold different images (image_grid_thw)")
        if grid is not None:
            if max(seams_of[i]):
                raise KvnotesError(f"compose: seam {max(seams_of[i])} on an image chunk would re-encode the image "
                                   f"(use seam=0)")
            grids.append(grid)
        pieces.append(it[0].ids)
    return mrope.positions(model, torch.cat(pieces), image_grid_thw=torch.cat(grids)).cpu()


@torch.no_grad()
def compose(model, parts: Sequence, rotate: bool | Sequence[bool] = True, seam: int | Sequence[int] = 0,
            static: bool | None = None, all_slots: bool = False) -> tuple[DynamicCache | StaticCache, torch.Tensor | None]:
    """Build the cache of a prompt made of live token parts and precompiled chunks, in order.

    Live parts (``[m]`` or ``[B, m]`` token ids) are forwarded at their positions against the cache
    so far. For a chunk at position ``p``: its first ``min(seam, n)`` tokens are recomputed against
    the real prefix (one forward), and the K/V of the rest are written at ``p + seam .. p + n - 1``,
    keys rotated by ``p - chunk.start`` (``rotate``) or as precompiled (``rotate=False``, the
    no-rotate control).

    Rows of the batch may be different variants of one prompt: a chunk part may be a list of
    ``B`` chunks (same tokens, e.g. precompiled behind different sinks), and ``rotate`` / ``seam``
    may be given per row. One forward then serves every row: the seam forward recomputes
    ``max(seam)`` tokens for all rows (a recomputed token attends only to earlier positions, so
    a row's first ``seam_r`` recomputed tokens do not depend on how many follow) and the rows with
    a smaller seam get their precompiled K/V written over the rest. A chunk's seam tokens are
    forwarded together with the live part just before it (contiguous positions, one forward), and
    a first live part shared by every row is prefilled once and broadcast.

    **Image chunks** (M-RoPE VLMs: a chunk precompiled with the vision tower, ``precompile(model,
    ids, pixel_values=..., image_grid_thw=...)``, so its K/V carry the image and it keeps its grid):
    the prompt's 3-D positions come from the model's own ``get_rope_index`` over the whole composed
    token sequence with the chunks' grids (:func:`_image_positions`); live tokens are forwarded at
    their columns (text after an image resumes at the image's start plus its extent, not at its
    slot) and every chunk is moved by its per-token, per-channel delta
    (:func:`kvnotes.ops.chunk.move`) before it is spliced (``rotate=False``: spliced as
    precompiled). The image is not re-encoded: no pixel values reach the forwards. Such a chunk
    takes ``seam=0``.

    Args:
        parts: the prompt in order; at least one part.
        rotate: re-position the chunk keys (the method) or not (control); one value or one per row.
        seam: chunk tokens recomputed at the start of every chunk (seam repair; ``seam >= n``
            recomputes the whole chunk, which equals a full prefill); one value or one per row.
        static: preallocate a ``StaticCache`` and write spliced K/V in place; default: True when the
            model has no sliding-window layers (a ``StaticCache`` cannot be used with them here).
        all_slots: build an all-slot ``DynamicCache`` (no layer drops positions outside its window),
            the cache the edit operations take (:func:`kvnotes.ops.edit.refresh_field`); implies
            ``static=False``.

    Returns:
        (the cache over all positions, fp32 logits ``[B, vocab]`` at the last position when the
        last part is live, else None).

    Raises:
        ValueError: ``static=True`` on a model with sliding-window layers, no parts, per-row
            values whose count is not the batch size, or chunks of one part with different tokens.
        KvnotesError: from :func:`kvnotes.kv.rope.delta_rotations`; a live part holding image
            tokens, seam repair of an image chunk (:func:`_image_positions`).
    """
    if not parts:
        raise ValueError("compose needs at least one part")
    sliding = has_sliding_layers(model)
    static = (not sliding and not all_slots) if static is None else static
    if static and (sliding or all_slots):
        raise ValueError("a preallocated StaticCache is not used for models with sliding-window layers "
                         "or for an all-slot cache")
    parts = [p if isinstance(p, (Chunk, list, tuple)) else (p.view(1, -1) if p.dim() == 1 else p) for p in parts]
    sizes = [p.shape[0] for p in parts if isinstance(p, torch.Tensor)] + [len(p) for p in parts if isinstance(p, (list, tuple))]
    for x in (rotate, seam):
        if isinstance(x, (list, tuple)):
            sizes.append(len(x))
    B = max(sizes, default=1)
    rotate, seam = _per_row(rotate, B, "rotate"), _per_row(seam, B, "seam")
    total = sum(p.shape[1] if isinstance(p, torch.Tensor) else len(_per_row(p, B, "chunks")[0]) for p in parts)
    if static:
        cache = StaticCache(config=model.config, max_cache_len=total)
    else:
        cache = kvcache.AllSlotCache() if all_slots else DynamicCache(config=model.config)
    pos, logits, rots_cache = 0, None, {}
    items = [p if isinstance(p, torch.Tensor) else _per_row(p, B, "chunks") for p in parts]
    seams_of = {}
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            n = len(item[0])
            if any(len(c) != n or not torch.equal(c.ids, item[0].ids) for c in item):
                raise ValueError("the chunks of one part must have the same tokens")
            seams_of[i] = [min(max(int(s), 0), n) for s in seam]
    pos3 = _image_positions(model, items, seams_of)
    moved: dict = {}
    merged = set()          # chunks whose seam tokens were forwarded with the live part before them
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            ids = item.expand(B, -1) if item.shape[0] == 1 else item
            nxt = i + 1 if i + 1 < len(items) and i + 1 in seams_of else None
            if nxt is not None and max(seams_of[nxt]):
                # seam repair of the next chunk continues this forward (contiguous positions)
                seam_ids = items[nxt][0].ids[:max(seams_of[nxt])].to(ids.device)
                ids = torch.cat([ids, seam_ids.view(1, -1).expand(ids.shape[0], -1)], dim=1)
                merged.add(nxt)
            cols = None if pos3 is None else pos3[:, pos:pos + ids.shape[1]]
            if i == 0 and B > 1 and bool((ids == ids[:1]).all()):
                # every row starts with the same tokens: prefill them once and broadcast the cache
                logits = _forward(model, cache, ids[:1], 0, i == len(items) - 1, cols)
                cache = _broadcast(model, cache, B, ids.shape[1])
                logits = None if logits is None else logits.expand(B, -1)
            else:
                logits = _forward(model, cache, ids, pos, i == len(items) - 1, cols)
            pos += item.shape[1]
            continue
        chunks, seams, rot = item, seams_of[i], rotate
        n = len(chunks[0])
        s_max = max(seams)
        if s_max and i not in merged:
            _forward(model, cache, chunks[0].ids[:s_max].view(1, -1).expand(B, -1), pos, False,
                     None if pos3 is None else pos3[:, pos:pos + s_max])
        if pos3 is not None:        # M-RoPE with images: each chunk moved to its 3-D positions, spliced as is
            target = pos3[:, pos:pos + n]
            chunks = [moved.setdefault((i, id(c)), move(model, c, target)) if r else c for c, r in zip(chunks, rotate)]
            rot = [False] * B
        logits = None
        if static:
            _splice_static(model, cache, chunks, seams, rot, pos, rots_cache)
        elif s_max < n or min(seams) < s_max:
            cache = _splice_dynamic(model, cache, chunks, seams, rot, pos, rots_cache, all_slots)
        pos += n
    return cache, logits


# ---------------------------------------------------------------------------------------------------
# One forward per composed prompt (the serving path)
# ---------------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    """The one forward of a composed prompt.

    Attributes:
        ids: ``[B, q]`` forwarded tokens (the live parts and every chunk's seam tokens, in order) on
            the model's device, None when nothing is forwarded.
        slots: ``[q]`` their positions, which are also their cache slots.
        runs: ``(r0, r1, end)`` per run of consecutive positions (rows ``r0 .. r1 - 1``).
        chunks: ``(chunk, slot of its first token)`` for each chunk with K/V to splice.
        total: prompt length.
        logits: the last part is live (the forward's last row is the prompt's last position).
        B: rows.
    """

    ids: torch.Tensor | None
    slots: torch.Tensor | None
    runs: tuple
    chunks: list
    total: int
    logits: bool
    B: int


def _plan(model, parts: Sequence, seam: int, rotate: bool) -> _Plan:
    if not parts:
        raise ValueError("compose needs at least one part")
    if isinstance(rotate, (list, tuple)):
        raise ValueError("compose_one_pass takes one rotate for every row (per-row: compose())")
    if isinstance(seam, (list, tuple)):
        raise ValueError("compose_one_pass takes one seam for every row (per-row seams: compose())")
    pieces, positions, chunks, pos = [], [], [], 0
    for p in parts:
        if isinstance(p, (list, tuple)):
            raise ValueError("compose_one_pass takes one Chunk per chunk part (per-row chunks: compose())")
        if isinstance(p, Chunk):
            if p.image_grid_thw is not None:
                raise KvnotesError("compose_one_pass: an image chunk needs the prompt's 3-D positions (use compose())")
            n = len(p)
            s = min(max(int(seam), 0), n)
            if s:
                pieces.append(p.ids[:s].view(1, -1))
                positions.extend(range(pos, pos + s))
            if s < n:
                chunks.append((p, pos))
            pos += n
        else:
            ids = p.view(1, -1) if p.dim() == 1 else p
            pieces.append(ids)
            positions.extend(range(pos, pos + ids.shape[1]))
            pos += ids.shape[1]
    B = max((x.shape[0] for x in pieces), default=1)
    if any(x.shape[0] not in (1, B) for x in pieces):
        raise ValueError("live parts must have 1 or B rows")
    runs = position_runs(positions)
    dev = model.device
    ids = torch.cat([x.to(dev).expand(B, -1) for x in pieces], dim=1) if pieces else None
    slots = torch.tensor(positions, dtype=torch.long, device=dev) if positions else None
    return _Plan(ids, slots, runs, chunks, pos, not isinstance(parts[-1], Chunk), B)


def _rotations(model, delta: int, dtype: torch.dtype, head_dim: int, rot_cache: dict,
               interleaved: bool = False) -> list[torch.Tensor]:
    """Per layer the :func:`rotation_matrix` by ``delta`` (one shared tensor per layer type), cached."""
    key = (delta, dtype)
    if key not in rot_cache:
        mats, out = {}, []
        for c, s in delta_rotations(model, delta):
            if id(c) not in mats:
                mats[id(c)] = rotation_matrix(c, s, head_dim, dtype, interleaved)
            out.append(mats[id(c)])
        rot_cache[key] = out
    return rot_cache[key]


def _rotate_copy(src: torch.Tensor, R: torch.Tensor | None, dst: torch.Tensor) -> None:
    """``dst = src @ R`` (or a copy when ``R`` is None) for ``[..., n, head_dim]`` tensors; the
    leading dims form one batched GEMM written straight into ``dst`` (a strided slice of a pool)."""
    src = src.to(dst.dtype)
    if R is None:
        dst.copy_(src)
        return
    try:
        d3 = dst.view(-1, *dst.shape[-2:])
    except RuntimeError:
        dst.copy_(src @ R)
        return
    s3 = src.reshape(-1, *src.shape[-2:])
    torch.bmm(s3, R.expand(s3.shape[0], -1, -1), out=d3)


def _splice_one_pass(model, cache: SlotCache, chunks: list, rotate: bool, rot_cache: dict) -> None:
    """Write each whole chunk's K/V at its slots ``pos .. pos + n - 1`` of every row, keys rotated by
    ``pos - chunk.start`` when ``rotate`` (MLA: the rotary ``values`` pool instead, :func:`rope_layout`):
    with ``Chunk.stacked`` and one rotation for all layers,
    one GEMM for the keys of every layer and one copy for the values. The seam slots are overwritten
    by the forward that follows."""
    slot, interleaved = rope_layout(model)
    kp, vp = cache.pool_keys, cache.pool_values
    if slot == "values":                # MLA: the rotary key is the values pool (swap roles)
        kp, vp = vp, kp
    for chunk, pos in chunks:
        n, delta = len(chunk), pos - chunk.start
        mats = _rotations(model, delta, kp.dtype, kp.shape[-1], rot_cache, interleaved) if rotate and delta else None
        shared = mats is None or all(m is mats[0] for m in mats)
        rot_src, copy_src = (chunk.keys, chunk.values) if slot == "keys" else (chunk.values, chunk.keys)
        for b in range(kp.shape[0]):
            if chunk.stacked is not None and shared:
                K, V = chunk.stacked if slot == "keys" else chunk.stacked[::-1]
                _rotate_copy(K[:, 0], None if mats is None else mats[0], kp[b, :, :, pos:pos + n])
                vp[b, :, :, pos:pos + n].copy_(V[:, 0])
                continue
            for l in range(kp.shape[1]):
                _rotate_copy(rot_src[l][0], None if mats is None else mats[l], kp[b, l, :, pos:pos + n])
                vp[b, l, :, pos:pos + n].copy_(copy_src[l][0])


@torch.no_grad()
def compose_one_pass(model, parts: Sequence, rotate: bool = True, seam: int = 0, cache: SlotCache | None = None,
                     rot_cache: dict | None = None) -> tuple[SlotCache, torch.Tensor | None]:
    """:func:`compose` in one model forward (same semantics, same rows for every chunk).

    1. every chunk's K/V are written at their slots ``p .. p + n - 1`` of a
       :class:`kvnotes.ops.slots.SlotCache`, keys rotated by ``p - chunk.start`` (``rotate``) by one
       GEMM with :func:`kvnotes.kv.rope.rotation_matrix`;
    2. one forward of all live tokens and every chunk's first ``min(seam, n)`` tokens at their
       positions ``[0 .. p + s - 1, p + n .. L - 1]`` (for prefix | chunk | suffix); their K/V go to
       their slots (overwriting the chunk's seam slots) and each attends lower-right causally to all
       slots before its own (:func:`kvnotes.ops.slots._one_pass_attention`): the prefix and seam
       rows to the prefix and seam, a suffix row to prefix, seam, rotated chunk tail and the suffix
       before it, which is what :func:`compose`'s two forwards compute.

    This halves the weight reads and launches of the two-forward path, and attention reads only
    the held slots with the flash kernel (GQA without repeating K/V, no ``[q, L]`` mask).

    Args:
        parts: as :func:`compose`; a chunk part is one :class:`kvnotes.ops.chunk.Chunk` (no per-row
            lists).
        rotate: one value for every row.
        seam: one value for every row.
        cache: a :class:`kvnotes.ops.slots.SlotCache` to write into (``B`` rows, ``max_len >= L``),
            e.g. a pool reused across calls; default: a new one of exactly ``L`` slots
            (``torch.empty``).
        rot_cache: dict in which rotation matrices are kept per delta across calls.

    Returns:
        (the cache, holding ``L`` positions; fp32 logits ``[B, vocab]`` at the last position when
        the last part is live, else None).

    Raises:
        ValueError: sliding-window models, per-row values, or a cache that is too small.
        KvnotesError: from :func:`kvnotes.kv.rope.delta_rotations`; an image chunk (use
            :func:`compose`).
    """
    if has_sliding_layers(model):
        raise ValueError("compose_one_pass does not handle sliding-window layers (use compose())")
    plan = _plan(model, parts, seam, rotate)
    if cache is None:
        cache = SlotCache.empty(model, plan.B, plan.total)
    elif cache.pool_keys.shape[0] != plan.B or cache.max_len < plan.total:
        raise ValueError(f"cache of {cache.pool_keys.shape[0]} rows x {cache.max_len} slots "
                         f"for {plan.B} x {plan.total}")
    _splice_one_pass(model, cache, plan.chunks, bool(rotate), {} if rot_cache is None else rot_cache)
    cache.set_length(plan.total)
    if plan.ids is None:
        return cache, None
    logits = _forward_one_pass(model, cache, plan.ids, plan.slots, plan.runs)
    return cache, logits[:, -1].float() if plan.logits else None


class ComposeRunner(SlotRunner):
    """:func:`compose_one_pass` as a serving engine runs it: one KV pool reused by every call,
    rotation matrices kept per delta, and on CUDA the forward captured as a CUDA graph once per
    token layout (rows, forwarded tokens, runs of positions) and replayed (the pool and graphs of
    :class:`kvnotes.ops.slots.SlotRunner`).

    A call ``runner(parts, rotate, seam)`` returns what :func:`compose_one_pass` returns. The
    returned cache *is* the pool (rows ``B``, ``max_len`` slots, ``L`` held): it is valid until the
    next call, which overwrites the slots it uses (every slot ``< L`` is written by each call, so
    nothing of an earlier prompt is read). Capturing a layout's graph happens in its first call (two
    eager warm-up forwards and the capture); the K/V splice runs eagerly before each replay.

    Args:
        max_len: slots of the pool (the longest prompt).
        batch: rows of every call.
        graphs: capture CUDA graphs (default: on CUDA).
    """

    def __init__(self, model, max_len: int, batch: int = 1, graphs: bool | None = None) -> None:
        super().__init__(model, max_len, batch, graphs)
        self.rot_cache: dict = {}

    @torch.no_grad()
    def __call__(self, parts: Sequence, rotate: bool = True, seam: int = 0) -> tuple[SlotCache, torch.Tensor | None]:
        plan = _plan(self.model, parts, seam, rotate)
        if plan.B != self.batch or plan.total > self.cache.max_len:
            raise ValueError(f"runner of {self.batch} rows x {self.cache.max_len} slots for {plan.B} x {plan.total}")
        _splice_one_pass(self.model, self.cache, plan.chunks, bool(rotate), self.rot_cache)
        self.cache.set_length(plan.total)
        if plan.ids is None:
            return self.cache, None
        logits = self.forward_slots(plan.ids, plan.slots, plan.runs)
        return self.cache, logits[:, -1].float() if plan.logits else None


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Reference: full prefill of ``ids`` (``[m]`` or ``[B, m]``) computing only the last position's
    logits; fp32 ``[B, vocab]``."""
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    return _forward(model, DynamicCache(config=model.config), ids, 0, True)


def decision_metrics(full: torch.Tensor, composed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Agreement of a composed run with the full prefill at the decision position.

    Args:
        full: fp32 logits ``[B, vocab]``.
        composed: fp32 logits ``[B, vocab]``.

    Returns:
        per row: ``kl`` = KL(full || composed) in nats (``sum p_full (log p_full - log p_comp)``
        over the log-softmax), ``top1_agree`` (bool: same vocabulary argmax), ``logit_cosine``
        (cosine of the two logit vectors, reported only for comparability with the paper: the
        no-rotate control also scores high on it).
    """
    lf, lc = torch.log_softmax(full, -1), torch.log_softmax(composed, -1)
    kl = kl_nats(lf, lc)
    return {"kl": kl, "top1_agree": full.argmax(-1) == composed.argmax(-1),
            "logit_cosine": torch.nn.functional.cosine_similarity(full, composed, dim=-1)}
