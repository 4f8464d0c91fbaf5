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
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache

from kvnotes import cache as kvcache
from kvnotes.adapters import Adapter
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

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@torch.no_grad()
def precompile(model, ids: torch.Tensor, sink_ids: torch.Tensor | None = None, offset: int = 0) -> Chunk:
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

    Returns:
        a :class:`Chunk` with ``start = offset + k``.
    """
    ids = ids.view(-1)
    sink = ids.new_zeros(0) if sink_ids is None else sink_ids.view(-1).to(ids.device)
    full = torch.cat([sink, ids]).view(1, -1).to(model.device)
    cache = DynamicCache()          # no config: plain layers, none of them drops positions
    pos = torch.arange(offset, offset + full.shape[1], device=model.device).unsqueeze(0)
    model(input_ids=full, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    k = len(sink)
    return Chunk(ids.cpu(), [l.keys[:, :, k:] for l in cache.layers], [l.values[:, :, k:] for l in cache.layers],
                 offset + k, k)


def _rope_type(rotary, layer_type: str | None) -> str:
    rt = getattr(rotary, "rope_type", "default")
    if isinstance(rt, dict):
        rt = rt.get(layer_type, "default")
    return rt


@torch.no_grad()
def delta_rotations(model, delta: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pure rotation by ``delta`` positions as ``(cos, sin)``, each ``[rot_dim]`` fp32.

    Taken from the model's rotary module (adapter path ``rotary``) at ``position_ids = [[delta]]``,
    once per layer type when the module is per-type (Gemma-3), with the module's
    ``attention_scaling`` divided out (it is already inside every cached key; paper §5, YaRN).

    Raises:
        KvnotesError: a rope type whose frequencies depend on the sequence length
            (see :data:`STATIC_ROPE_TYPES`).
    """
    adapter = Adapter.for_model(model)
    rotary = adapter.module(model, "rotary")
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    x = torch.zeros(1, dtype=torch.float32, device=model.device)
    pos = torch.tensor([[delta]], dtype=torch.long, device=model.device)
    by_type = {}
    for lt in dict.fromkeys(adapter.layer_types):
        key = lt if per_type else None
        if key in by_type:
            continue
        rt = _rope_type(rotary, key)
        if rt not in STATIC_ROPE_TYPES:
            raise KvnotesError(f"cannot re-position keys under rope type '{rt}' (supported: {', '.join(STATIC_ROPE_TYPES)})")
        if per_type:
            cos, sin = rotary(x, pos, layer_type=lt)
            scale = getattr(rotary, f"{lt}_attention_scaling", 1.0)
        else:
            cos, sin = rotary(x, pos)
            scale = getattr(rotary, "attention_scaling", 1.0)
        by_type[key] = (cos.reshape(-1).float() / scale, sin.reshape(-1).float() / scale)
    return [by_type[lt if per_type else None] for lt in adapter.layer_types]


def rotate_into(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``keys`` rotated by ``(cos, sin)`` into ``out`` (``rotate_half`` layout, partial rotary).

    ``out[..., :r] = keys[..., :r] * cos + rotate_half(keys[..., :r]) * sin`` with ``r = len(cos)``
    and ``out[..., r:] = keys[..., r:]``; computed in fp32 and cast to ``out``'s dtype. ``out`` may
    be ``keys`` itself (the halves are computed before writing) or a slice of a preallocated cache.

    Args:
        keys: ``[..., head_dim]``, post-RoPE keys.
        cos, sin: ``[rot_dim]`` from :func:`delta_rotations`.
        out: a tensor of ``keys``' shape (broadcast over batch allowed).

    Returns:
        ``out``.
    """
    r = cos.shape[-1]
    h = r // 2
    c, s = cos[:h].to(keys.device), sin[:h].to(keys.device)
    k1, k2 = keys[..., :h].float(), keys[..., h:r].float()
    first = k1 * c - k2 * s
    second = k2 * c + k1 * s
    out[..., :h] = first
    out[..., h:r] = second
    if r < keys.shape[-1] and out.data_ptr() != keys.data_ptr():
        out[..., r:] = keys[..., r:]
    return out


def rotate_keys(model, keys: Sequence[torch.Tensor], delta: int) -> list[torch.Tensor]:
    """Per layer keys re-positioned by ``delta`` (new tensors; see :func:`rotate_into`).

    Args:
        keys: per layer ``[batch, kv_heads, n, head_dim]`` post-RoPE keys.
    """
    rots = delta_rotations(model, delta)
    return [rotate_into(k, c, s, torch.empty_like(k)) for k, (c, s) in zip(keys, rots, strict=True)]


def has_sliding_layers(model) -> bool:
    """True when some layer uses sliding-window attention (then :func:`compose` uses a DynamicCache)."""
    return any(t == "sliding_attention" for t in Adapter.for_model(model).layer_types)


def _forward(model, cache, ids: torch.Tensor, start: int, logits: bool):
    """Feed ``ids`` ``[B, m]`` at positions ``start ..`` on ``cache``; return the fp32 logits of the
    last position ``[B, vocab]`` when ``logits``."""
    B, m = ids.shape
    pos = torch.arange(start, start + m, device=model.device).unsqueeze(0).expand(B, -1)
    mask = None if isinstance(cache, StaticCache) else torch.ones(B, start + m, dtype=torch.long, device=model.device)
    out = model(input_ids=ids.to(model.device), position_ids=pos, attention_mask=mask, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float() if logits else None


def _splice_dynamic(model, cache: DynamicCache, keys, values, p: int, B: int) -> DynamicCache:
    """Append per-layer K/V (positions ``p ..``) to a DynamicCache; sliding layers keep ``window - 1`` slots."""
    new_k, new_v = [], []
    n = keys[0].shape[2]
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        if layer.keys is None or layer.keys.numel() == 0:
            k2, v2 = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
        else:
            k2 = torch.cat([layer.keys, k.to(layer.keys.dtype).expand(B, -1, -1, -1)], dim=2)
            v2 = torch.cat([layer.values, v.to(layer.values.dtype).expand(B, -1, -1, -1)], dim=2)
        if getattr(layer, "is_sliding", False):
            k2, v2 = k2[:, :, -layer.sliding_window + 1:], v2[:, :, -layer.sliding_window + 1:]
        new_k.append(k2.contiguous())
        new_v.append(v2.contiguous())
    return kvcache.cache_from_tensors(model.config, new_k, new_v, p + n)


@torch.no_grad()
def compose(model, parts: Sequence[torch.Tensor | Chunk], rotate: bool = True, seam: int = 0,
            static: bool | None = None) -> tuple[DynamicCache | StaticCache, torch.Tensor | None]:
    """Build the cache of a prompt made of live token parts and precompiled chunks, in order.

    Live parts (``[m]`` or ``[B, m]`` token ids; ``B`` rows are e.g. the old and new prompt of a
    pair, identical outside the live parts) are forwarded at their positions against the cache so
    far. For a chunk at position ``p``: its first ``min(seam, n)`` tokens are recomputed against the
    real prefix (one forward), and the K/V of the rest are written at ``p + seam .. p + n - 1``,
    keys rotated by ``p - chunk.start`` (``rotate``) or as precompiled (``rotate=False``, the
    no-rotate control).

    Args:
        parts: the prompt in order; at least one part.
        rotate: re-position the chunk keys (the method) or not (control).
        seam: chunk tokens recomputed at the start of every chunk (seam repair; ``seam >= n``
            recomputes the whole chunk, which equals a full prefill).
        static: preallocate a ``StaticCache`` and write spliced K/V in place; default: True when the
            model has no sliding-window layers (a ``StaticCache`` cannot be used with them here).

    Returns:
        (the cache over all positions, fp32 logits ``[B, vocab]`` at the last position when the
        last part is live, else None).

    Raises:
        ValueError: ``static=True`` on a model with sliding-window layers, or no parts.
        KvnotesError: from :func:`delta_rotations`.
    """
    if not parts:
        raise ValueError("compose needs at least one part")
    sliding = has_sliding_layers(model)
    static = (not sliding) if static is None else static
    if static and sliding:
        raise ValueError("a preallocated StaticCache is not used for models with sliding-window layers")
    parts = [p if isinstance(p, Chunk) else (p.view(1, -1) if p.dim() == 1 else p) for p in parts]
    B = max((p.shape[0] for p in parts if not isinstance(p, Chunk)), default=1)
    total = sum(len(p) if isinstance(p, Chunk) else p.shape[1] for p in parts)
    if static:
        cache = StaticCache(config=model.config, max_cache_len=total)
    else:
        cache = DynamicCache(config=model.config)
    pos, logits = 0, None
    for part in parts:
        if not isinstance(part, Chunk):
            logits = _forward(model, cache, part.expand(B, -1), pos, part is parts[-1])
            pos += part.shape[1]
            continue
        n = len(part)
        s = min(max(seam, 0), n)
        if s:
            _forward(model, cache, part.ids[:s].view(1, -1).expand(B, -1), pos, False)
        logits = None
        if s < n:
            rots = delta_rotations(model, pos - part.start) if rotate else None
            keys = [k[:, :, s:] for k in part.keys]
            values = [v[:, :, s:] for v in part.values]
            if static:
                for l, layer in enumerate(cache.layers):
                    if not layer.is_initialized:
                        layer.lazy_initialization(keys[l].expand(B, -1, -1, -1), values[l].expand(B, -1, -1, -1))
                    dst = layer.keys[:, :, pos + s: pos + n]
                    if rotate:
                        rotate_into(keys[l], *rots[l], out=dst)
                    else:
                        dst.copy_(keys[l].expand_as(dst))
                    layer.values[:, :, pos + s: pos + n].copy_(values[l].expand(B, -1, -1, -1))
                    layer.cumulative_length.fill_(pos + n)
            else:
                if rotate:
                    keys = [rotate_into(k, c, sn, torch.empty_like(k)) for k, (c, sn) in zip(keys, rots)]
                cache = _splice_dynamic(model, cache, keys, values, pos + s, B)
        pos += n
    return cache, logits


@torch.no_grad()
def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Reference: full prefill of ``ids`` (``[m]`` or ``[B, m]``) computing only the last position's
    logits; fp32 ``[B, vocab]``."""
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    return _forward(model, DynamicCache(config=model.config), ids, 0, True)


def decision_metrics(full: torch.Tensor, composed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Agreement of a composed run with the full prefill at the decision position.

    Args:
        full, composed: fp32 logits ``[B, vocab]``.

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
