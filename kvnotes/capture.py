"""Hooks on attention internals through the ``transformers`` AttentionInterface.

Every attention module in transformers 5.x calls
``attention_interface(module, query, key, value, attention_mask, dropout=..., scaling=..., **kw)``
with ``query``/``key`` post-RoPE (and post q/k-norm), ``key``/``value`` not expanded for GQA. While
:func:`attention_hook` is active, the function registered under the model's implementation name
is replaced by a wrapper that hands the call to a user function together with the original
implementation. The original is always called with keyword arguments: Gemma orders
``(dropout, scaling)`` differently from Llama, and positional calls silently make attention
uniform (docs/design.md §4, §10).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _base_function(name: str, module: torch.nn.Module) -> Callable:
    fn = _ORIGINALS.get(name)
    if fn is not None:
        return fn
    # "eager" is not registered globally: each model file defines its own eager_attention_forward
    # (Gemma-2's applies logit soft-capping), which the module would have used.
    return sys.modules[type(module).__module__].eager_attention_forward


_ORIGINALS: dict[str, Callable | None] = {}


@contextmanager
def attention_hook(model, fn: Callable):
    """Route every attention call of ``model`` through ``fn`` for the duration of the block.

    Args:
        fn: ``fn(base, module, query, key, value, attention_mask, **kwargs) -> (output, weights)``
            where ``base`` is the implementation the module would have called; ``query`` is
            ``[B, heads, q_len, head_dim]``, ``key``/``value`` ``[B, kv_heads, kv_len, head_dim]``,
            output ``[B, q_len, heads, head_dim]``.

    Note: the replacement is global to the process for the implementation name in use (e.g.
    ``"sdpa"``), and is undone on exit.
    """
    name = model.config._attn_implementation
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    had = name in mapping
    _ORIGINALS[name] = mapping.get(name)

    def wrapper(module, query, key, value, attention_mask, **kwargs):
        return fn(_base_function(name, module), module, query, key, value, attention_mask, **kwargs)

    mapping[name] = wrapper
    try:
        yield
    finally:
        if had:
            mapping[name] = _ORIGINALS[name]
        else:
            mapping.pop(name, None)
        _ORIGINALS.pop(name, None)


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
