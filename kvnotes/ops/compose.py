"""Composing caches: precompile a chunk, re-position its keys, splice it after a prefix (paper §5).

A *chunk* (a policy, a table, a retrieved document) is prefilled once in isolation, optionally
behind a *sink* prefix (the BOS token, or a system prefix) whose K/V are dropped afterwards. To use
it at another position its keys are rotated by the position delta and its K/V are spliced after the
real prefix; the live tokens that follow are computed normally against the composed cache.

**Re-positioning.** RoPE rotates each key at position ``i`` by the angle ``i * inv_freq`` (per
frequency pair), and rotations compose, so a post-RoPE key at ``i`` becomes the key at ``i + delta``
by one further rotation by ``delta * inv_freq``. That delta rotation is taken from the model's own
rotary module (the adapter's ``rotary`` path, called with ``position_ids = [[delta]]``), never from
a hand-copied frequency formula, so it follows

- the layer type: a rotary module whose ``forward`` takes ``layer_type`` (Gemma-3) is called once
  per type, so sliding layers get the local theta and full layers the global one;
- the rope scaling of the config (``linear``, ``llama3``, ``yarn``): these change ``inv_freq`` only.
  The module multiplies cos/sin by its ``attention_scaling`` (YaRN's mscale), which the cached key
  already carries once; the delta rotation divides it out so it is a pure rotation;
- partial rotary (StableLM, Phi, GPT-NeoX): the module's cos/sin cover only the first
  ``rot_dim = cos.shape[-1]`` dims of each head; only those are rotated, the rest are copied.

The ``rotate_half`` layout (pairs ``(j, j + rot_dim/2)``) of Llama, Qwen, Mistral, Gemma and
StableLM is assumed; rope types whose frequencies depend on the sequence length (``dynamic``,
``longrope``) are refused (a delta rotation is not defined for them).

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
model forward instead of one per live part: the chunks' K/V are written first (keys of every layer
rotated by one batched GEMM with :func:`rotation_matrix`), then all live and seam tokens are
forwarded together at their positions, each attending lower-right causally to every slot before
its own. :class:`ComposeRunner` runs it on a reused KV pool and, on CUDA, replays that forward as a
CUDA graph captured once per token layout. Both need a model without sliding-window layers and one
chunk, seam and rotation for every row.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvnotes.kv import cache as kvcache
from kvnotes.models.adapters import Adapter
from kvnotes.errors import KvnotesError

#: Rope types whose frequencies do not depend on the sequence length: a delta rotation exists.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Chunk:
    """A chunk's K/V, prefilled in isolation.

    Attributes:
        ids: chunk token ids ``[n]``.
        keys, values: per layer ``[1, kv_heads, n, head_dim]``; keys post-RoPE at positions
            ``start .. start + n - 1``. Every layer holds every chunk position (also sliding layers).
        start: position of the chunk's first token when it was prefilled (the sink length, plus any
            ``offset`` given to :func:`precompile`).
        sink: number of sink tokens it was prefilled behind (their K/V are dropped).
    """

    ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int
    sink: int = 0
    #: ``(keys, values)`` stacked over layers, ``[layers, 1, kv_heads, n, head_dim]``, of which
    #: ``keys``/``values`` are views (None when the layers differ in shape): lets
    #: :func:`compose_one_pass` rotate and copy every layer in one kernel each.
    stacked: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    #: M-RoPE chunks prefilled with 3-D positions: ``[3, n]`` (temporal, height, width) of its
    #: tokens; None when the chunk's positions are ``start .. start + n - 1`` in every channel.
    positions: torch.Tensor | None = field(default=None, compare=False)
    #: ``image_grid_thw`` ``[k, 3]`` of the images whose tokens the chunk holds (precompiled with the
    #: vision tower); None for a text chunk. :func:`compose` needs it for the prompt's 3-D positions.
    image_grid_thw: torch.Tensor | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@torch.no_grad()
def precompile(model, ids: torch.Tensor, sink_ids: torch.Tensor | None = None, offset: int = 0,
               positions: torch.Tensor | None = None, **inputs) -> Chunk:
    """Prefill a chunk in isolation and keep its K/V.

    The chunk is prefilled behind ``sink_ids`` (if any) at positions ``offset ..`` in one forward on
    a cache whose layers all keep every position, so sliding-window layers also return the whole
    chunk (within the forward, attention still follows each layer's window). The sink's K/V are
    dropped.

    Args:
        ids: ``[n]`` chunk token ids.
        sink_ids: ``[k]`` tokens prefilled before the chunk and dropped (e.g. BOS or a system
            prefix; the paper's precompiled chunks lacked it, which collapsed Gemma on short prompts).
        offset: position of the first prefilled token (0 except in tests).
        positions: M-RoPE only: ``[3, k + n]`` position ids of sink and chunk (e.g. their columns of
            :func:`kvnotes.ops.mrope.positions` of a longer prompt). Default: when ``inputs`` carry
            an ``image_grid_thw`` / ``video_grid_thw``, the model's own bookkeeping of sink + chunk
            (:func:`kvnotes.ops.mrope.positions`) plus ``offset``; else 1-D ``offset ..``.
        inputs: further model inputs of sink + chunk (``pixel_values``, ``image_grid_thw``, ...).

    Returns:
        a :class:`Chunk` with ``start = offset + k`` (3-D: the temporal position of its first
        token), ``positions`` its ``[3, n]`` positions when 3-D and ``image_grid_thw`` the grids of
        the images among its own tokens (not the sink's); its per-layer K/V are views of one
        tensor stacked over layers (``Chunk.stacked``) when every layer has the same shape.

    Raises:
        KvnotesError: ``positions`` that are not ``[3, k + n]``, 3-D positions on a model
            without M-RoPE, or image tokens that do not match ``image_grid_thw``.
    """
    from kvnotes.ops import mrope

    ids = ids.view(-1)
    sink = ids.new_zeros(0) if sink_ids is None else sink_ids.view(-1).to(ids.device)
    full = torch.cat([sink, ids]).view(1, -1).to(model.device)
    k = len(sink)
    grid = inputs.get("image_grid_thw")
    grid = None if grid is None else mrope.own_grids(model, ids.cpu(), sink.cpu(), grid)
    if positions is None and (inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None):
        positions = mrope.positions(model, full, **inputs) + offset
    if positions is not None:
        if tuple(positions.shape) != (3, full.shape[1]) or not mrope.is_mrope(model):
            raise KvnotesError(f"precompile: positions of shape {tuple(positions.shape)} for {full.shape[1]} tokens "
                               f"(need [3, {full.shape[1]}] on an M-RoPE model)")
        pos = positions.to(model.device, torch.long).unsqueeze(1)
    else:
        pos = torch.arange(offset, offset + full.shape[1], device=model.device).unsqueeze(0)
    cache = kvcache.AllSlotCache()          # every layer keeps every position
    model(input_ids=full, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1, **inputs)
    keys, values = [l.keys[:, :, k:] for l in cache.layers], [l.values[:, :, k:] for l in cache.layers]
    del cache
    stacked = None
    if len({(t.shape, t.dtype) for t in keys}) == 1 and len({(t.shape, t.dtype) for t in values}) == 1:
        stacked = (torch.stack(keys), torch.stack(values))
        keys, values = list(stacked[0].unbind(0)), list(stacked[1].unbind(0))
    if positions is None:
        return Chunk(ids.cpu(), keys, values, offset + k, k, stacked)
    own = pos[:, 0, k:].cpu()
    return Chunk(ids.cpu(), keys, values, int(own[0, 0]), k, stacked, own, grid)


def move(model, chunk: Chunk, target) -> Chunk:
    """The chunk re-positioned: its K/V as if its tokens sat at ``target`` (:func:`reposition`).

    Args:
        target: the new position of its first token (an int: every token and every M-RoPE channel
            moves by ``target - chunk.start``), or ``[3, n]`` M-RoPE positions of its tokens in the
            prompt it moves into (e.g. their columns of :func:`kvnotes.ops.mrope.positions`): each
            token turns by its own per-channel delta.

    Returns:
        a new :class:`Chunk` (no ``stacked``), ``start`` and ``positions`` updated.

    Raises:
        KvnotesError: 3-D targets on a model without M-RoPE, or of the wrong shape
            (:func:`kvnotes.ops.mrope.deltas`).
    """
    from kvnotes.ops import mrope

    n = len(chunk)
    if isinstance(target, torch.Tensor):
        source = chunk.positions
        if source is None:
            source = torch.arange(chunk.start, chunk.start + n).expand(3, -1)
        delta = mrope.deltas(source, target.cpu())
        keys, values = reposition(model, chunk.keys, chunk.values, delta)
        return Chunk(chunk.ids, keys, values, int(target[0, 0]), chunk.sink, None, target.cpu(), chunk.image_grid_thw)
    delta = int(target) - chunk.start
    keys, values = reposition(model, chunk.keys, chunk.values, delta)
    moved = None if chunk.positions is None else chunk.positions + delta
    return Chunk(chunk.ids, keys, values, int(target), chunk.sink, None, moved, chunk.image_grid_thw)


def _rope_type(rotary, layer_type: str | None) -> str:
    rt = getattr(rotary, "rope_type", "default")
    if isinstance(rt, dict):
        rt = rt.get(layer_type, "default")
    return rt


def _cos_sin(out) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary module's output as ``(cos, sin)`` ``[..., rot_dim]`` with ``cos[..., :rot_dim/2]``
    the per-pair values: a ``(cos, sin)`` pair as returned (rotate_half modules, ``cat(f, f)``), or
    one complex tensor ``[..., rot_dim/2]`` (DeepSeek-V2's ``freqs_cis``) spread the same way."""
    if isinstance(out, torch.Tensor) and out.is_complex():
        return torch.cat([out.real, out.real], -1), torch.cat([out.imag, out.imag], -1)
    return out


@torch.no_grad()
def delta_rotations(model, delta) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pure rotation by ``delta`` positions as ``(cos, sin)``, each ``[rot_dim]`` fp32
    (per-token deltas: ``[n, rot_dim]``).

    Taken from the model's rotary module (adapter path ``rotary``) at ``position_ids = [[delta]]``,
    once per layer type when the module is per-type (Gemma-3), with the module's
    ``attention_scaling`` divided out (it is already inside every cached key; paper §5, YaRN). A
    module returning complex ``freqs_cis`` (DeepSeek-V2) is read as ``cos = Re``, ``sin = Im``.

    Args:
        delta: an int (every token moves by it; on an M-RoPE model all three channels move), or
            per-token deltas: ``[n]`` (1-D positions) or ``[3, n]`` (M-RoPE temporal, height, width
            deltas, mapped to per-pair angles by the module's own sections / interleaving).

    Raises:
        KvnotesError: a rope type whose frequencies depend on the sequence length
            (see :data:`STATIC_ROPE_TYPES`), or ``[3, n]`` deltas on a model without M-RoPE.
    """
    adapter = Adapter.for_model(model)
    rotary = adapter.module(model, "rotary")
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    x = torch.zeros(1, dtype=torch.float32, device=model.device)
    per_token = isinstance(delta, torch.Tensor)
    if not per_token:
        pos = torch.tensor([[delta]], dtype=torch.long, device=model.device)
    elif delta.dim() == 2:
        if getattr(rotary, "mrope_section", None) is None:
            raise KvnotesError(f"3-D position deltas on model_type '{adapter.model_type}', whose rotary "
                               f"embedding has no M-RoPE sections")
        pos = delta.to(model.device, torch.long).unsqueeze(1)          # [3, 1, n]
    else:
        pos = delta.to(model.device, torch.long).view(1, -1)
    by_type = {}
    for lt in dict.fromkeys(adapter.layer_types):
        key = lt if per_type else None
        if key in by_type:
            continue
        rt = _rope_type(rotary, key)
        if rt not in STATIC_ROPE_TYPES:
            raise KvnotesError(f"cannot re-position keys under rope type '{rt}' (supported: {', '.join(STATIC_ROPE_TYPES)})")
        if per_type:
            cos, sin = _cos_sin(rotary(x, pos, layer_type=lt))
            scale = getattr(rotary, f"{lt}_attention_scaling", 1.0)
        else:
            cos, sin = _cos_sin(rotary(x, pos))
            scale = getattr(rotary, "attention_scaling", 1.0)
        shape = (-1, cos.shape[-1]) if per_token else (-1,)
        by_type[key] = (cos.reshape(shape).float() / scale, sin.reshape(shape).float() / scale)
    return [by_type[lt if per_type else None] for lt in adapter.layer_types]


def rotate_into(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                interleaved: bool = False) -> torch.Tensor:
    """Write ``keys`` rotated by ``(cos, sin)`` into ``out`` (``rotate_half`` layout, partial rotary).

    ``out[..., :r] = keys[..., :r] * cos + rotate_half(keys[..., :r]) * sin`` with ``r = len(cos)``
    and ``out[..., r:] = keys[..., r:]``; computed in fp32 and cast to ``out``'s dtype. ``out`` may
    be ``keys`` itself (the halves are computed before writing) or a slice of a preallocated cache.
    With ``interleaved`` the pairs are ``(2j, 2j + 1)`` (DeepSeek's layout; pair ``j`` still turns
    by ``cos[..., j]``, ``sin[..., j]``) instead of ``(j, j + r/2)``.

    Args:
        keys: ``[..., n, head_dim]``, post-RoPE keys (MLA: the cached rotary keys ``k_rot``).
        cos: ``[rot_dim]`` from :func:`delta_rotations`, or ``[n, rot_dim]`` (one rotation per token).
        sin: as ``cos``.
        out: a tensor of ``keys``' shape (broadcast over batch allowed).
        interleaved: pairs ``(2j, 2j + 1)``.

    Returns:
        ``out``.
    """
    r = cos.shape[-1]
    h = r // 2
    c, s = cos[..., :h].to(keys.device), sin[..., :h].to(keys.device)
    one, two = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, h), slice(h, r))
    k1, k2 = keys[..., one].float(), keys[..., two].float()
    first = k1 * c - k2 * s
    second = k2 * c + k1 * s
    out[..., one] = first
    out[..., two] = second
    if r < keys.shape[-1] and out.data_ptr() != keys.data_ptr():
        out[..., r:] = keys[..., r:]
    return out


def rope_layout(model) -> tuple[str, bool]:
    """``(slot, interleaved)``: which cache tensor of a layer carries the rotary sub-vector
    (``"keys"``, or ``"values"`` for MLA whose cache holds the latent and ``k_rot``) and whether its
    pairs are interleaved; from the adapter (``adapters.yaml``, ``rope``)."""
    a = Adapter.for_model(model)
    return a.rope_slot, a.rope_interleaved


def _rotated(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
             rots: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    slot, interleaved = rope_layout(model)
    moving = keys if slot == "keys" else values
    moved = [rotate_into(t, c, sn, torch.empty_like(t), interleaved) for t, (c, sn) in zip(moving, rots, strict=True)]
    return (moved, list(values)) if slot == "keys" else (list(keys), moved)


def reposition(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               delta) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer cached K/V of tokens moved by ``delta`` positions.

    Only the part that carries the rotary sub-vector is rotated (:func:`rope_layout`): the keys'
    first ``rot_dim`` dims (Llama-style, partial rotary), or for MLA the cached ``k_rot`` (the
    cache's ``values`` slot in transformers' layout); everything else is returned as given (the same
    tensors, not copies).

    Args:
        keys: per layer, as a cache layer holds them (``[batch, heads, n, dim]``).
        values: per layer, likewise.
        delta: as :func:`delta_rotations` (an int, or per-token ``[n]`` / M-RoPE ``[3, n]`` deltas).

    Returns:
        (keys, values), new tensors for the rotated side.

    Raises:
        KvnotesError: from :func:`delta_rotations`.
    """
    return _rotated(model, keys, values, delta_rotations(model, delta))


def rotate_keys(model, keys: Sequence[torch.Tensor], delta: int) -> list[torch.Tensor]:
    """Per layer keys re-positioned by ``delta`` (new tensors; see :func:`rotate_into`).

    Args:
        keys: per layer ``[batch, kv_heads, n, head_dim]`` post-RoPE keys.

    Raises:
        KvnotesError: the model caches its rotary sub-vector outside the keys (MLA: use
            :func:`reposition`), or from :func:`delta_rotations`.
    """
    slot, interleaved = rope_layout(model)
    if slot != "keys":
        raise KvnotesError(f"model_type '{model.config.model_type}' caches its rotary key in the '{slot}' slot; "
                           f"re-position with kvnotes.ops.compose.reposition")
    rots = delta_rotations(model, delta)
    return [rotate_into(k, c, s, torch.empty_like(k), interleaved) for k, (c, s) in zip(keys, rots, strict=True)]


def has_sliding_layers(model) -> bool:
    """True when some layer uses sliding-window attention (then :func:`compose` uses a DynamicCache)."""
    return any(t == "sliding_attention" for t in Adapter.for_model(model).layer_types)


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
    slot) and every chunk is moved by its per-token, per-channel delta (:func:`move`) before it is
    spliced (``rotate=False``: spliced as precompiled). The image is not re-encoded: no pixel
    values reach the forwards. Such a chunk takes ``seam=0``.

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
        KvnotesError: from :func:`delta_rotations`; a live part holding image tokens, seam repair
            of an image chunk (:func:`_image_positions`).
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

#: Name under which :func:`_one_pass_attention` is registered in transformers' ``AttentionInterface``.
ONE_PASS_ATTENTION = "kvnotes_one_pass"
#: Query runs of the forward in flight: ``((first row, end row, end slot), ...)``; None outside it.
_RUNS: ContextVar = ContextVar("kvnotes_one_pass_runs", default=None)


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    dtype: torch.dtype | None = None, interleaved: bool = False) -> torch.Tensor:
    """The delta rotation as a matrix ``R`` ``[head_dim, head_dim]`` with ``keys @ R`` equal to
    :func:`rotate_into` (``rotate_half`` pairs ``(j, j + r/2)`` for ``r = len(cos)``, or pairs
    ``(2j, 2j + 1)`` with ``interleaved``; identity on the dims ``>= r``, the partial-rotary ones).

    Built in fp32 from :func:`delta_rotations`' ``(cos, sin)`` and cast to ``dtype`` (the keys'
    dtype; the GEMM accumulates in fp32, and in bf16 the coefficients are rounded as the model's own
    bf16 ``cos``/``sin`` are).
    """
    r = cos.shape[-1]
    h = r // 2
    c, s = cos[:h].float(), sin[:h].float()
    R = torch.eye(head_dim, dtype=torch.float32, device=cos.device)
    j = torch.arange(h, device=cos.device)
    a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + h)
    R[a, a] = c
    R[b, b] = c
    R[b, a] = -s
    R[a, b] = s
    return R if dtype is None else R.to(dtype)


class _SlotLayer(StaticLayer):
    """A ``StaticLayer`` over given tensors ``[B, kv_heads, max_len, head_dim]`` whose ``update``
    writes the forwarded tokens' K/V at ``slots`` (``[q]`` slot indices, any order, gaps allowed)
    while ``slots`` is set, and appends after ``cumulative_length`` as ``StaticLayer`` otherwise."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True
        self.slots: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.slots is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys.index_copy_(2, self.slots, key_states)
        self.values.index_copy_(2, self.slots, value_states)
        return self.keys, self.values


class SlotCache(StaticCache):
    """A ``StaticCache`` whose layers are views of two pools (keys, values) ``[B, layers, kv_heads,
    max_len, head_dim]``, so a chunk's K/V are rotated and copied into all layers by one kernel each.

    Outside a one-pass forward it behaves as a ``StaticCache`` holding ``cumulative_length``
    positions: further tokens are appended after them while slots remain (slots past the held ones
    are masked by its attention; :meth:`empty` with ``zero=True`` keeps them finite).
    """

    def __init__(self, pool_keys: torch.Tensor, pool_values: torch.Tensor) -> None:
        layers = [_SlotLayer(pool_keys[:, l], pool_values[:, l]) for l in range(pool_keys.shape[1])]
        Cache.__init__(self, layers=layers)
        self.pool_keys, self.pool_values = pool_keys, pool_values

    @classmethod
    def empty(cls, model, batch: int, max_len: int, zero: bool = False) -> "SlotCache":
        """Pools for ``batch`` rows of ``max_len`` slots in the model's dtype (the adapter's cache
        geometry: ``cache_heads``, ``cache_key_dim`` / ``cache_value_dim``): uninitialised
        (``torch.empty``, no fill: every slot a prompt uses is written by it) or zeros."""
        a = Adapter.for_model(model)
        shape = (batch, a.n_layers, a.cache_heads, max_len)
        dtype = next(model.parameters()).dtype
        new = torch.zeros if zero else torch.empty
        return cls(new((*shape, a.cache_key_dim), dtype=dtype, device=model.device),
                   new((*shape, a.cache_value_dim), dtype=dtype, device=model.device))

    @property
    def max_len(self) -> int:
        return int(self.pool_keys.shape[3])

    def set_slots(self, slots: torch.Tensor | None) -> None:
        for layer in self.layers:
            layer.slots = slots

    def set_length(self, n: int) -> None:
        """Mark slots ``[0, n)`` as held (what ``get_seq_length`` and later appends see)."""
        for layer in self.layers:
            layer.cumulative_length.fill_(n)

    def all_slot_view(self, n: int, row: int = 0) -> kvcache.AllSlotCache:
        """Slots ``[0, n)`` of row ``row`` as an :class:`kvnotes.kv.cache.AllSlotCache` of views (no
        copy: a later write into the pool shows through), e.g. to read a decision with
        :func:`kvnotes.ops.edit.decision_logprobs`."""
        return kvcache.AllSlotCache.from_tensors([l.keys[row:row + 1, :, :n] for l in self.layers],
                                                 [l.values[row:row + 1, :, :n] for l in self.layers])


def _lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Attention of ``r`` queries at the last ``r`` of ``k``'s ``S`` slots, each to the slots up to
    its own (lower-right causal); ``q`` ``[B, heads, r, d]``, ``k``/``v`` ``[B, kv_heads, S, d]`` (GQA
    without repeating K/V). On CUDA the lower-right causal bias dispatches to the flash kernel (no
    mask tensor); on CPU the boolean mask ``[r, S]`` is built."""
    r, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if r == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.is_cuda:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(r, S), scale=scale,
                                                  enable_gqa=gqa)
        except TypeError:       # a torch whose causal bias takes no enable_gqa: the boolean mask below
            pass
    allowed = torch.arange(S, device=q.device)[None] <= torch.arange(S - r, S, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def _one_pass_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention for :func:`compose_one_pass` (an ``AttentionInterface`` function).

    ``query`` ``[B, heads, q, d]`` holds runs of consecutive positions; ``key``/``value`` are the
    whole slot pools ``[B, kv_heads, max_len, d]``. Run ``(r0, r1, end)`` (rows ``r0 .. r1 - 1`` at
    slots ``end - (r1 - r0) .. end - 1``) attends lower-right causally to slots ``[0, end)``: every
    forwarded token sees every slot before its own, which by then holds the prefix, the rotated
    chunk K/V or a token of this forward. The model's mask is not used (it is not built). Outside a
    one-pass forward this is plain ``sdpa``. Returns ``[B, q, heads, d]``.
    """
    runs = _RUNS.get()
    if runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("compose_one_pass: sliding windows, logit soft-capping and attention sinks are not supported")
    outs = [_lower_right(query[:, :, r0:r1], key[:, :, :end], value[:, :, :end], scaling) for r0, r1, end in runs]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ONE_PASS_ATTENTION, _one_pass_attention)


@contextmanager
def _one_pass(model, runs: tuple):
    """Within: the model's attention is :func:`_one_pass_attention` over ``runs``, selected with
    transformers' public ``set_attn_implementation`` (restored on exit). No mask is built for an
    implementation without a registered mask function, so the model passes ``attention_mask=None``
    down."""
    old = model.config._attn_implementation
    token = _RUNS.set(runs)
    model.set_attn_implementation(ONE_PASS_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(old)
        _RUNS.reset(token)


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


def position_runs(positions: Sequence[int]) -> tuple:
    """``(r0, r1, end)`` per run of consecutive ``positions`` (rows ``r0 .. r1 - 1`` at positions
    ``end - (r1 - r0) .. end - 1``), the layout :func:`_one_pass_attention` takes."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[i - 1] + 1))
            start = i
    return tuple(runs)


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


def _forward_one_pass(model, cache: SlotCache, ids: torch.Tensor, slots: torch.Tensor, runs: tuple) -> torch.Tensor:
    """The one forward: ``ids`` ``[B, q]`` at positions = slots ``slots`` ``[q]``; logits of the last row
    ``[B, 1, vocab]`` (model dtype)."""
    cache.set_slots(slots)
    try:
        with _one_pass(model, runs):
            out = model(input_ids=ids, position_ids=slots.view(1, -1).expand(ids.shape[0], -1), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
    finally:
        cache.set_slots(None)
    return out.logits


@torch.no_grad()
def compose_one_pass(model, parts: Sequence, rotate: bool = True, seam: int = 0, cache: SlotCache | None = None,
                     rot_cache: dict | None = None) -> tuple[SlotCache, torch.Tensor | None]:
    """:func:`compose` in one model forward (same semantics, same rows for every chunk).

    1. every chunk's K/V are written at their slots ``p .. p + n - 1`` of a :class:`SlotCache`, keys
       rotated by ``p - chunk.start`` (``rotate``) by one GEMM with :func:`rotation_matrix`;
    2. one forward of all live tokens and every chunk's first ``min(seam, n)`` tokens at their
       positions ``[0 .. p + s - 1, p + n .. L - 1]`` (for prefix | chunk | suffix); their K/V go to
       their slots (overwriting the chunk's seam slots) and each attends lower-right causally to all
       slots before its own (:func:`_one_pass_attention`): the prefix and seam rows to the prefix
       and seam, a suffix row to prefix, seam, rotated chunk tail and the suffix before it, which is
       what :func:`compose`'s two forwards compute.

    This halves the weight reads and launches of the two-forward path, and attention reads only
    the held slots with the flash kernel (GQA without repeating K/V, no ``[q, L]`` mask).

    Args:
        parts: as :func:`compose`; a chunk part is one :class:`Chunk` (no per-row lists).
        rotate: one value for every row.
        seam: one value for every row.
        cache: a :class:`SlotCache` to write into (``B`` rows, ``max_len >= L``), e.g. a pool reused
            across calls; default: a new one of exactly ``L`` slots (``torch.empty``).
        rot_cache: dict in which rotation matrices are kept per delta across calls.

    Returns:
        (the cache, holding ``L`` positions; fp32 logits ``[B, vocab]`` at the last position when
        the last part is live, else None).

    Raises:
        ValueError: sliding-window models, per-row values, or a cache that is too small.
        KvnotesError: from :func:`delta_rotations`; an image chunk (use :func:`compose`).
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


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class ComposeRunner:
    """:func:`compose_one_pass` as a serving engine runs it: one KV pool reused by every call,
    rotation matrices kept per delta, and on CUDA the forward captured as a CUDA graph once per
    token layout (rows, forwarded tokens, runs of positions) and replayed.

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
        if has_sliding_layers(model):
            raise ValueError("ComposeRunner does not handle sliding-window layers (use compose())")
        cuda = model.device.type == "cuda"
        self.graphs = cuda if graphs is None else bool(graphs)
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA model")
        self.model, self.batch = model, batch
        self.cache = SlotCache.empty(model, batch, max_len, zero=True)     # once: slots past a prompt stay finite
        self.rot_cache: dict = {}
        self._graphs: dict = {}

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

    def forward_slots(self, ids: torch.Tensor, slots: torch.Tensor, runs: tuple) -> torch.Tensor:
        """The one forward on the pool: ``ids`` ``[B, q]`` at positions = slots ``slots`` ``[q]``, in
        ``runs`` ``(r0, r1, end)`` of consecutive positions (each row attends to every slot before its
        own); eager, or the layout's CUDA graph (captured in its first call). Returns the last row's
        logits ``[B, 1, vocab]`` (model dtype; with graphs, a buffer the next replay overwrites)."""
        if not self.graphs:
            return _forward_one_pass(self.model, self.cache, ids, slots, runs)
        key = (tuple(ids.shape), runs)
        g = self._graphs.get(key) or self._capture(key, ids, slots, runs)
        g.ids.copy_(ids)
        g.graph.replay()
        return g.logits

    def _capture(self, key, ids: torch.Tensor, slots: torch.Tensor, runs: tuple) -> _Graph:
        """Capture the forward of one layout; its inputs become static buffers (the slots are fixed
        by the layout, the token ids are copied in before each replay)."""
        ids, slots = ids.clone(), slots.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _forward_one_pass(self.model, self.cache, ids, slots, runs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = _forward_one_pass(self.model, self.cache, ids, slots, runs)
        g = self._graphs[key] = _Graph(graph, ids, slots, logits)
        return g


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
    kl = (lf.exp() * (lf - lc)).sum(-1)
    return {"kl": kl, "top1_agree": full.argmax(-1) == composed.argmax(-1),
            "logit_cosine": torch.nn.functional.cosine_similarity(full, composed, dim=-1)}
