"""Editing a cached prompt: operations on a ``transformers`` ``DynamicCache`` and their cost
(paper "Models Take Notes at Prefill", §editing; ``docs/editing.md``).

Every operation takes the *stale* cache of the old prompt over positions ``[0, d)`` (``d`` = the
decision position, where the decision token is fed afterwards) and returns an :class:`Edited`:
the edited cache, the position at which the decision token goes, and the cost of the edit (tokens
forwarded, FLOPs from the model's shape, wall seconds). The decision-token step itself is common to
every method and not counted.

- :func:`full`: re-prefill of the new prompt (the reference);
- :func:`refresh_field`: the new field tokens forwarded against the unchanged prefix ``[0, a)`` and
  written in place (exact for the field: it attends only to the prefix); downstream stays stale;
- :func:`extend_from`: reuse the longest common token prefix of an edited prompt and forward the
  rest (the erratum, field + erratum and hoist edits; the prompts come from :mod:`kvnotes.harness.edit_prompts`);
- :func:`selective`: after a field refresh, *truly recompute* ``k`` downstream positions against the
  edited cache: one forward of those tokens at their own positions with a 4-D attention mask
  (:func:`selective_mask`): each attends to the cache as edited so far except the stale slots of
  the selected positions, and to the new states of earlier selected tokens and itself; the new K/V
  are written back in every layer. Its inputs are only the edited cache and the token ids;
- :func:`oracle_copy`: K/V copied from a full re-prefill of the new prompt at the same positions —
  an upper bound, never a cheap method;
- rankings of downstream positions: :func:`rank_attention` (decision-row attention on the stale
  cache), :func:`rank_kv_deviation` (CacheBlend: K/V deviation after recomputing the first layer),
  :func:`rank_last`, :func:`rank_random`.

**All-slot caches.** A hybrid cache built with ``config=`` keeps only the last ``window - 1``
positions of a sliding-window layer, so an edit of an earlier position is impossible there (the
states it needs are gone). Editing therefore works on caches whose every layer holds every position
(:class:`kvnotes.kv.cache.AllSlotCache`: ``AllSlotCache.prefill``); sliding layers keep their window semantics
through the attention mask (the model's own mask for plain forwards, :func:`selective_mask` for the
4-D path, with the window applied per layer type). :func:`check_all_slots` rejects other caches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvnotes.kv import cache as kvcache
from kvnotes.kv.cache import AllSlotCache, check_all_slots, extend
from kvnotes.kv.capture import attention_hook
from kvnotes.kv.knockout import additive_mask, eager_probabilities


@dataclass
class Edited:
    """An edited cache and what the edit cost.

    Attributes:
        cache: batch-1 all-slot cache over ``[0, pos)``.
        pos: position at which the decision token is fed.
        tokens: positions whose K/V were (re)computed through every layer.
        flops: forward FLOPs of the edit (:func:`forward_flops`), ranking included.
        seconds: wall time of the edit (ranking included).
        rank_tokens: extra work of a ranking in full-model-token equivalents (e.g. CacheBlend runs
            the downstream tokens through 2 of ``L`` layers: ``n * 2 / L``); 0 for other methods.
    """

    cache: AllSlotCache
    pos: int
    tokens: int
    flops: float
    seconds: float
    rank_tokens: float = 0.0


# --------------------------------------------------------------------------------------------- cost

def model_shape(config) -> dict:
    """The sizes the FLOP and byte counts use: ``L`` layers, hidden ``h``, ``H`` query heads, ``KVH``
    key/value heads, head dim ``hd``, MLP width ``I`` (of the text config of a wrapper)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    H = c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // H
    return {"L": c.num_hidden_layers, "h": c.hidden_size, "H": H, "KVH": getattr(c, "num_key_value_heads", H),
            "hd": hd, "I": c.intermediate_size}


def params_per_token(config, n_layers: int | None = None) -> int:
    """Weights a token passes through per layer stack: ``L * (h*hd*(2H + 2KVH) + 3*h*I)`` (Q, K, V,
    O projections and a gated MLP; embeddings, norms and the LM head excluded)."""
    s = model_shape(config)
    L = s["L"] if n_layers is None else n_layers
    return L * (s["h"] * s["hd"] * (2 * s["H"] + 2 * s["KVH"]) + 3 * s["h"] * s["I"])


def forward_flops(config, n_tokens: float, attended: float, n_layers: int | None = None) -> float:
    """Forward FLOPs of ``n_tokens`` tokens: ``2 * params_per_token * n_tokens`` (matmuls) plus
    ``4 * L * H * hd * attended`` (``QK^T`` and ``AV``; ``attended`` = number of (query, key) pairs,
    an upper bound for sliding-window layers). The usual estimate of Kaplan et al. (2020), §2.1."""
    s = model_shape(config)
    L = s["L"] if n_layers is None else n_layers
    return 2.0 * params_per_token(config, L) * n_tokens + 4.0 * L * s["H"] * s["hd"] * attended


def span_pairs(start: int, end: int) -> int:
    """(query, key) pairs of a causal forward of positions ``[start, end)``: ``sum (p + 1)``."""
    return (end * (end + 1) - start * (start + 1)) // 2


# ---------------------------------------------------------------------------------------- caches

@torch.no_grad()
def decision_logprobs(model, cache: AllSlotCache, token: int, pos: int) -> torch.Tensor:
    """fp32 log-probs ``[vocab]`` of the next token after feeding ``token`` at ``pos`` on a view of
    ``cache`` (over ``[0, pos)``; left unchanged)."""
    lp = kvcache.continuation_logprobs(model, cache.truncate(pos), torch.tensor([token]), pos)
    return lp[0, -1]


@torch.no_grad()
def decision_logprobs_batch(model, caches: Sequence[AllSlotCache], token: int, pos: int,
                            budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """:func:`decision_logprobs` of several all-slot caches over ``[0, pos)`` in batched forwards
    (caches stacked per chunk of ``budget_bytes``).

    Returns:
        ``[len(caches), vocab]`` fp32 log-probs.
    """
    out = []
    for sl in kvcache.chunks(len(caches), kvcache.variant_bytes(caches[0]), budget_bytes):
        out.append(kvcache.continuation_logprobs(model, stack(caches[sl], pos), torch.tensor([token]), pos)[:, -1])
    return torch.cat(out)


def stack(caches: Sequence[AllSlotCache], pos: int) -> AllSlotCache:
    """One batch-``len(caches)`` all-slot cache over ``[0, pos)`` from batch-1 caches (one copy)."""
    n_layers = len(caches[0].layers)
    return AllSlotCache.from_tensors([torch.cat([c.layers[l].keys[:, :, :pos] for c in caches]) for l in range(n_layers)],
                                     [torch.cat([c.layers[l].values[:, :, :pos] for c in caches]) for l in range(n_layers)])


def splice(cache: AllSlotCache, positions: torch.Tensor, keys: Sequence[torch.Tensor],
           values: Sequence[torch.Tensor]) -> AllSlotCache:
    """A new all-slot cache equal to ``cache`` with the slots at ``positions`` (``[k]``) replaced by
    ``keys[l]``/``values[l]`` (``[1, kv_heads, k, head_dim]``); one copy per layer."""
    ks, vs = [], []
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        nk, nv = layer.keys.clone(), layer.values.clone()
        pos = positions.to(nk.device)                  # a device map keeps each layer's K/V where it runs
        nk[:, :, pos] = k.to(nk.device, nk.dtype)
        nv[:, :, pos] = v.to(nv.device, nv.dtype)
        ks.append(nk)
        vs.append(nv)
    return AllSlotCache.from_tensors(ks, vs)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------------ operations

def full(model, new_ids: torch.Tensor, d: int) -> Edited:
    """Re-prefill of the new prompt's positions ``[0, d)`` (the reference)."""
    cache, sec = _timed(lambda: AllSlotCache.prefill(model, new_ids[:d]))
    return Edited(cache, d, d, forward_flops(model.config, d, span_pairs(0, d)), sec)


def refresh_field(model, stale: AllSlotCache, new_ids: torch.Tensor, field: tuple[int, int]) -> Edited:
    """Recompute the field span ``[a, b)`` from the new tokens against the unchanged prefix ``[0, a)``
    and write it in place; downstream ``[b, d)`` stays stale. Exact for the field positions."""
    a, b = field
    d = check_all_slots(stale)

    def op():
        rec = extend(model, stale.truncate(a), new_ids[a:b], a)
        pos = torch.arange(a, b, device=stale.layers[0].keys.device)
        return splice(stale, pos, [l.keys[:, :, a:b] for l in rec.layers], [l.values[:, :, a:b] for l in rec.layers])
    cache, sec = _timed(op)
    return Edited(cache, d, b - a, forward_flops(model.config, b - a, span_pairs(a, b)), sec)


def extend_from(model, cached: AllSlotCache, ids: torch.Tensor, reuse: int, d: int) -> Edited:
    """Reuse positions ``[0, reuse)`` of ``cached`` and forward ``ids[reuse:d]`` (an edited prompt
    aligned by its longest common token prefix, :func:`kvnotes.harness.edit_prompts.edited_prompt`)."""
    cache, sec = _timed(lambda: extend(model, cached, ids[reuse:d], reuse))
    return Edited(cache, d, d - reuse, forward_flops(model.config, d - reuse, span_pairs(reuse, d)), sec)


def _mask_for(allowed: torch.Tensor, model) -> torch.Tensor:
    """bool ``allowed`` -> the 4-D mask the model's attention implementation takes (bool for SDPA,
    additive float for eager)."""
    if model.config._attn_implementation == "eager":
        dtype = model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def selective_mask(model, d: int, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """4-D attention mask ``[1, 1, k, d + k]`` for recomputing ``positions`` (sorted, in ``[0, d)``)
    against an all-slot cache over ``[0, d)`` whose new states are appended at slots ``d .. d+k-1``.

    Row ``i`` (position ``p_i``) may attend to cached slot ``j`` when ``j < p_i`` and ``j`` is not a
    selected position (stale), and to appended slot ``d + i'`` when ``i' <= i``. Sliding-window
    layers additionally need ``p_i - pos(j) < window`` (transformers' ``sliding_window_overlay``).

    Returns:
        one mask (models with a single layer type: Llama; Mistral, all sliding) or a mapping
        ``{layer type: mask}`` (models with ``config.layer_types``: Qwen3, Gemma-2/3), in the dtype
        the attention implementation takes.
    """
    dev = positions.device
    k = len(positions)
    cols = torch.arange(d, device=dev)
    kv_pos = torch.cat([cols, positions])
    cached_ok = (cols[None, :] < positions[:, None]) & ~torch.isin(cols, positions)[None, :]
    new_ok = torch.ones(k, k, dtype=torch.bool, device=dev).tril()
    allowed = torch.cat([cached_ok, new_ok], dim=1)

    def windowed(window):
        return allowed & (positions[:, None] - kv_pos[None, :] < window) if window else allowed

    config = model.config.get_text_config(decoder=True)      # the decoder's (a multimodal wrapper nests it)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types:
        return {t: _mask_for(windowed(window if t == "sliding_attention" else None)[None, None], model)
                for t in set(types)}
    return _mask_for(windowed(window)[None, None], model)


@torch.no_grad()
def recompute_positions(model, cache: AllSlotCache, ids: torch.Tensor, positions: torch.Tensor) -> AllSlotCache:
    """Recompute the K/V of ``positions`` (``[k]``, sorted) of an all-slot cache over ``[0, d)`` in one
    forward with the 4-D :func:`selective_mask`, writing the new K/V back in every layer.

    Args:
        ids: ``[>= d]`` token ids of the prompt (only ``ids[positions]`` are read).

    Returns:
        a new all-slot cache over ``[0, d)``; ``cache`` is left unchanged.
    """
    d = check_all_slots(cache)
    if len(positions) == 0:
        return cache
    positions = positions.to(model.device)
    work = cache.truncate(d)
    mask = selective_mask(model, d, positions)
    model(input_ids=ids.to(model.device)[positions].view(1, -1), position_ids=positions.view(1, -1),
          attention_mask=mask, past_key_values=work, use_cache=True, logits_to_keep=1)
    ks, vs = [], []
    for layer in work.layers:                     # the k recomputed slots [d, d + k) written over positions
        k_all, v_all = layer.keys, layer.values   # out of place: with one KV head (Gemma-3 270M/1B) the
        at = positions.to(k_all.device)           # source slice is a contiguous view of the same storage
        ks.append(k_all[:, :, :d].index_copy(2, at, k_all[:, :, d:]))
        vs.append(v_all[:, :, :d].index_copy(2, at, v_all[:, :, d:]))
    return AllSlotCache.from_tensors(ks, vs)


def selective(model, refreshed: Edited, ids: torch.Tensor, positions: Sequence[int], rank_seconds: float = 0.0,
              rank_tokens: float = 0.0, rank_flops: float = 0.0) -> Edited:
    """Field refresh followed by a true recompute of ``positions`` (:func:`recompute_positions`).

    Args:
        refreshed: the :func:`refresh_field` result (its cost is included).
        positions: downstream positions to recompute (any order; deduplicated and sorted).
        rank_seconds: cost of the ranking that chose ``positions``.
        rank_tokens: cost of the ranking that chose ``positions``.
        rank_flops: cost of the ranking that chose ``positions``.
    """
    pos = torch.as_tensor(sorted(set(int(p) for p in positions)), dtype=torch.long)
    cache, sec = _timed(lambda: recompute_positions(model, refreshed.cache, ids, pos))
    attended = float(sum(p + 1 for p in pos.tolist()))
    return Edited(cache, refreshed.pos, refreshed.tokens + len(pos),
                  refreshed.flops + forward_flops(model.config, len(pos), attended) + rank_flops,
                  refreshed.seconds + sec + rank_seconds, rank_tokens)


def oracle_copy(refreshed: Edited, reference: AllSlotCache, positions: Sequence[int]) -> Edited:
    """UPPER BOUND, not an edit method: the refreshed cache with ``positions`` copied from the full
    re-prefill ``reference`` (it reads what only the expensive method computes). Its cost is that
    of the field refresh plus the positions, as if they were free to obtain."""
    pos = torch.as_tensor(sorted(set(int(p) for p in positions)), dtype=torch.long)
    cache = splice(refreshed.cache, pos, [l.keys[:, :, pos] for l in reference.layers],
                   [l.values[:, :, pos] for l in reference.layers])
    return Edited(cache, refreshed.pos, refreshed.tokens + len(pos), float("nan"), float("nan"))


# -------------------------------------------------------------------------------------- rankings

def rank_last(downstream: tuple[int, int]) -> list[int]:
    """Downstream positions ``[b, d)`` from the last (nearest the decision) backwards."""
    b, d = downstream
    return list(range(d - 1, b - 1, -1))


def rank_random(downstream: tuple[int, int], rng: np.random.Generator) -> list[int]:
    """Downstream positions in a random order (a seeded generator, e.g. :func:`kvnotes.harness.selection.pair_rng`)."""
    b, d = downstream
    return [b + int(i) for i in rng.permutation(d - b)]


@torch.no_grad()
def rank_attention(model, stale: AllSlotCache, token: int, downstream: tuple[int, int]) -> tuple[list[int], dict]:
    """Downstream positions by the attention the decision row pays them on the stale cache.

    The decision token is fed at ``d`` on the stale cache; every layer's attention probabilities of
    that query (the model's own eager attention on the call's post-RoPE inputs and mask:
    :func:`kvnotes.kv.knockout.eager_probabilities`, the probabilities every probe reads) are
    averaged over layers and heads.

    Returns:
        (positions in ``[b, d)`` sorted by decreasing attention, cost ``{tokens, flops, seconds}``).
    """
    b, d = downstream
    scores = torch.zeros(d, dtype=torch.float32)

    def fn(base, module, query, key, value, attention_mask, **kwargs):
        out = base(module, query, key, value, attention_mask, **kwargs)
        q_len, kv_len = query.shape[2], key.shape[2]
        mask = additive_mask(attention_mask, q_len, kv_len, query.device)[..., -1:, :kv_len]
        probs, _ = eager_probabilities(module, query[:, :, -1:], key, value, mask, **kwargs)   # [1, H, 1, kv_len]
        p = probs[0, :, 0, :d].mean(0)
        scores[: p.shape[0]] += p.cpu()
        return out

    t0 = time.perf_counter()
    with attention_hook(model, fn):
        decision_logprobs(model, stale, token, d)
    sec = time.perf_counter() - t0
    order = (torch.argsort(scores[b:d], descending=True, stable=True) + b).tolist()
    return order, {"tokens": 1, "flops": forward_flops(model.config, 1, d + 1), "seconds": sec}


@contextmanager
def first_layers(model, n: int):
    """Temporarily truncate the decoder to its first ``n`` layers, found through the architecture
    adapter (``model.model.layers``; ``model.model.language_model.layers`` for a multimodal wrapper
    such as Gemma-3 4B-27B)."""
    from kvnotes.models.adapters import Adapter

    path = Adapter.for_model(model).paths["layers"]
    owner_path, _, attr = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    layers = getattr(owner, attr)
    setattr(owner, attr, torch.nn.ModuleList(list(layers)[:n]))
    try:
        yield
    finally:
        setattr(owner, attr, layers)


@torch.no_grad()
def rank_kv_deviation(model, refreshed: Edited, ids: torch.Tensor, downstream: tuple[int, int]) -> tuple[list[int], dict]:
    """CacheBlend's selection (Yao et al. 2024, §4.2): recompute the first layer for every downstream
    token against the refreshed cache and rank positions by the deviation of the next layer's K/V
    from the stale ones.

    Layer 0's K/V depend only on the token and its position (identical in the old and new prompt), so
    the first layer whose K/V can deviate is layer 1: the downstream tokens ``[b, d)`` are run through
    layers 0-1 only (a truncated decoder, :func:`first_layers`) on top of the refreshed prefix
    ``[0, b)``, and the deviation is ``||K1_new - K1_stale|| + ||V1_new - V1_stale||`` (L2 over KV heads
    and head dims).

    Returns:
        (positions in ``[b, d)`` sorted by decreasing deviation, cost ``{tokens (full-model token
        equivalents: n * 2 / L), flops, seconds}``).
    """
    b, d = downstream
    n_layers = model_shape(model.config)["L"]
    t0 = time.perf_counter()
    prefix = refreshed.cache.truncate(b)
    with first_layers(model, 2):
        two = AllSlotCache.from_tensors([l.keys for l in prefix.layers[:2]], [l.values for l in prefix.layers[:2]])
        rec = extend(model, two, ids[b:d], b)
    stale = refreshed.cache.layers[1]
    dev = ((rec.layers[1].keys[:, :, b:d] - stale.keys[:, :, b:d]).float().pow(2).sum((0, 1, 3)).sqrt()
           + (rec.layers[1].values[:, :, b:d] - stale.values[:, :, b:d]).float().pow(2).sum((0, 1, 3)).sqrt())
    sec = time.perf_counter() - t0
    order = (torch.argsort(dev.cpu(), descending=True, stable=True) + b).tolist()
    n = d - b
    return order, {"tokens": n * 2 / n_layers, "flops": forward_flops(model.config, n, span_pairs(b, d), 2),
                   "seconds": sec}
