"""A precompiled chunk: its K/V prefilled once in isolation (:func:`precompile`) and moved to other
positions (:func:`move`).

A *chunk* (a policy, a table, a retrieved document) is prefilled once in isolation, optionally
behind a *sink* prefix (the BOS token, or a system prefix) whose K/V are dropped afterwards. To use
it at another position its keys are rotated by the position delta (:mod:`kvnotes.kv.rope`) and its
K/V are spliced after the real prefix (:mod:`kvnotes.ops.compose`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvnotes.kv import cache as kvcache
from kvnotes.kv.rope import reposition
from kvnotes.errors import KvnotesError


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
    #: :func:`kvnotes.ops.compose.compose_one_pass` rotate and copy every layer in one kernel each.
    stacked: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    #: M-RoPE chunks prefilled with 3-D positions: ``[3, n]`` (temporal, height, width) of its
    #: tokens; None when the chunk's positions are ``start .. start + n - 1`` in every channel.
    positions: torch.Tensor | None = field(default=None, compare=False)
    #: ``image_grid_thw`` ``[k, 3]`` of the images whose tokens the chunk holds (precompiled with the
    #: vision tower); None for a text chunk. :func:`kvnotes.ops.compose.compose` needs it for the
    #: prompt's 3-D positions.
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
    """The chunk re-positioned: its K/V as if its tokens sat at ``target`` (:func:`kvnotes.kv.rope.reposition`).

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
