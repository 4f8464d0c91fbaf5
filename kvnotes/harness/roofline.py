"""Roofline floors: the machine's best rates, measured in the running process, and the least time a
forward can take at them.

A forward of ``n`` tokens must do its FLOPs (:func:`kvnotes.ops.edit.forward_flops`) and must read
every weight it multiplies by once, plus the KV cache it attends to; at the machine's best GEMM rate
and its best weight-read rate it can take no less than the larger of the two times (the roofline
bound of Williams et al., 2009). Used by the benchmark scripts (``kvnotes bench edit``,
``kvnotes bench compose``) to print measured / floor, and by ``kvnotes battery --floor``.

The battery also counts the linear calls a probe really makes (:class:`Roofline`) and holds the
probe to the model's own forward making the same calls (issue #37): :func:`plain_ratios` times the
model's plain decoder stack at the row counts the probes use, :func:`plain_equivalent` prices a
probe's calls at those measured ratios, and measured / plain-forward equivalent is the harness's own
overhead (target 1.2x).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Sequence

import torch

from kvnotes.ops.edit import model_shape, forward_flops, params_per_token


def machine_rates(model, rows: int = 2048, repeats: int = 10) -> tuple[float, float]:
    """This machine's best rates for the model, in its dtype on its device (best of ``repeats``, and
    of PyTorch's ``F.linear`` and the prepacked oneDNN kernel of :mod:`kvnotes.models.cpu_linear` on
    an fp32 CPU model).

    Returns:
        ``(flop_rate, byte_rate)``: FLOP/s of a dense ``[rows, hidden] x [hidden, intermediate]``
        product (the MLP shape), and bytes/s of a one-row product with the unembedding matrix (bound
        by reading the weight).
    """
    from kvnotes.models import cpu_linear

    cfg = model.config.get_text_config()
    p = next(model.parameters())
    x = torch.randn(rows, cfg.hidden_size, dtype=p.dtype, device=p.device)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size, dtype=p.dtype, device=p.device)
    head = model.get_output_embeddings().weight

    def best(fn) -> float:
        out = float("inf")
        for _ in range(repeats + 2):
            if p.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if p.device.type == "cuda":
                torch.cuda.synchronize()
            out = min(out, time.perf_counter() - t)
        return out

    kernels = [(torch.nn.functional.linear, w, head)]
    if p.device.type == "cpu" and p.dtype == torch.float32 and cpu_linear.available():   # the model's other kernel
        kernels.append((cpu_linear.packed_linear, cpu_linear.pack_weight(w), cpu_linear.pack_weight(head)))
    with torch.no_grad():
        flop_rate = max(2 * rows * cfg.hidden_size * cfg.intermediate_size / best(lambda: k(x, kw)) for k, kw, _ in kernels)
        byte_rate = max(head.numel() * head.element_size() / best(lambda: k(x[:1], kh)) for k, _, kh in kernels)
    return flop_rate, byte_rate


def kv_bytes(config, positions: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values of ``positions`` cache positions over every layer:
    ``2 * L * KVH * hd * positions * dtype_bytes``."""
    s = model_shape(config)
    return 2 * s["L"] * s["KVH"] * s["hd"] * positions * dtype_bytes


def forward_floor_s(config, rates: tuple[float, float], dtype_bytes: int, n_tokens: int, pairs: int,
                    cache_positions: int, logit_rows: int = 0, extra_bytes: int = 0) -> float:
    """Seconds a forward of ``n_tokens`` tokens can take at best: the larger of its FLOPs over the
    GEMM rate and the bytes it must move over the memory rate.

    Args:
        config: the model's config (dense attention and gated MLP, :func:`kvnotes.ops.edit.params_per_token`).
        rates: ``(FLOP/s, bytes/s)`` (:func:`machine_rates`).
        dtype_bytes: bytes per weight and per cached key/value element.
        n_tokens: tokens forwarded.
        pairs: (query, key) pairs attended (:func:`kvnotes.ops.edit.span_pairs` for a causal span).
        cache_positions: cached positions the forward reads (keys and values, every layer, once).
        logit_rows: rows put through the LM head (its weight read once if any; ``2 * vocab * hidden``
            FLOPs a row).
        extra_bytes: other bytes the operation must move (e.g. rotating a chunk's keys: read + write).

    Returns:
        the floor in seconds. Norms, RoPE and other elementwise work are not counted.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    flop_rate, byte_rate = rates
    head = cfg.vocab_size * cfg.hidden_size if logit_rows else 0
    flops = forward_flops(cfg, n_tokens, pairs) + 2.0 * logit_rows * head
    moved = (params_per_token(cfg) + head) * dtype_bytes + kv_bytes(cfg, cache_positions, dtype_bytes) + extra_bytes
    return max(flops / flop_rate, moved / byte_rate)


def plain_forward(model, roof: "Roofline", rates: tuple[float, float], tokens: int,
                  shapes: tuple = ((1, "prefill"), (3, "prefill"), (1, "decode"), (21, "decode")),
                  repeats: int = 5) -> list[dict]:
    """What the model's own forward reaches against the battery's floor: the best of ``repeats``
    timed forwards (transformers, no hooks, last-position logits) of ``B`` prompts of ``tokens``
    random tokens (``prefill``), or of one token for ``B`` rows on a ``tokens``-position cache
    (``decode``), over the :class:`Roofline` floor of the linear calls they make. A probe cannot
    come closer to its floor than these forwards come to theirs without a faster forward.

    Returns:
        per shape ``{what, rows, tokens, measured_s, floor_s, ratio}``.
    """
    import torch
    from transformers import DynamicCache

    out = []
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    for B, kind in shapes:
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (B, tokens), generator=g).to(dev)
        with torch.no_grad():
            cache, restore = DynamicCache(config=model.config), None
            if kind == "decode":        # one prompt prefilled, its cache viewed as B rows (no B-row prefill)
                model(input_ids=ids[:1], past_key_values=cache, use_cache=True, logits_to_keep=1)
                for layer in cache.layers:
                    layer.keys, layer.values = (t.expand(B, -1, -1, -1) for t in (layer.keys, layer.values))
                ids = ids[:, :1]
                restore = snapshot(cache)

            def forward():
                if kind == "decode":
                    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                          position_ids=torch.full((B, 1), tokens, device=dev))
                else:
                    model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

            best, floor = timed_against_floor(forward, roof, rates, repeats, dev, after=restore)   # decode: back to the prefix
        out.append({"what": f"{kind} {B}x{tokens if kind == 'prefill' else 1}", "rows": B, "tokens": tokens,
                    "measured_s": best, "floor_s": floor, "ratio": best / floor})
    return out


class Roofline:
    """A floor on the time of every ``nn.Linear`` call of ``model`` since construction: a forward
    hook per module counts the call by its shape (rows, in, out, weight bytes); a call takes at
    least the larger of ``2 * rows * in * out / flop_rate`` and ``weight bytes / byte_rate`` (it can
    neither multiply faster than the machine's best GEMM nor read its weight faster than memory
    delivers it). Layers a run skips (nnsight ``skip``) are not called, hence not counted;
    attention scores, candidate-only logits and elementwise work are not counted either.
    """

    def __init__(self, model) -> None:
        import torch

        self.calls: Counter = Counter()                  # (rows, in, out, weight bytes) -> calls
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(self._count)

    def _count(self, module, args, out) -> None:
        size = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        self.calls[(args[0].numel() // module.in_features, module.in_features, module.out_features, size)] += 1

    @staticmethod
    def floor(calls: Counter, flop_rate: float, byte_rate: float) -> dict:
        """``flops``, ``weight_bytes`` and ``floor_s`` of ``calls`` (a :attr:`calls` counter, or the
        difference of two) at these rates (FLOP/s, bytes/s)."""
        out = {"flops": 0, "weight_bytes": 0, "floor_s": 0.0}
        for (rows, i, o, size), n in calls.items():
            flops = 2 * rows * i * o
            out["flops"] += n * flops
            out["weight_bytes"] += n * size
            out["floor_s"] += n * max(flops / flop_rate, size / byte_rate)
        return out


def timed_against_floor(forward, roof: "Roofline", rates: tuple[float, float], repeats: int, device,
                        after=None) -> tuple[float, float]:
    """The best wall time (s) of ``repeats`` calls of ``forward`` after one warm-up call (the device
    synchronised), and the :class:`Roofline` floor (s) of the linear calls one call makes; ``after``
    (untimed) runs after each call, e.g. a cache's :func:`snapshot` restore."""
    best, floor = float("inf"), 0.0
    for i in range(repeats + 1):
        c0 = roof.calls.copy()
        t = time.perf_counter()
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:                                               # call 0 is the warm-up
            best = min(best, time.perf_counter() - t)
            floor = Roofline.floor(roof.calls - c0, *rates)["floor_s"]
        if after is not None:
            after()
    return best, floor


def snapshot(cache):
    """A function that puts ``cache`` (a ``DynamicCache``) back to its state now: each layer's keys,
    values and (sliding-window layers) token count. A forward's cache update replaces a layer's
    tensors rather than writing into them, so keeping the references is enough; unlike ``crop``, this
    also undoes a sliding-window layer's trimming."""
    saved = [(layer, layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in cache.layers]

    def restore() -> None:
        for layer, k, v, n in saved:
            layer.keys, layer.values = k, v
            if n is not None:
                layer.cumulative_length = n
    return restore


#: The largest row count :func:`plain_ratios` times; calls with more rows are priced at its ratio
#: (a forward of that many rows is bound by its matrix products, its ratio to the floor flat in rows).
MAX_TIMED_ROWS = 2048


def row_grid(calls: Counter, cap: int = MAX_TIMED_ROWS) -> list[int]:
    """Powers of two from the fewest to the most rows among ``calls`` (:attr:`Roofline.calls` keys
    ``(rows, in, out, bytes)``), the last at most ``cap``: the row counts :func:`plain_ratios` times."""
    rows = [k[0] for k in calls]
    if not rows:
        return []
    lo, hi = min(rows), min(max(rows), cap)
    out = [1 << int(math.floor(math.log2(max(lo, 1))))]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return [min(r, cap) for r in out]


def plain_ratios(model, roof: "Roofline", rates: tuple[float, float], context: int, rows: Sequence[int],
                 repeats: int = 3) -> dict[int, float]:
    """Measured / floor of the model's own decoder stack (``model.get_decoder()``: transformers, no
    hooks, no unembedding) feeding one sequence of ``r`` random tokens on a ``context``-position
    cache, for each ``r`` of ``rows``: the best of ``repeats`` timed forwards after one warm-up, over
    the :class:`Roofline` floor of the linear calls the forward makes.

    A probe's forwards feed ``r`` rows (variants x fed tokens, one query block or a batch) on a cache
    of about the prompt's length; this is the model's own forward doing the same.

    Returns:
        ``{r: ratio}`` (dimensionless, >= 1 up to timer noise).
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    stack = model.get_decoder()
    out = {}
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        stack(input_ids=torch.randint(0, vocab, (1, context), generator=g).to(dev), past_key_values=cache, use_cache=True)
        restore = snapshot(cache)
        for r in rows:
            ids = torch.randint(0, vocab, (1, r), generator=g).to(dev)
            pos = torch.arange(context, context + r, device=dev)[None]

            def forward():
                stack(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)

            best, floor = timed_against_floor(forward, roof, rates, repeats, dev, after=restore)
            out[r] = best / floor
    return out


def plain_equivalent(calls: Counter, rates: tuple[float, float], ratios: dict[int, float]) -> float:
    """Seconds the model's own forward takes to make ``calls`` (a :attr:`Roofline.calls` counter):
    each call's floor times the plain forward's measured / floor ratio at its row count
    (:func:`plain_ratios`; interpolated linearly in ``log2(rows)`` between the timed row counts,
    the nearest one's outside them).

    Raises:
        ValueError: ``ratios`` is empty while ``calls`` is not.
    """
    if not calls:
        return 0.0
    if not ratios:
        raise ValueError("plain_equivalent: no plain-forward ratios to price the calls at")
    grid = sorted(ratios)
    logs = [math.log2(r) for r in grid]

    def ratio(rows: int) -> float:
        x = math.log2(max(rows, 1))
        i = bisect.bisect_left(logs, x)
        if i == 0:
            return ratios[grid[0]]
        if i == len(grid):
            return ratios[grid[-1]]
        w = (x - logs[i - 1]) / (logs[i] - logs[i - 1])
        return (1 - w) * ratios[grid[i - 1]] + w * ratios[grid[i]]

    return sum(Roofline.floor(Counter({k: n}), *rates)["floor_s"] * ratio(k[0]) for k, n in calls.items())
