"""Attention knockout of the decision row, and capture of its attention, inside the model's own
attention call (:func:`kvnotes.kv.capture.attention_hook`; docs/design.md §4).

- :func:`knockout_masks`: bool ``[V, n_layers, d]`` masks hiding key groups in layer bands;
- :class:`DecisionRowHook`: the hook that applies them to the decision query's row only (sdpa and
  eager) and/or records the row's attention probabilities through the model's eager function;
- :class:`SharedDecisionRows`: the same on the one shared prefix cache (no variant cache);
- :func:`decision_forward`: a batched forward of the decision token over knockout variants.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvnotes.kv import cache as kvcache

from kvnotes.kv import patch as kvpatch
from kvnotes.kv.capture import attention_hook
from kvnotes.kv.generate import generate
from kvnotes.kv.masks import FactoredMasks, Masks, layer_heads, layer_mask, query_heads
from kvnotes.errors import KvnotesError

#: Key groups of the decision row that can be hidden.
KNOCKABLE = ("sinks", "prefix", "field", "downstream")
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")


def knockout_masks(n_layers: int, decision: int, groups: dict[str, tuple[int, int]],
                   variants: list[tuple[list[str], list[int]]]) -> FactoredMasks:
    """Knockout masks: variant ``v`` hides the keys of its groups in its layers.

    Args:
        variants: ``(group names, [l0, l1))`` per variant; an empty group list knocks out nothing.

    Returns:
        ``[V, n_layers, d]`` over prefix positions, factored (:class:`kvnotes.kv.masks.FactoredMasks`:
        the groups' positions x the band's layers; the decision token's own key is never hidden).

    Raises:
        ValueError: a group that cannot be knocked out (``decision``) or is unknown.
    """
    positions = torch.zeros(len(variants), decision, dtype=torch.bool)
    layers = torch.zeros(len(variants), n_layers, dtype=torch.bool)
    for v, (names, (l0, l1)) in enumerate(variants):
        for g in names:
            if g not in KNOCKABLE:
                raise ValueError(f"cannot knock out group '{g}' (knockable: {KNOCKABLE})")
            s, e = groups[g]
            positions[v, s:e] = True
        layers[v, l0:l1] = bool(names)
    return FactoredMasks(positions, layers)


# --------------------------------------------------------------------------------------------
# the decision-row hook


def _causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bool ``[1, 1, q_len, kv_len]``: query ``i`` sees key ``j`` iff ``j <= kv_len - q_len + i``
    (queries are the last ``q_len`` positions of the keys)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return (j <= kv_len - q_len + i)[None, None]


def additive_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The mask an attention implementation received, as an fp32 additive mask ``[B|1, 1, q, kv]``.

    ``None`` means what sdpa does without a mask: all keys for a single query row, causal
    (bottom-right aligned) otherwise. Bool masks are True where attending is allowed.
    """
    if mask is None:
        allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device) if q_len == 1 \
            else _causal(q_len, kv_len, device)
        mask = allowed
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask.float().clamp_min(torch.finfo(torch.float32).min)


def eager_probabilities(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities and output from the model's own eager attention function, in fp32.

    The function is the ``eager_attention_forward`` of the module's modeling file (Gemma-2's applies
    logit soft-capping), called with keyword arguments (docs/design.md §4, §10).

    Args:
        query: ``[B, heads, r, head_dim]`` (the rows of interest).
        key: ``[B, kv_heads, kv_len, head_dim]``.
        value: ``[B, kv_heads, kv_len, head_dim]``.
        mask: additive fp32 ``[B|1, 1, r, kv_len]``.

    Returns:
        (probabilities ``[B, heads, r, kv_len]``, output ``[B, r, heads, head_dim]``), fp32.
    """
    eager = sys.modules[type(module).__module__].eager_attention_forward
    kw = dict(kwargs)
    kw["dropout"] = 0.0
    out, weights = eager(module, query.float(), key.float(), value.float(), mask, **kw)
    return weights.float(), out.float()


class DecisionRowHook:
    """``attention_hook`` function that knocks out keys for the decision row and/or records its
    attention probabilities.

    Queries fed in the hooked forward sit at positions ``start .. start + q_len - 1`` and the keys
    are the contiguous positions ending at the last query (true for prefix caches built by
    :mod:`kvnotes.kv.cache`, including filled sliding windows).

    Args:
        decision: position ``d`` of the decision query.
        start: position of the first fed token.
        knock: optional bool ``[V, n_layers, P]``: hide key position ``p < P`` from the decision
            row in layer ``l`` for batch row ``v``.
        capture: record per layer the decision row's head-mean probabilities over positions.
        keep_heads: with ``capture``, also keep the per-head probabilities.

    Attributes:
        probs: layer -> fp32 ``[B, d + 1]`` head-mean probabilities by absolute position.
        head_probs: layer -> fp32 ``[B, heads, d + 1]`` (only with ``keep_heads``).
        recon_err: layer -> max |eager output - executed output| at the decision row.

    Raises:
        KvnotesError: (when called) a knockout under an attention implementation other than sdpa/eager.
    """

    def __init__(self, model, decision: int, start: int, knock: Masks | None = None, capture: bool = False,
                 keep_heads: bool = False):
        self.impl = model.config._attn_implementation
        self.decision, self.start, self.knock, self.capture = decision, start, knock, capture
        self.keep_heads = keep_heads
        self.probs: dict[int, torch.Tensor] = {}
        self.head_probs: dict[int, torch.Tensor] = {}
        self.recon_err: dict[int, float] = {}

    def _knocked(self, mask, q_len, kv_len, layer, rows: slice, k_pos, device, heads: int):
        """The attention mask with ``knock``'s keys hidden from the query ``rows`` of each variant
        in ``layer`` (``[V, 1 | heads, q_len, kv_len]``, bool or additive like ``mask``; per query
        head when ``knock`` names KV heads)."""
        if self.impl not in SUPPORTED_IMPLEMENTATIONS:
            raise KvnotesError(f"attention knockout needs attn_implementation sdpa or eager, got '{self.impl}'")
        assert self.knock is not None
        V, _, P = self.knock.shape
        hide = torch.zeros(V, 1, kv_len, dtype=torch.bool, device=device)
        valid = (k_pos >= 0) & (k_pos < P)
        hide[:, 0, valid] = layer_mask(self.knock, layer).to(device)[:, k_pos[valid]]  # this layer's device (device maps)
        if (kv_heads := layer_heads(self.knock, layer)) is not None:
            hide = hide & query_heads(kv_heads.to(device), heads)[:, :, None]             # [V, heads, kv_len]
        if mask is None or mask.dtype == torch.bool:
            allowed = _causal(q_len, kv_len, device) if (mask is None and q_len > 1) else \
                (torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device) if mask is None else mask)
            allowed = allowed.expand(V, max(allowed.shape[1], hide.shape[1]), q_len, kv_len).clone()
            allowed[:, :, rows, :] &= ~hide[:, :, None, :]
            return allowed
        out = mask.expand(V, max(mask.shape[1], hide.shape[1]), q_len, kv_len).clone()
        out[:, :, rows, :] = out[:, :, rows, :].masked_fill(hide[:, :, None, :], torch.finfo(out.dtype).min)
        return out

    def __call__(self, base, module, query, key, value, attention_mask, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        row = self.decision - self.start
        if not 0 <= row < q_len:
            return base(module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        end = self.start + q_len
        k_pos = torch.arange(end - kv_len, end, device=query.device)
        if self.knock is not None and bool(layer_mask(self.knock, layer).any()):
            attention_mask = self._knocked(attention_mask, q_len, kv_len, layer, slice(row, row + 1), k_pos, query.device,
                                           query.shape[1])
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        if self.capture:
            mask = additive_mask(attention_mask, q_len, kv_len, query.device)[..., row:row + 1, :]
            probs, eout = eager_probabilities(module, query[:, :, row:row + 1], key, value, mask, **kwargs)
            seen = k_pos <= self.decision                     # later keys (teacher-forced tokens) are masked
            full = torch.zeros(*probs.shape[:2], self.decision + 1, dtype=torch.float32, device=query.device)
            full[:, :, k_pos[seen]] = probs[:, :, 0, seen]
            self.probs[layer] = full.mean(1).cpu()
            if self.keep_heads:
                self.head_probs[layer] = full.cpu()
            ref = out[:, row:row + 1].float()
            self.recon_err[layer] = float((eout - ref).abs().max())
        return out, weights


@dataclass
class DecisionRead:
    """Output of :func:`decision_forward`.

    Attributes:
        logprobs: fp32 ``[V, n, vocab]`` log-probs after each fed token.
        probs: fp32 ``[V, n_layers, d + 1]`` head-mean decision-row attention by position, or None.
        recon_err: max over layers of |eager - executed attention output| at the decision row, or None
            (with a ``source`` prefix: of the rows on ``cache``).
        recon_err_source: the same for the rows on the ``source`` prefix, or None.
    """

    logprobs: torch.Tensor
    probs: torch.Tensor | None
    recon_err: float | None
    recon_err_source: float | None = None


class SharedDecisionRows:
    """``attention_hook`` function for :func:`decision_forward` on sdpa / eager models: every
    variant's fed tokens attend to the one batch-1 prefix cache (:class:`kvnotes.kv.patch.SharedPrefix`;
    no variant cache is built), its decision row without the keys ``knock`` hides; with
    ``capture``, the decision rows' attention probabilities through the model's eager function,
    as :class:`DecisionRowHook` records them.

    Args:
        source: optional second batch-1 prefix over the same positions (the other run of a pair):
            the same variants then run on it too, rows ``V .. 2V - 1`` of the forward, in the same
            batch-2 attention call (each row over its own prefix's keys).

    Attributes:
        probs: layer -> fp32 ``[G V, d + 1]`` head-mean probabilities by absolute position (``G`` = 2
            with ``source``, else 1).
        recon_err: layer -> fp32 ``[G V]``: max |eager output - executed output| at each decision row.
    """

    def __init__(self, cache, knock: Masks | None, V: int, n: int, capture: bool, source=None):
        d = kvcache.seq_length(cache)
        prefixes = [cache] if source is None else [cache, source]
        nothing = FactoredMasks(torch.zeros(V, d, dtype=torch.bool), torch.zeros(V, len(cache.layers), dtype=torch.bool))
        self.shared = kvpatch.SharedPrefix(prefixes, cache, nothing, n, d, cache.layers[0].keys.dtype, hide=knock)
        self.positions = [kvcache.slot_positions(l) for l in cache.layers]
        self.d, self.capture = d, capture
        self.probs: dict[int, torch.Tensor] = {}
        self.recon_err: dict[int, torch.Tensor] = {}

    def __call__(self, base, module, query, key, value, attention_mask, **kwargs):
        B, H, n, _ = query.shape
        q, k, v, mask = self.shared.block(module, query, key, value)
        out, _ = base(module, q, k, v, mask, **kwargs)                    # [G, V * n, heads, hd]
        if self.capture:
            layer = module.layer_idx
            G = q.shape[0]
            V = B // G
            rows = torch.arange(V, device=q.device) * n                      # each variant's decision row
            m = additive_mask(mask[..., rows, :], V, mask.shape[-1], q.device)
            probs, eout = eager_probabilities(module, q[:, :, rows], k, v, m, **kwargs)   # [G, H, V, keys]
            p = probs.mean(1)                                                # head mean [G, V, keys]
            pos = self.positions[layer]
            S = len(pos)
            full = torch.zeros(G, V, self.d + 1, dtype=torch.float32, device=q.device)
            full[:, :, pos] = p[:, :, :S]
            full[:, :, self.d] = p[:, torch.arange(V, device=q.device), S + rows]   # its own decision token
            self.probs[layer] = full.reshape(G * V, -1).cpu()
            self.recon_err[layer] = (eout - out[:, rows].float()).abs().flatten(2).amax(2).reshape(G * V).cpu()
        return out.reshape(B, n, H, -1), None


@torch.no_grad()
def _refuse_all_slots(model, what: str, *caches) -> None:
    """Refuse an all-slot cache (:class:`kvnotes.kv.cache.AllSlotCache`) of a model with sliding-window
    layers: the rows these hooks run would attend past the window (a prefix cache holds it).

    Raises:
        KvnotesError: one line naming ``what``.
    """
    if any(isinstance(c, kvcache.AllSlotCache) for c in caches):
        from kvnotes.models.adapters import Adapter

        if "sliding_attention" in Adapter.for_model(model).layer_types:
            raise KvnotesError(f"{what}: an all-slot cache of a model with sliding-window layers would let the decision "
                               "row attend past the window; pass its prefix cache (kvnotes.kv.cache.prefill)")


def decision_forward(model, cache, tokens: torch.Tensor, knock: Masks | None = None,
                     capture: bool = False, budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES,
                     source=None) -> DecisionRead:
    """Feed ``tokens`` (the first at the decision position ``d = seq_length(cache)``) on a prefix
    cache, optionally knocking out keys for the decision row and capturing its attention.

    Variants run batched: on sdpa / eager models cache-free, every variant attending to the one
    prefix cache (:class:`SharedDecisionRows`, chunks of :func:`kvnotes.kv.patch.shared_prefix_chunk`);
    on others over an expanded view of ``cache``, in chunks whose materialised variant caches fit
    ``budget_bytes`` (:class:`DecisionRowHook`; a knockout then raises).

    Args:
        cache: batch-1 prefix cache over ``[0, d)`` (left unchanged).
        tokens: ``[n]`` token ids (decision token, then any teacher-forced continuation).
        knock: bool ``[V, n_layers, d]`` (see :func:`knockout_masks`); None = one clean variant.
        capture: compute the decision row's attention probabilities per layer.
        source: optional second batch-1 prefix cache over the same positions (the other run of a
            pair): the variants then run on ``cache`` (rows ``0 .. V-1``) and on ``source`` (rows
            ``V .. 2V-1``), on sdpa / eager models in the same forwards (one batch-2 attention call,
            each row over its own prefix's keys: :class:`kvnotes.kv.patch.SharedPrefix`).

    Returns:
        :class:`DecisionRead` (``2V`` rows with ``source``).

    Raises:
        KvnotesError: a knockout under an attention implementation other than sdpa/eager, or an
            all-slot cache (:class:`kvnotes.kv.cache.AllSlotCache`) of a model with sliding-window
            layers: the decision row would attend past the window (its prefix cache,
            :func:`kvnotes.kv.cache.prefill`, holds the window).
    """
    _refuse_all_slots(model, "decision_forward", cache, source)
    d = kvcache.seq_length(cache)
    V = 1 if knock is None else knock.shape[0]
    lps, probs, errs = [], [], []
    shared = model.config._attn_implementation in kvpatch.SHARED_PREFIX_ATTENTION
    if source is not None and not shared:
        reads = [decision_forward(model, c, tokens, knock, capture, budget_bytes) for c in (cache, source)]
        return DecisionRead(torch.cat([r.logprobs for r in reads]),
                            torch.cat([r.probs for r in reads]) if capture else None,
                            reads[0].recon_err, reads[1].recon_err)
    if shared:
        tokens = tokens.to(model.device)
        n = tokens.shape[0]
        G = 1 if source is None else 2      # with a source, the same variants on both prefixes, one forward
        size = kvpatch.shared_prefix_chunk(torch.zeros(1, 1, d, dtype=torch.bool), cache, n)
        for s in range(0, V, size):
            part = knock[s: s + size] if knock is not None else None
            W = 1 if part is None else part.shape[0]
            hook = SharedDecisionRows(cache, part, W, n, capture, source)
            with attention_hook(model, hook):
                out = model(input_ids=tokens[None].expand(G * W, -1),
                            position_ids=torch.arange(d, d + n, device=model.device)[None].expand(G * W, -1),
                            use_cache=False)
            lps.append(torch.log_softmax(out.logits.float(), dim=-1).unflatten(0, (G, W)))      # [G, W, n, vocab]
            if capture:
                probs.append(torch.stack([hook.probs[l] for l in sorted(hook.probs)], dim=1).unflatten(0, (G, W)))
                errs.append(torch.stack(list(hook.recon_err.values())).amax(0).unflatten(0, (G, W)))
        logprobs = torch.cat(lps, 1).flatten(0, 1)                  # rows on cache, then rows on source
        if not capture:
            return DecisionRead(logprobs, None, None)
        row_errs = torch.cat(errs, 1)                               # [G, V]
        return DecisionRead(logprobs, torch.cat(probs, 1).flatten(0, 1), float(row_errs[0].max()),
                            float(row_errs[1].max()) if source is not None else None)
    for sl in kvcache.chunks(V, kvcache.variant_bytes(cache), budget_bytes):
        hook = DecisionRowHook(model, d, d, None if knock is None else knock[sl].to(model.device), capture)
        with attention_hook(model, hook):
            lps.append(kvcache.continuation_logprobs(model, kvcache.expand_cache(cache, model.config, sl.stop - sl.start),
                                                     tokens, d))
        if capture:
            probs.append(torch.stack([hook.probs[l] for l in sorted(hook.probs)], dim=1))
            errs.append(max(hook.recon_err.values()))
    return DecisionRead(torch.cat(lps), torch.cat(probs) if capture else None, max(errs) if capture else None)


# --------------------------------------------------------------------------------------------
# knockouts that hold while a chain is generated (issue #20: the generated readout)


class ChainRowsHook(DecisionRowHook):
    """``attention_hook`` function for :func:`generate_knocked`: the decision query **and every
    query after it** (the generated chain's tokens, one per decode step) cannot attend to the keys
    ``knock`` hides, in every forward of the generation; with ``capture``, those queries' attention
    probabilities (the model's eager function, fp32, mean over heads) summed over key ``spans``.

    Each forward's fed positions are counted per layer from ``pos`` (the position of the first
    forward's first token), so no position has to be passed in; keys are the contiguous positions
    ending at the last query (prefix caches of :mod:`kvnotes.kv.cache`, filled sliding windows
    included).

    Args:
        decision: position ``d`` of the decision query (queries at ``>= d`` are knocked / captured).
        pos: position of the first token the first hooked forward feeds.
        knock: optional bool ``[V, n_layers, P]``: hide key position ``p < P`` in layer ``l`` from
            batch row ``v``'s queries at ``>= d``.
        spans: with ``capture``, key position ranges ``[start, end)`` summed per query.

    Attributes:
        masses: layer -> list (one per forward, in order) of fp32 ``[B, q, len(spans)]`` masses of
            the queries at ``>= d`` (``q`` is 1 on decode steps).
        recon_err: max |eager output - executed output| over those queries, layers and forwards.
    """

    def __init__(self, model, decision: int, pos: int, knock: Masks | None = None,
                 spans: list[tuple[int, int]] | None = None):
        super().__init__(model, decision, pos, knock, capture=spans is not None)
        self.spans = spans or []
        self.fed: dict[int, int] = {}
        self.masses: dict[int, list[torch.Tensor]] = {}
        self.max_recon_err = 0.0

    def __call__(self, base, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        q_len, kv_len = query.shape[2], key.shape[2]
        start = self.start + self.fed.get(layer, 0)
        self.fed[layer] = self.fed.get(layer, 0) + q_len
        end = start + q_len
        if end <= self.decision:
            return base(module, query, key, value, attention_mask, **kwargs)
        rows = slice(max(self.decision - start, 0), q_len)
        k_pos = torch.arange(end - kv_len, end, device=query.device)
        if self.knock is not None and bool(layer_mask(self.knock, layer).any()):
            attention_mask = self._knocked(attention_mask, q_len, kv_len, layer, rows, k_pos, query.device,
                                           query.shape[1])
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        if self.capture:
            mask = additive_mask(attention_mask, q_len, kv_len, query.device)[..., rows, :]
            probs, eout = eager_probabilities(module, query[:, :, rows], key, value, mask, **kwargs)
            p = probs.mean(1)                                                    # [B, r, kv_len]
            self.masses.setdefault(layer, []).append(torch.stack(
                [p[..., (k_pos >= s) & (k_pos < e)].sum(-1) for s, e in self.spans], dim=-1).cpu())
            self.max_recon_err = max(self.max_recon_err, float((eout - out[:, rows].float()).abs().max()))
        return out, weights

    def step_masses(self) -> torch.Tensor:
        """fp32 ``[B, steps, n_layers, len(spans)]``: the captured masses of every query at ``>= d``
        in feeding order (step 0 = the decision query; on a generation, step ``s`` = the query of
        the chain's ``s``-th token)."""
        layers = sorted(self.masses)
        return torch.stack([torch.cat(self.masses[l], dim=1) for l in layers], dim=2)


@torch.no_grad()
def generate_knocked(model, cache, token: int, max_new_tokens: int, reached, stop_ids=(),
                     knock: Masks | None = None, spans: list[tuple[int, int]] | None = None):
    """Decode ``V`` chains (:func:`kvnotes.kv.generate.generate`, greedy) from one batch-1 prefix
    cache over ``[0, d)``, variant ``v`` with the keys ``knock[v]`` hidden from the decision query and
    from every generated token's query on every decode step, and read each decision after its
    answer marker.

    Args:
        cache: batch-1 prefix cache over ``[0, d)`` (left unchanged; the variants share it).
        token: the decision token fed at ``d``.
        knock: bool ``[V, n_layers, d]`` (:func:`knockout_masks`; a row of zeros is the clean chain);
            None = one clean chain.
        spans: key ranges whose attention mass is captured per query (:class:`ChainRowsHook`).

    Returns:
        (:class:`kvnotes.kv.generate.Generated`, the :class:`ChainRowsHook` with the captured masses).

    Raises:
        KvnotesError: a knockout under an attention implementation other than sdpa/eager, or an
            all-slot cache (:class:`kvnotes.kv.cache.AllSlotCache`) of a model with sliding-window
            layers: the decision row would attend past the window (its prefix cache,
            :func:`kvnotes.kv.cache.prefill`, holds the window).
    """
    _refuse_all_slots(model, "generate_knocked", cache)
    d = kvcache.seq_length(cache)
    V = 1 if knock is None else knock.shape[0]
    hook = ChainRowsHook(model, d, d, None if knock is None else knock.to(model.device), spans)
    with attention_hook(model, hook):
        gen = generate(model, cache, token, d, max_new_tokens, reached, stop_ids, n_variants=V)
    return gen, hook


#: The disjoint key groups that cover the decision row's keys ``[0, d]`` (:func:`key_groups`).
GROUPS = ("sinks", "prefix", "field", "downstream", "decision")
#: Key groups of a generated chain's queries: :data:`GROUPS`, then ``chain`` (the generated tokens
#: themselves, ``(d, d + 1 + step]``).
CHAIN_GROUPS = GROUPS + ("chain",)


def key_groups(field: tuple[int, int], decision: int, n_sinks: int) -> dict[str, tuple[int, int]]:
    """Disjoint position ranges ``[start, end)`` of the key groups, covering ``[0, d]``.

    Args:
        field: token span ``(a, b)`` of the field.
        decision: decision position ``d``.
        n_sinks: number of leading positions counted as attention sinks (clipped at ``a``).

    Raises:
        ValueError: ``n_sinks < 0`` or a span outside ``[0, d)``.
    """
    a, b = field
    if n_sinks < 0:
        raise ValueError(f"n_sinks must be >= 0, got {n_sinks}")
    if not 0 <= a <= b <= decision:
        raise ValueError(f"field {field} is not inside [0, {decision})")
    s = min(n_sinks, a)
    return {"sinks": (0, s), "prefix": (s, a), "field": (a, b), "downstream": (b, decision),
            "decision": (decision, decision + 1)}


def group_masses(probs: torch.Tensor, groups: dict[str, tuple[int, int]]) -> torch.Tensor:
    """Sum probabilities over each key group.

    Args:
        probs: ``[..., d + 1]`` probabilities by position.

    Returns:
        ``[..., len(GROUPS)]`` in :data:`GROUPS` order.
    """
    return torch.stack([probs[..., s:e].sum(-1) for s, e in (groups[g] for g in GROUPS)], dim=-1)


def chain_spans(groups: dict[str, tuple[int, int]], decision: int) -> list[tuple[int, int]]:
    """Key ranges of :data:`CHAIN_GROUPS` for a generated chain's queries: the prompt's groups
    (:func:`key_groups`) and ``chain``, every generated position after the decision token."""
    return [groups[g] for g in GROUPS] + [(decision + 1, 1 << 62)]
