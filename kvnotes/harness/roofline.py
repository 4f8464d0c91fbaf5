"""Roofline floors: the machine's best rates, measured in the running process, and the least time a
forward can take at them.

A forward of ``n`` tokens must do its FLOPs (:func:`kvnotes.ops.edit.forward_flops`) and must read
every weight it multiplies by once, plus the KV cache it attends to; at the machine's best GEMM rate
and its best weight-read rate it can take no less than the larger of the two times (the roofline
bound of Williams et al., 2009). Used by the benchmark scripts (``kvnotes bench edit``,
``kvnotes bench compose``) to print measured / floor, and by ``kvnotes battery --floor``.
"""

from __future__ import annotations

import time

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
