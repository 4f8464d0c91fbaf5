"""Hooks on attention internals through the ``transformers`` AttentionInterface.

Every attention module in transformers 5.x calls
``attention_interface(module, query, key, value, attention_mask, dropout=..., scaling=..., **kw)``
with ``query``/``key`` post-RoPE (and post q/k-norm), ``key``/``value`` not expanded for GQA. kvnotes
registers, with the public ``AttentionInterface.register``, a dispatcher under the model's
implementation name; while :func:`attention_hook` is active it hands each call to a user function
together with the original implementation (and calls the original alone otherwise). The original is always called with keyword arguments: Gemma orders
``(dropout, scaling)`` differently from Llama, and positional calls silently make attention
uniform (docs/design.md §4, §10).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

#: implementation name -> the function it ran before kvnotes registered its dispatcher (None:
#: "eager", which each modeling file defines itself).
_ORIGINALS: dict[str, Callable | None] = {}
#: implementation name -> the active hook functions (innermost last).
_ACTIVE: dict[str, list[Callable]] = {}


def _base_function(name: str, module: torch.nn.Module) -> Callable:
    fn = _ORIGINALS.get(name)
    if fn is not None:
        return fn
    # "eager" is not registered globally: each model file defines its own eager_attention_forward
    # (Gemma-2's applies logit soft-capping), which the module would have used.
    return sys.modules[type(module).__module__].eager_attention_forward


def _install(name: str) -> None:
    """Register (public ``AttentionInterface.register``) a dispatcher under ``name`` once: it calls
    the innermost active hook, or the implementation that was there before when none is active."""
    if name in _ORIGINALS:
        return
    from transformers import AttentionInterface     # here, not at import: it loads transformers' modeling code,
                                                    # which a run refused before its model loads never needs
    _ORIGINALS[name] = AttentionInterface().get(name)

    def dispatcher(module, query, key, value, attention_mask, **kwargs):
        base = _base_function(name, module)
        hooks = _ACTIVE.get(name)
        if not hooks:
            return base(module, query, key, value, attention_mask, **kwargs)
        return hooks[-1](base, module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, dispatcher)


@contextmanager
def attention_hook(model, fn: Callable):
    """Route every attention call of ``model`` through ``fn`` for the duration of the block.

    Args:
        fn: ``fn(base, module, query, key, value, attention_mask, **kwargs) -> (output, weights)``
            where ``base`` is the implementation the module would have called; ``query`` is
            ``[B, heads, q_len, head_dim]``, ``key``/``value`` ``[B, kv_heads, kv_len, head_dim]``,
            output ``[B, q_len, heads, head_dim]``.

    Note: the hook is found through a dispatcher registered once per implementation name with
    transformers' public ``AttentionInterface.register``; outside a hook block the dispatcher calls
    the original implementation unchanged. Active hooks are global to the process for that name.
    """
    name = model.config._attn_implementation
    _install(name)
    _ACTIVE.setdefault(name, []).append(fn)
    try:
        yield
    finally:
        _ACTIVE[name].pop()


@dataclass
class LayerAttention:
    """One layer's attention call as captured: inputs, output, and how to call it again."""

    module: torch.nn.Module
    base: Callable
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    kwargs: dict = field(default_factory=dict)
    output: torch.Tensor | None = None

    def recompute(self, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                  query: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``[B, q_len, heads, head_dim]`` with some inputs replaced, through the
        model's own implementation (its scaling, soft-capping, sliding mask)."""
        out, _ = self.base(self.module, self.query if query is None else query,
                           self.key if key is None else key, self.value if value is None else value,
                           self.attention_mask, **self.kwargs)
        return out


@torch.no_grad()
def capture_attention(model, ids: torch.Tensor) -> tuple[list[LayerAttention], torch.Tensor]:
    """Run a full forward (no cache, positions ``0..T-1``) and capture every layer's attention call.

    Args:
        ids: ``[T]`` token ids.

    Returns:
        (one :class:`LayerAttention` per layer in layer order, fp32 log-probs ``[vocab]`` of the
        next token after the last position).
    """
    captured: dict[int, LayerAttention] = {}

    def fn(base, module, query, key, value, attention_mask, **kwargs):
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        captured[module.layer_idx] = LayerAttention(module, base, query, key, value, attention_mask, dict(kwargs), out)
        return out, weights

    ids = ids.view(1, -1).to(model.device)
    pos = torch.arange(ids.shape[1], device=model.device).unsqueeze(0)
    with attention_hook(model, fn):
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
    return [captured[i] for i in sorted(captured)], torch.log_softmax(out.logits[0, -1].float(), -1)
