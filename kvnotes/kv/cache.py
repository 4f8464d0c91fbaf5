"""Cache surgery on the real ``transformers`` ``DynamicCache`` (transformers 5.x, docs/design.md §4).

Layout: ``cache.layers[i].keys/values`` are ``[batch, kv_heads, slots, head_dim]``, keys post-RoPE,
GQA not expanded. Every forward on a cache passes explicit ``position_ids`` (RoPE) and, when
batching, a full-length attention mask. Two kinds of cache, each with one prefill, view and
truncation:

- a **windowed** cache, a ``DynamicCache`` built with ``config=`` as the model would build it
  (:func:`prefill`, :func:`view`, :func:`prefix_view`): sliding-window layers keep their window, so
  once a window has filled a sliding layer holds only the last ``window - 1`` positions and slot
  ``j`` is position ``cumulative_length - n_slots + j``, not ``j``. The probes patch these.
- an **all-slot** cache, :class:`AllSlotCache` (:meth:`AllSlotCache.prefill`,
  :meth:`AllSlotCache.from_tensors`, :meth:`AllSlotCache.truncate`): every layer holds every
  position (sliding windows are applied by the attention mask), so slot ``j`` is position ``j`` in
  every layer. The edit operations (:mod:`kvnotes.ops.edit`) work on these.

The third kind, the pooled static cache of one-forward composition, is
:class:`kvnotes.ops.slots.SlotCache`.

A *patch mask* is a bool tensor ``[V, n_layers, T]`` over the prefix positions ``[0, T)``: variant
``v`` takes layer ``l``'s key/value at position ``p`` from the source ("new") cache where the mask
is true and from the base ("old") cache elsewhere. :func:`build_variants` materialises those caches
explicitly (tests, engines, generation); the batched patched readout that never builds them is
:mod:`kvnotes.kv.patch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvnotes.kv.masks import Masks, head_layer_mask

DEFAULT_BUDGET_BYTES = 1 << 30
#: Share of a GPU's free memory (after the model and its clean runs) ``budget_mb: auto`` gives one
#: chunk of batched variants.
GPU_BUDGET_SHARE = 0.25


def budget_bytes(budget_mb: float | str, device: torch.device | str) -> int:
    """The memory budget (bytes) for one chunk of batched variants (``budget_mb`` of
    ``conf/config.yaml``): ``budget_mb`` MiB, or for ``auto`` :data:`DEFAULT_BUDGET_BYTES` (1 GiB)
    on the CPU and :data:`GPU_BUDGET_SHARE` of the GPU's free memory, at least 1 GiB, on CUDA. A
    fixed 1 GiB on a GPU starves the long-prompt paths: at 8k tokens one Qwen3-8B variant cache
    alone takes 1.2 GB, so the single-position map fell to one variant per forward.

    Raises:
        ValueError: ``budget_mb`` is neither ``auto`` nor a positive number.
    """
    if budget_mb == "auto":
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return max(DEFAULT_BUDGET_BYTES, int(free * GPU_BUDGET_SHARE))
        return DEFAULT_BUDGET_BYTES
    mb = float(budget_mb)
    if not mb > 0:
        raise ValueError(f"budget_mb must be auto or a positive number of MiB, got {budget_mb!r}")
    return int(mb * (1 << 20))


def slot_positions(layer) -> torch.Tensor:
    """Absolute positions held by a cache layer's slots, shape ``[n_slots]`` (long).

    Full layers hold ``0..n-1``; a filled sliding layer holds ``cumulative_length - n .. cumulative_length - 1``.
    """
    n = layer.keys.shape[-2]
    end = getattr(layer, "cumulative_length", n) if getattr(layer, "is_sliding", False) else n
    return torch.arange(end - n, end, device=layer.keys.device)


def seq_length(cache: DynamicCache) -> int:
    """Number of positions the cache has seen (not slots held)."""
    return max(int(slot_positions(layer)[-1]) + 1 if layer.keys.shape[-2] else 0 for layer in cache.layers)


def cache_from_tensors(config, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                       seen: int) -> DynamicCache:
    """A windowed ``DynamicCache`` (built with ``config=``) whose layers reference the given tensors;
    ``config=None`` gives an :class:`AllSlotCache` (:meth:`AllSlotCache.from_tensors`).

    No copy is made: a forward on the new cache concatenates into fresh tensors, so the inputs are
    never modified. ``seen`` is the number of positions the tensors represent (sliding layers may
    hold fewer slots than that).

    Args:
        keys: per layer ``[batch, kv_heads, slots, head_dim]``.
        values: per layer ``[batch, kv_heads, slots, head_dim]``.
    """
    if config is None:
        return AllSlotCache.from_tensors(keys, values)
    cache = DynamicCache(config=config)
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = seen
    return cache


class AllSlotCache(DynamicCache):
    """A ``DynamicCache`` whose every layer is a plain ``DynamicLayer`` holding every position, also
    for sliding-window layers (their window is applied through the attention mask): slot ``j`` is
    position ``j`` in every layer. Built empty (``AllSlotCache()``, grown by forwards), by
    :meth:`prefill` or :meth:`from_tensors`; :meth:`truncate` views a prefix."""

    def __init__(self) -> None:
        super().__init__()

    @classmethod
    def from_tensors(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> AllSlotCache:
        """An all-slot cache over the given tensors (referenced, not copied; a forward on it
        concatenates into fresh tensors, so the inputs are never modified).

        Args:
            keys: per layer ``[batch, kv_heads, positions, head_dim]``.
            values: per layer ``[batch, kv_heads, positions, head_dim]``.
        """
        cache = cls()
        cache.layers = [DynamicLayer() for _ in keys]
        for layer, k, v in zip(cache.layers, keys, values, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    @classmethod
    def prefill(cls, model, ids: torch.Tensor) -> AllSlotCache:
        """The all-slot prefix cache of ``ids`` (``[T]``), positions ``0..T-1``."""
        return extend(model, None, ids, 0)

    def truncate(self, n: int) -> AllSlotCache:
        """A view over positions ``[0, n)`` (slices, no copy)."""
        check_all_slots(self)
        return AllSlotCache.from_tensors([l.keys[:, :, :n] for l in self.layers],
                                         [l.values[:, :, :n] for l in self.layers])


def check_all_slots(cache: DynamicCache) -> int:
    """Number of positions of an all-slot cache.

    Raises:
        ValueError: a layer is a sliding-window layer or holds fewer slots than positions.
    """
    n = cache.layers[0].keys.shape[-2]
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or layer.keys.shape[-2] != n:
            raise ValueError(f"layer {i} does not hold every position; edit caches must be all-slot caches "
                             f"(kvnotes.kv.cache.AllSlotCache)")
    return n


@torch.no_grad()
def extend(model, cache: AllSlotCache | None, ids: torch.Tensor, start: int) -> AllSlotCache:
    """Forward ``ids`` (``[n]``) at positions ``start ..`` on top of the all-slot ``cache`` (over
    ``[0, start)``; None for an empty prefix) and return the extended cache; ``cache`` itself is left
    unchanged."""
    ids = ids.view(1, -1).to(model.device)
    n = ids.shape[1]
    work = AllSlotCache() if cache is None or start == 0 else cache.truncate(start)
    pos = torch.arange(start, start + n, device=model.device).unsqueeze(0)
    mask = torch.ones(1, start + n, dtype=torch.long, device=model.device)
    model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=work, use_cache=True,
          logits_to_keep=1)
    return work


def view(cache: DynamicCache, config) -> DynamicCache:
    """A new cache object over the same tensors (forwards on it leave ``cache`` unchanged)."""
    return cache_from_tensors(config, [l.keys for l in cache.layers], [l.values for l in cache.layers],
                              seq_length(cache))


def expand_cache(cache: DynamicCache, config, V: int) -> DynamicCache:
    """A batch-``V`` view of a batch-1 cache (``expand``, no copy); forwards on it leave ``cache``
    unchanged. A batch-``V`` cache is returned as a fresh view.

    Raises:
        ValueError: the cache batch is neither 1 nor ``V``.
    """
    b = cache.layers[0].keys.shape[0]
    if b not in (1, V):
        raise ValueError(f"cannot broadcast a batch-{b} cache to {V} variants")
    keys = [l.keys.expand(V, -1, -1, -1) for l in cache.layers]
    values = [l.values.expand(V, -1, -1, -1) for l in cache.layers]
    return cache_from_tensors(config, keys, values, seq_length(cache))


def prefix_view(cache: DynamicCache, config, p: int) -> DynamicCache | None:
    """The cache over positions ``[0, p)`` as a view of ``cache`` (no copy): the one cache
    truncation of the project.

    Full layers keep slots ``[0, p)``. A sliding-window layer (window ``w``) keeps what it would
    hold after seeing ``p`` positions: ``[max(0, p - w + 1), p)``. Forwards on the result leave
    ``cache`` unchanged.

    Args:
        cache: batch-1 cache over ``[0, T)`` with ``T >= p``.
        p: number of positions to keep.

    Returns:
        the truncated cache, or None when a layer no longer holds a position it would need (a
        sliding window filled past ``p``, or ``T < p``); then ``[0, p)`` must be prefilled.
    """
    if p == 0:
        return DynamicCache(config=config)
    keys, values = [], []
    for layer in cache.layers:
        pos = slot_positions(layer)
        lo = max(0, p - layer.sliding_window + 1) if getattr(layer, "is_sliding", False) else 0
        if len(pos) == 0 or int(pos[0]) > lo or int(pos[-1]) < p - 1:
            return None
        keep = ((pos >= lo) & (pos < p)).nonzero().flatten()
        keys.append(layer.keys[:, :, keep])
        values.append(layer.values[:, :, keep])
    return cache_from_tensors(config, keys, values, p)


def prefix_cache(model, cache: DynamicCache | None, ids: torch.Tensor, p: int) -> DynamicCache:
    """A cache over positions ``[0, p)`` of the prompt ``ids`` (``[T]``): :func:`prefix_view` of
    ``cache`` when it still holds them, else a :func:`prefill` of ``ids[:p]``. This is the start of
    a write-side resume (docs/design.md §4): the prefill continues from ``p`` instead of re-running
    ``[0, p)``."""
    view_ = prefix_view(cache, model.config, p) if cache is not None else None
    return view_ if view_ is not None else prefill(model, ids[:p])


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> DynamicCache:
    """Run the prompt prefix ``ids`` (``[T]``, or ``[B, T]`` for ``B`` prompts of one length) and
    return its cache (batch 1 or ``B``).

    Positions are ``0..T-1`` passed explicitly; only the last position's logits are computed.
    """
    ids = (ids.view(1, -1) if ids.dim() == 1 else ids).to(model.device)
    cache = DynamicCache(config=model.config)
    pos = torch.arange(ids.shape[1], device=model.device).expand(ids.shape[0], -1)
    model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


@torch.no_grad()
def continuation_logprobs(model, cache: DynamicCache, tokens: torch.Tensor, start: int,
                          last_only: bool = False) -> torch.Tensor:
    """Log-probabilities (fp32) after feeding ``tokens`` at positions ``start..`` on top of ``cache``.

    Args:
        cache: batch ``V`` cache holding positions ``[0, start)``; it is extended in place, so pass a
            :func:`view` if it must be reused.
        tokens: ``[V, n]`` or ``[n]`` token ids fed at positions ``start .. start + n - 1``.
        last_only: compute the logits of the last position only (``logits_to_keep=1``).

    Returns:
        ``[V, n, vocab]`` log-softmax in fp32 (``[V, 1, vocab]`` with ``last_only``).
    """
    V = cache.layers[0].keys.shape[0]
    tokens = tokens.to(model.device)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0).expand(V, -1)
    n = tokens.shape[1]
    pos = torch.arange(start, start + n, device=model.device).unsqueeze(0).expand(V, -1)
    mask = torch.ones(V, start + n, dtype=torch.long, device=model.device)
    out = model(input_ids=tokens, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                logits_to_keep=1 if last_only else 0)
    return torch.log_softmax(out.logits.float(), dim=-1)


def variant_bytes(cache: DynamicCache) -> int:
    """Bytes of K and V one variant of ``cache`` occupies."""
    return sum(2 * l.keys[0].numel() * l.keys.element_size() for l in cache.layers)


def chunks(n: int, per_item: int, budget_bytes: int) -> Iterator[slice]:
    """Slices of ``range(n)`` with at most ``budget_bytes // per_item`` items (at least one)."""
    size = max(1, budget_bytes // max(per_item, 1))
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


def build_variants(config, base: DynamicCache, source: DynamicCache, masks: Masks) -> DynamicCache:
    """Variant caches: layer ``l``, position ``p`` from ``source`` where ``masks[v, l, p]``, else ``base``
    (per KV head for head masks, :func:`kvnotes.kv.masks.head_layer_mask`).

    Args:
        base: batch-1 caches over the same positions ``[0, T)`` (token-aligned prompts).
        source: batch-1 caches over the same positions ``[0, T)`` (token-aligned prompts).
        masks: bool ``[V, n_layers, T]`` (or :class:`kvnotes.kv.masks.FactoredMasks`).

    Returns:
        A batch-``V`` ``DynamicCache``.

    Raises:
        ValueError: the mask's layer or position count does not match the caches.
    """
    T = seq_length(base)
    if masks.shape[1] != len(base.layers) or masks.shape[2] != T or seq_length(source) != T:
        raise ValueError(f"mask {tuple(masks.shape)} does not fit caches of {len(base.layers)} layers x {T} positions")
    keys, values = [], []
    for l, (lb, ls) in enumerate(zip(base.layers, source.layers)):     # each layer where it lives (device maps)
        m = head_layer_mask(masks, l, lb.keys.shape[1]).to(lb.keys.device)[:, :, slot_positions(lb)][..., None]
        keys.append(torch.where(m, ls.keys, lb.keys))
        values.append(torch.where(m, ls.values, lb.values))
    return cache_from_tensors(config, keys, values, T)
