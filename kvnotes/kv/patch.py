"""The batched patched readout: activation patching of K/V over a shared prefix, without a cache per
variant (docs/design.md §4).

A *patch mask* (:func:`position_masks`) is a bool tensor ``[V, n_layers, T]`` over the prefix
positions ``[0, T)``: variant ``v`` takes layer ``l``'s key/value at position ``p`` from the source
("new") cache where the mask is true and from the base ("old") cache elsewhere.
:func:`patched_logprobs` decodes on a batch view of the base cache and writes the masked source K/V
into the attention call (:class:`SharedPrefix`: no per-variant clone of a whole cache, chunks sized
by what this path allocates, :func:`shared_prefix_budget_chunk`);
:func:`kvnotes.kv.cache.build_variants` materialises the same caches explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from transformers import DynamicCache

from kvnotes.kv import cache as kvcache
from kvnotes.kv.cache import DEFAULT_BUDGET_BYTES, expand_cache, seq_length, slot_positions, variant_bytes
from kvnotes.kv.masks import Masks, head_layer_mask, layer_heads, layer_key, layer_mask, most_slots, query_heads, union_slots


def check_per_head(key: torch.Tensor, value: torch.Tensor, cached_keys: torch.Tensor,
                   cached_values: torch.Tensor) -> None:
    """Refuse a patched readout whose cache does not hold the per-head K/V attention sees.

    The readout hooks (:class:`_Substitute`, :class:`SharedPrefix`) write cached K/V into the keys
    and values of the attention call; that needs the same heads and widths. Multi-head latent
    attention (DeepSeek-V2/V3) caches the kv latent and the shared rotary key (``[B, 1, T,
    kv_lora_rank]``, ``[B, 1, T, qk_rope_head_dim]``) and expands per-head keys and values from them
    inside attention, so the hooks cannot place them (issue #24).

    Args:
        key: the attention call's keys ``[B, kv_heads, T, head_dim]``.
        value: the attention call's values ``[B, kv_heads, T, head_dim]``.
        cached_keys: the cache's keys ``[B, heads, T, dim]``.
        cached_values: the cache's values ``[B, heads, T, dim]``.

    Raises:
        KvnotesError: heads or widths differ (one line).
    """
    got = (key.shape[1], key.shape[-1], value.shape[-1])
    held = (cached_keys.shape[1], cached_keys.shape[-1], cached_values.shape[-1])
    if got != held:
        from kvnotes.errors import KvnotesError

        raise KvnotesError(f"patched readout: the cache holds (heads, key dim, value dim) = {held} but attention sees "
                           f"per-head K/V {got} (multi-head latent attention caches its latent; the probes' K/V "
                           f"substitution does not reach it yet, issue #24)")


class _Substitute:
    """Attention hook that writes the source cache's K/V into the batched keys and values of the
    attention call, where a patch mask is true (:func:`patched_logprobs`).

    The base cache is fed as a batch-``V`` *view* (no copy); the cache update concatenates it with
    the fed tokens' K/V into fresh ``[V, kv_heads, slots + n, head_dim]`` tensors, and this hook
    overwrites only the masked (variant, KV head, slot) entries in place before attention runs. So
    no variant cache is materialised besides the one the decode itself writes.
    """

    def __init__(self, base: DynamicCache, source: DynamicCache, masks: Masks) -> None:
        self.entries = []
        for l, (lb, ls) in enumerate(zip(base.layers, source.layers)):
            m = head_layer_mask(masks, l, ls.keys.shape[1])
            m = m[:, :, slot_positions(lb).to(m.device)]                         # [V, kv_heads, slots]
            idx = tuple(i.to(lb.keys.device) for i in m.nonzero(as_tuple=True))
            self.entries.append((idx, ls.keys[0], ls.values[0]))

    def __call__(self, base_fn, module, query, key, value, attention_mask, **kwargs):
        (v_idx, h_idx, s_idx), k_src, v_src = self.entries[module.layer_idx]
        check_per_head(key, value, k_src[None], v_src[None])
        if len(v_idx):
            key[v_idx, h_idx, s_idx] = k_src[h_idx, s_idx].to(key.dtype)
            value[v_idx, h_idx, s_idx] = v_src[h_idx, s_idx].to(value.dtype)
        return base_fn(module, query, key, value, attention_mask, **kwargs)


def _same_view(a: tuple, b: tuple) -> bool:
    """Whether two layers' ``(device, window, slot positions, substitution key
    (:func:`kvnotes.kv.masks.layer_key`), hide's key | None)`` are equal, so that one attention
    mask serves both."""
    return (a[0] == b[0] and a[1] == b[1] and a[2].shape == b[2].shape and bool(torch.equal(a[2], b[2]))
            and a[3].shape == b[3].shape and bool(torch.equal(a[3], b[3]))
            and (a[4] is None) == (b[4] is None) and (a[4] is None or bool(torch.equal(a[4], b[4]))))


def _view_mask(dev, window: int | None, pos: torch.Tensor, m: torch.Tensor, h: torch.Tensor | None,
               q_var: torch.Tensor, q_tok: torch.Tensor, own_new: torch.Tensor, start: int,
               dtype: torch.dtype, s_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's substituted slots and the additive mask ``[1, 1, V n, slots + e + V n]`` of
    :class:`SharedPrefix` (see there), from its slot positions ``pos``, substitution ``m`` and hide
    ``h`` (bool ``[V, slots]``); ``s_idx``: the substituted slots (default: those of ``m``)."""
    q_pos = start + q_tok
    if s_idx is None:
        s_idx = m.any(0).nonzero().flatten()                       # slots any variant substitutes
    see_base, see_sub, see_new = ~m[q_var], m[q_var][:, s_idx], own_new
    if h is not None:                                              # whichever entry stands there
        hidden = h[q_var] & (q_tok == 0)[:, None]
        see_base, see_sub = see_base & ~hidden, see_sub & ~hidden[:, s_idx]
    if window is not None:
        see_base = see_base & (q_pos[:, None] - pos[None, :] < window)
        see_sub = see_sub & (q_pos[:, None] - pos[s_idx][None, :] < window)
        see_new = see_new & (q_tok[:, None] - q_tok[None, :] < window)
    see = torch.cat([see_base, see_sub, see_new], 1)
    return s_idx, torch.zeros(see.shape, dtype=dtype, device=dev).masked_fill_(~see, torch.finfo(dtype).min)[None, None]


class SharedPrefix:
    """Attention hook for a cache-free forward of ``V`` variants x ``n`` fed tokens on one shared
    batch-1 prefix (:func:`patched_logits`, :func:`kvnotes.kv.knockout.decision_forward`): no
    variant cache exists at all.

    The variants' queries become one query block ``[1, heads, V * n, head_dim]`` over the keys
    ``[prefix slots | substituted source entries | every variant's fed tokens]``, each substituted
    slot once (its source K/V are the same for every variant that takes it); an additive mask
    gives each query its own variant's view (the prefix slots it does not substitute, its own
    substituted entries, its own fed tokens up to itself; on sliding-window layers only positions
    within the window; with head masks, one mask per KV head, ``[1, kv_heads, V n, keys]``, repeated
    to its query heads). The model's own attention implementation (scaling, soft-capping, sinks) runs
    on that block, so the result is the same attention as on materialised variant caches, up to
    float rounding.

    Several prefixes over the same positions (``base`` a sequence of ``G`` caches, e.g. the two runs
    of a pair) run the same ``V`` variants each in one batch-``G`` attention call: the forward's
    rows ``g V .. (g + 1) V - 1`` read prefix ``g``, and every prefix shares the one mask, so a
    query attends over its own prefix's slots only (not over all ``G`` prefixes' slots).

    Args:
        base: batch-1 caches over ``[0, start)``, or a sequence of ``G`` of them.
        source: batch-1 caches over ``[0, start)`` (the same substituted entries for every prefix).
        masks: bool ``[V, n_layers, start]`` (or :class:`kvnotes.kv.masks.FactoredMasks`): positions
            whose K/V variant ``v`` takes from ``source``.
        n: fed tokens per variant; start: position of the first.
        hide: optional bool ``[V, n_layers, start]``: prefix positions variant ``v``'s *first* fed
            token does not see in layer ``l`` (an attention knockout of the decision row).
    """

    def __init__(self, base: DynamicCache | Sequence[DynamicCache], source: DynamicCache, masks: Masks, n: int,
                 start: int, dtype: torch.dtype, hide: Masks | None = None) -> None:
        prefixes = [base] if isinstance(base, DynamicCache) else list(base)
        base, G = prefixes[0], len(prefixes)
        V = masks.shape[0]
        on: dict[torch.device, tuple] = {}       # per device (a device map puts layers on several)
        self.layers = []
        #: per layer, the positions of the substituted source entries, in key order after the prefix slots
        self.substituted: list[torch.Tensor] = []
        seen: list[tuple] = []                   # distinct views so far: layers with equal views share one mask
        for l, (lb, ls) in enumerate(zip(base.layers, source.layers, strict=True)):
            dev = lb.keys.device
            if dev not in on:
                q_var = torch.arange(V, device=dev).repeat_interleave(n)   # query row -> variant
                q_tok = torch.arange(n, device=dev).repeat(V)              # query row -> fed token
                on[dev] = (masks.to(dev), hide.to(dev) if hide is not None else None, q_var, q_tok,
                           (q_var[:, None] == q_var[None, :]) & (q_tok[None, :] <= q_tok[:, None]))
            masks_d, hide_d, q_var, q_tok, own_new = on[dev]
            pos = slot_positions(lb)
            window = getattr(lb, "sliding_window", None) if getattr(lb, "is_sliding", False) else None
            view = (dev, window, pos, layer_key(masks_d, l), layer_key(hide_d, l) if hide_d is not None else None)
            hit = next((x for x in seen if _same_view(x[0], view)), None)
            if hit is None:
                m = layer_mask(masks_d, l)[:, pos]                         # [V, slots]
                h = layer_mask(hide_d, l)[:, pos] if hide_d is not None else None
                hm, hh = layer_heads(masks_d, l), layer_heads(hide_d, l) if hide_d is not None else None
                if hm is None and hh is None:
                    hit = (view, *_view_mask(dev, window, pos, m, h, q_var, q_tok, own_new, start, dtype))
                else:                           # head masks: one view per KV head over the same substituted slots
                    s_idx = m.any(0).nonzero().flatten()
                    hit = (view, s_idx, torch.cat([_view_mask(
                        dev, window, pos, m if hm is None else m & hm[:, j: j + 1],
                        None if h is None else h if hh is None else h & hh[:, j: j + 1],
                        q_var, q_tok, own_new, start, dtype, s_idx)[1] for j in range(lb.keys.shape[1])], 1))
                seen.append(hit)
            s_idx, mask = hit[1], hit[2]
            kv = []                             # [G, kv_heads, slots + e + V n, dim]: the fed tokens' K/V go last
            for name in ("keys", "values"):
                t = getattr(lb, name)
                buf = t.new_empty(G, t.shape[1], mask.shape[-1], t.shape[3])
                for g, p in enumerate(prefixes):
                    buf[g, :, : len(pos)] = getattr(p.layers[l], name)[0]
                buf[:, :, len(pos): len(pos) + len(s_idx)] = getattr(ls, name)[:, :, s_idx]
                kv.append(buf)
            self.layers.append((kv[0], kv[1], mask))
            self.substituted.append(pos[s_idx])

    def block(self, module, query, key, value):
        """The query block, its keys, values and additive mask for ``module``'s layer (``G``
        prefixes): ``[G, heads, V * n, hd]``, ``[G, kv_heads, keys, hd]`` (twice), ``[1, 1, V * n, keys]``."""
        keys, values, mask = self.layers[module.layer_idx]
        check_per_head(key, value, keys, values)
        B, H, n, hd = query.shape
        if mask.shape[1] not in (1, H):                 # a head mask's per-KV-head views, to the query heads
            mask = query_heads(mask, H)
        G, kvh = keys.shape[0], key.shape[1]
        V = B // G

        def block(x, heads):                    # [G V, heads, n, dim] -> [G, heads, V n, dim]
            return x.view(G, V, heads, n, -1).transpose(1, 2).reshape(G, heads, V * n, -1)

        keys[:, :, -V * n:] = block(key, kvh)      # this forward's fed tokens, in the space left for them
        values[:, :, -V * n:] = block(value, kvh)
        return block(query, H), keys, values, mask

    def __call__(self, base_fn, module, query, key, value, attention_mask, **kwargs):
        B, H, n, _ = query.shape
        out, _ = base_fn(module, *self.block(module, query, key, value), **kwargs)   # [G, V * n, heads, hd]
        return out.reshape(B, n, H, -1), None


#: Attention implementations that take the explicit additive mask of :class:`SharedPrefix`.
SHARED_PREFIX_ATTENTION = ("sdpa", "eager")


#: Fewest variants worth a cache-free forward of their own (below it, one batch-view forward for
#: every variant of the call is faster on a CPU).
MIN_SHARED_CHUNK = 32


def shared_prefix_chunk(masks: Masks, base: DynamicCache, n: int) -> int:
    """How many variants of ``masks`` one :class:`SharedPrefix` forward takes.

    Its attention covers ``slots + e + V * n`` keys per query (``e``: the slots any variant
    substitutes in a layer, each once) where a materialised variant cache covers ``slots + n``;
    chunks are sized so that the former stays within 3x the latter: ``V <= (2 slots + 3 n - e) / n``,
    ``e`` the most substituted slots of one layer over all of ``masks``, ``slots`` the widest
    layer's (a sliding-window layer holds fewer slots than a global one: sizing by it would cut
    the chunks of a long prompt to the window's).
    """
    slots = max(layer.keys.shape[-2] for layer in base.layers)
    e = union_slots(masks)
    return max(1, (2 * slots + 3 * n - e) // n)


def shared_prefix_bytes(config, base: DynamicCache, V: int, n: int, e: int, head_masks: bool = False) -> int:
    """Bytes a :class:`SharedPrefix` forward of ``V`` variants x ``n`` fed tokens allocates besides
    the model's weights and the shared prefix: per layer its additive mask and the bool view it is
    built from (kept for every layer), the prefix and substituted K/V it concatenates, one layer's
    attention scores (fp32, ``heads x V n x keys``, what sdpa's CPU path materialises), and the
    block's activations (hidden states and the MLP's three intermediate products). Each layer counts
    its own slots (a sliding-window layer holds fewer than a global one).

    Args:
        config: the model config (its text config's heads, hidden and intermediate sizes).
        e: the most slots one layer substitutes over the chunk (:func:`shared_prefix_chunk`).
        head_masks: the masks name KV heads: each layer keeps one additive mask per KV head, and one
            layer's is repeated to the query heads while it runs.
    """
    text = config.get_text_config(decoder=True)
    rows, elem = V * n, base.layers[0].keys.element_size()
    masks, widest = 0, 0
    for layer in base.layers:                   # a sliding layer holds fewer slots than a global one
        k = layer.keys
        keys = k.shape[-2] + e + V * n
        masks += rows * keys * (elem * (k.shape[1] if head_masks else 1) + 1) \
            + (k.shape[-2] + e) * k.shape[1] * k.shape[-1] * 2 * elem
        widest = max(widest, keys)
    scores = text.num_attention_heads * rows * widest * (4 + (elem if head_masks else 0))
    inter = getattr(text, "intermediate_size", None) or getattr(text, "moe_intermediate_size", None) or 4 * text.hidden_size
    acts = rows * (4 * text.hidden_size + 3 * inter) * elem
    return masks + scores + acts


def shared_prefix_budget_chunk(config, base: DynamicCache, masks: Masks, n: int, budget_bytes: int,
                               limit: int) -> int:
    """The most variants (at most ``limit``, at least 1) one :class:`SharedPrefix` forward of
    ``masks`` may take within ``budget_bytes`` (:func:`shared_prefix_bytes`): sized by what the
    cache-free path allocates, not by the variant caches it never builds."""
    e_all = union_slots(masks)
    e_one = most_slots(masks)                                    # most slots one variant substitutes in a layer
    heads = layer_heads(masks, 0) is not None
    lo, hi = 1, max(1, limit)
    while lo < hi:                                               # bytes grow with V: the largest that fits
        mid = (lo + hi + 1) // 2                                 # a chunk of mid variants substitutes <= mid * e_one slots
        if shared_prefix_bytes(config, base, mid, n, min(e_all, mid * e_one), heads) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def candidate_logits(model, hidden: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``vocab_ids`` only, from final (normed) hidden states ``[V, n, d_model]``: the
    unembedding rows of those tokens (and Gemma-2/3's final soft-capping), fp32 ``[V, n, k]``."""
    from kvnotes.models.adapters import Adapter

    from accelerate.utils import align_module_device

    ad = Adapter.for_model(model)
    head = ad.module(model, "unembed")
    with align_module_device(head):          # an offloaded head (device map) has its weight on meta until then
        vocab_ids = vocab_ids.to(head.weight.device)
        bias = head.bias[vocab_ids] if getattr(head, "bias", None) is not None else None
        logits = torch.nn.functional.linear(hidden.to(head.weight.device), head.weight[vocab_ids], bias)
    if ad.final_logit_softcapping:
        cap = ad.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


@torch.no_grad()
def patched_logits(model, base: DynamicCache, source: DynamicCache, masks: Masks, tokens: torch.Tensor,
                   budget_bytes: int = DEFAULT_BUDGET_BYTES, vocab_ids: Sequence[int] | None = None,
                   method: Literal["auto", "shared", "substitute"] = "auto") -> torch.Tensor:
    """Batched activation patching on the KV cache: the fed tokens' logits in every patch variant.

    Each variant's prefix cache is the base cache with layer ``l``'s K/V at position ``p`` taken
    from ``source`` where ``masks[v, l, p]`` (the caches :func:`build_variants` builds). ``tokens``
    are fed at positions ``T..``; the first is the decision token ``d = T``, further tokens
    teacher-force a multi-token continuation. No variant cache is copied:

    - when :func:`shared_prefix_chunk` gives chunks of at least :data:`MIN_SHARED_CHUNK` variants (or
      all of them), the variants run cache-free: every variant attends to the one batch-1 prefix
      plus the source K/V of the slots substituted in its chunk (:class:`SharedPrefix`), in chunks
      whose forward fits ``budget_bytes`` (:func:`shared_prefix_budget_chunk`);
    - else (many fed tokens per variant) they decode on a batch-``V`` view of ``base`` with the
      masked K/V written into the attention call (:class:`_Substitute`), in chunks whose variant
      caches fit ``budget_bytes``.

    Rows come back in the order of ``masks``.

    Args:
        base: batch-1 caches over the same positions ``[0, T)`` (token-aligned prompts).
        source: batch-1 caches over the same positions ``[0, T)`` (token-aligned prompts).
        masks: bool ``[V, n_layers, T]``, or :class:`kvnotes.kv.masks.FactoredMasks` (a map of
            thousands of variants without a dense mask of gigabytes).
        tokens: ``[n]`` token ids fed after the prefix.
        vocab_ids: compute only these tokens' logits (the unembedding rows of ``vocab_ids``; a
            logit difference needs no normalisation), else the whole vocabulary.
        method: ``auto`` (the shared prefix when its chunks are large enough, see above),
            ``shared`` (always, in chunks of at least one variant; sdpa / eager attention only) or
            ``substitute`` (always the batch view).

    Returns:
        ``[V, n, len(vocab_ids) | vocab]`` fp32 logits.

    Raises:
        ValueError: the mask's layer or position count does not match the caches, an unknown
            ``method``, or ``shared`` with another attention implementation.
    """
    if method not in ("auto", "shared", "substitute"):
        raise ValueError(f"method must be auto, shared or substitute, got {method!r}")
    impl = model.config._attn_implementation
    if method == "shared" and impl not in SHARED_PREFIX_ATTENTION:
        raise ValueError(f"the shared-prefix decode needs one of {SHARED_PREFIX_ATTENTION} attention, not {impl}")
    T = seq_length(base)
    if masks.shape[1] != len(base.layers) or masks.shape[2] != T or seq_length(source) != T:
        raise ValueError(f"mask {tuple(masks.shape)} does not fit caches of {len(base.layers)} layers x {T} positions")
    dev = model.device
    tokens = tokens.to(dev)
    n = tokens.shape[0]
    ids = torch.as_tensor(list(vocab_ids), dtype=torch.long, device=dev) if vocab_ids is not None else None
    size, shared = variant_chunks(model.config, impl, base, masks, n, budget_bytes, method)
    out = None
    idx = torch.arange(masks.shape[0])
    for s in range(0, len(idx), size):
        sub = idx[s: s + size]
        logits = _patched_chunk(model, base, source, masks[sub], tokens, T, ids, shared)
        if out is None:
            out = logits.new_empty(masks.shape[0], *logits.shape[1:])
        out[sub.to(out.device)] = logits
    return out if out is not None else torch.empty(0, n, len(ids) if ids is not None else 0)


def variant_chunks(config, impl: str, base: DynamicCache, masks: Masks, n: int, budget_bytes: int,
                   method: Literal["auto", "shared", "substitute"] = "auto") -> tuple[int, bool]:
    """How :func:`patched_logits` runs the variants of ``masks`` (bool ``[V, n_layers, T]``, ``n`` fed
    tokens each) within ``budget_bytes``: ``(variants per forward, cache-free shared prefix?)``.

    ``shared``: chunks of :func:`shared_prefix_budget_chunk`; ``substitute`` (or an attention
    implementation the shared prefix cannot take): as many batch-view variant caches as fit the
    budget (at least one); ``auto``: the shared prefix when a chunk of it takes at least
    :data:`MIN_SHARED_CHUNK` variants (or all of them), else the batch view.
    """
    V = masks.shape[0]
    per_cache = max(1, budget_bytes // max(variant_bytes(base), 1))
    if method == "shared":
        return shared_prefix_budget_chunk(config, base, masks, n, budget_bytes, V), True
    if method == "substitute" or impl not in SHARED_PREFIX_ATTENTION:
        return per_cache, False
    size = shared_prefix_budget_chunk(config, base, masks, n, budget_bytes, min(shared_prefix_chunk(masks, base, n), V))
    return (size, True) if size >= min(MIN_SHARED_CHUNK, V) else (per_cache, False)


def _patched_chunk(model, base: DynamicCache, source: DynamicCache, masks: Masks, tokens: torch.Tensor,
                   T: int, vocab_ids: torch.Tensor | None, shared: bool) -> torch.Tensor:
    """One forward of :func:`patched_logits`: the variants of ``masks`` cache-free on the shared
    prefix (``shared``) or on a batch view of ``base``."""
    from kvnotes.kv.capture import attention_hook

    V, n, dev = masks.shape[0], tokens.shape[0], model.device
    feed = dict(input_ids=tokens[None].expand(V, -1), position_ids=torch.arange(T, T + n, device=dev)[None].expand(V, -1))
    if shared:
        hook, kw = SharedPrefix(base, source, masks, n, T, base.layers[0].keys.dtype), dict(use_cache=False)
    else:
        hook = _Substitute(base, source, masks)
        kw = dict(attention_mask=torch.ones(V, T + n, dtype=torch.long, device=dev),
                  past_key_values=expand_cache(base, model.config, V), use_cache=True)
    with attention_hook(model, hook):
        if vocab_ids is None:
            return model(**feed, **kw).logits.float()
        return candidate_logits(model, model.base_model(**feed, **kw).last_hidden_state, vocab_ids)


@torch.no_grad()
def patched_logprobs(model, base: DynamicCache, source: DynamicCache, masks: Masks,
                     tokens: torch.Tensor, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Log-probabilities of every patch variant: the log-softmax of :func:`patched_logits` over
    the whole vocabulary.

    Returns:
        ``[V, n, vocab]`` fp32 log-probabilities.

    Raises:
        ValueError: the mask's layer or position count does not match the caches.
    """
    return torch.log_softmax(patched_logits(model, base, source, masks, tokens, budget_bytes), dim=-1)


def position_masks(n_layers: int, T: int, position_sets: Sequence[Sequence[int]],
                   layers: Sequence[int] | None = None) -> torch.Tensor:
    """Patch masks for sets of positions, each patched in ``layers`` (default: every layer).

    Returns:
        bool ``[len(position_sets), n_layers, T]``.
    """
    masks = torch.zeros(len(position_sets), n_layers, T, dtype=torch.bool)
    layer_idx = torch.arange(n_layers) if layers is None else torch.as_tensor(list(layers), dtype=torch.long)
    for v, positions in enumerate(position_sets):
        if len(positions):
            pos = torch.as_tensor(list(positions), dtype=torch.long)
            masks[v, layer_idx[:, None], pos[None, :]] = True
    return masks


@torch.no_grad()
def recompute_span(model, prefix: DynamicCache, ids: torch.Tensor, start: int) -> DynamicCache:
    """Run ``ids`` at positions ``start .. start + n - 1`` on top of ``prefix`` (extended in place).

    This is the write-side resume of docs/design.md §4: the prefill continues from ``start`` on a cache
    of ``[0, start)`` instead of re-running the prefix. Explicit ``position_ids`` and a full-length
    attention mask, as every forward on an edited cache.

    Args:
        prefix: batch-1 cache over ``[0, start)`` (pass a view if it must be reused).
        ids: ``[n]`` token ids.

    Returns:
        ``prefix``, now over ``[0, start + n)``.
    """
    ids = ids.view(1, -1).to(model.device)
    n = ids.shape[1]
    pos = torch.arange(start, start + n, device=model.device).unsqueeze(0)
    mask = torch.ones(1, start + n, dtype=torch.long, device=model.device)
    model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=prefix, use_cache=True,
          logits_to_keep=1)
    return prefix


def _span_slots(layer, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot indices, positions) of a layer's slots whose positions lie in ``[a, b)``."""
    pos = kvcache.slot_positions(layer)
    idx = ((pos >= a) & (pos < b)).nonzero().flatten()
    return idx, pos[idx]


@torch.no_grad()
def exact_field_source(model, run) -> tuple[DynamicCache, dict]:
    """The old prefix cache with the field's KV recomputed from the new field tokens: the exact
    patch source of a field refresh (docs/design.md §3).

    ``run`` is a pair's clean run (:class:`kvnotes.harness.readout.PairRun`: its ``pair`` with the
    field span and both prompts' ids, and the batch-1 ``old_cache`` / ``new_cache`` over ``[0, d)``).

    The new field tokens ``new.ids[a:b]`` are run at positions ``a .. b-1`` on the old cache
    truncated to ``[0, a)`` (:func:`kvnotes.kv.cache.prefix_view`, else a prefill of ``old.ids[:a]``); the
    resulting K/V of the field positions replace the old ones in a copy of the old cache.

    Returns:
        (the batch-1 source cache over ``[0, d)``, ``{k_max_abs_diff, v_max_abs_diff, method}``):
        the largest absolute difference between recomputed and copied (new-run) field keys and
        values over layers, KV heads, field positions and head dims; ``method`` is
        ``"truncated_view"`` or ``"prefix_prefill"``.

    Raises:
        RuntimeError: a field position held by the old cache is missing from the recomputation
            (cannot happen for caches built by :func:`kvnotes.kv.cache.prefill`).
    """
    pair = run.pair
    a, b = pair.field
    config = model.config
    prefix = kvcache.prefix_view(run.old_cache, config, a)
    method = "truncated_view"
    if prefix is None:
        prefix = kvcache.prefill(model, pair.old.ids[:a])
        method = "prefix_prefill"
    rec = recompute_span(model, prefix, pair.new.ids[a:b], a)
    keys, values = [], []
    k_diff = v_diff = 0.0
    for lo, ln, lr in zip(run.old_cache.layers, run.new_cache.layers, rec.layers, strict=True):
        k, v = lo.keys.clone(), lo.values.clone()
        idx_o, pos_o = _span_slots(lo, a, b)
        idx_r, pos_r = _span_slots(lr, a, b)
        idx_n, pos_n = _span_slots(ln, a, b)
        if not torch.equal(pos_o, pos_r[torch.isin(pos_r, pos_o)]) or not torch.isin(pos_o, pos_r).all():
            raise RuntimeError(f"field positions {pos_o.tolist()} not all recomputed ({pos_r.tolist()})")
        take = idx_r[torch.isin(pos_r, pos_o)]
        k[:, :, idx_o] = lr.keys[:, :, take]
        v[:, :, idx_o] = lr.values[:, :, take]
        both = torch.isin(pos_r, pos_n)
        match_n = idx_n[torch.isin(pos_n, pos_r)]
        if len(match_n):
            dk = lr.keys[:, :, idx_r[both]].float() - ln.keys[:, :, match_n].float()
            dv = lr.values[:, :, idx_r[both]].float() - ln.values[:, :, match_n].float()
            k_diff, v_diff = max(k_diff, float(dk.abs().max())), max(v_diff, float(dv.abs().max()))
        keys.append(k)
        values.append(v)
    source = kvcache.cache_from_tensors(config, keys, values, kvcache.seq_length(run.old_cache))
    return source, {"k_max_abs_diff": k_diff, "v_max_abs_diff": v_diff, "exact_method": method}
