"""The slot pool and its one forward, shared by :class:`kvnotes.ops.compose.ComposeRunner` and
:class:`kvnotes.ops.edit_runner.EditRunner`.

A :class:`SlotCache` is a ``StaticCache`` whose layers are views of two pools (keys, values)
``[B, layers, kv_heads, max_len, head_dim]``. One forward writes the K/V of its tokens at given
slots (their positions, any order, gaps allowed) and each token attends lower-right causally to
every slot before its own (an ``AttentionInterface`` function switched on for that forward only:
flash attention with GQA, no ``[q, L]`` mask, no repeated K/V); the other slots hold what the
caller wrote there before (a composed prompt's rotated chunk K/V, an edited prompt's kept
positions). :class:`SlotRunner` runs that forward on one pool reused by every call and, on CUDA,
replays it as a CUDA graph captured once per token layout. Models with sliding-window layers are
refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, StaticCache
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvnotes.kv import cache as kvcache
from kvnotes.models.adapters import Adapter


def has_sliding_layers(model) -> bool:
    """True when some layer uses sliding-window attention (then :func:`kvnotes.ops.compose.compose` uses a
    DynamicCache, and the slot pool is refused)."""
    return any(t == "sliding_attention" for t in Adapter.for_model(model).layer_types)


#: Name under which :func:`_one_pass_attention` is registered in transformers' ``AttentionInterface``.
ONE_PASS_ATTENTION = "kvnotes_one_pass"
#: Query runs of the forward in flight: ``((first row, end row, end slot), ...)``; None outside it.
_RUNS: ContextVar = ContextVar("kvnotes_one_pass_runs", default=None)


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
    """Attention for :func:`kvnotes.ops.compose.compose_one_pass` (an ``AttentionInterface`` function).

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


def position_runs(positions: Sequence[int]) -> tuple:
    """``(r0, r1, end)`` per run of consecutive ``positions`` (rows ``r0 .. r1 - 1`` at positions
    ``end - (r1 - r0) .. end - 1``), the layout :func:`_one_pass_attention` takes."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[i - 1] + 1))
            start = i
    return tuple(runs)


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


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class SlotRunner:
    """The one forward on a reused KV pool, as a serving engine runs it: one :class:`SlotCache` of
    ``batch`` rows and ``max_len`` slots (zeroed once) serves every call, and on CUDA the forward is
    captured as a CUDA graph once per token layout (rows, forwarded tokens, runs of positions) and
    replayed. Callers fill the pool's other slots before each call
    (:class:`kvnotes.ops.compose.ComposeRunner`: the chunks' rotated K/V;
    :class:`kvnotes.ops.edit_runner.EditRunner`: the cached positions it keeps).

    Args:
        max_len: slots of the pool (the longest prompt).
        batch: rows of every call.
        graphs: capture CUDA graphs (default: on CUDA).

    Raises:
        ValueError: sliding-window layers, or CUDA graphs on a CPU model.
    """

    def __init__(self, model, max_len: int, batch: int = 1, graphs: bool | None = None) -> None:
        if has_sliding_layers(model):
            raise ValueError(f"{type(self).__name__} does not handle sliding-window layers (use compose())")
        cuda = model.device.type == "cuda"
        self.graphs = cuda if graphs is None else bool(graphs)
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA model")
        self.model, self.batch = model, batch
        self.cache = SlotCache.empty(model, batch, max_len, zero=True)     # once: slots past a prompt stay finite
        self._graphs: dict = {}

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
