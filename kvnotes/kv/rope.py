"""RoPE algebra on cached keys: the pure rotation by a position delta, and cached K/V moved by it.

RoPE rotates each key at position ``i`` by the angle ``i * inv_freq`` (per frequency pair), and
rotations compose, so a post-RoPE key at ``i`` becomes the key at ``i + delta`` by one further
rotation by ``delta * inv_freq``. That delta rotation is taken from the model's own rotary module
(the adapter's ``rotary`` path, called with ``position_ids = [[delta]]``), never from a hand-copied
frequency formula, so it follows

- the layer type: a rotary module whose ``forward`` takes ``layer_type`` (Gemma-3) is called once
  per type, so sliding layers get the local theta and full layers the global one;
- the rope scaling of the config (``linear``, ``llama3``, ``yarn``): these change ``inv_freq`` only.
  The module multiplies cos/sin by its ``attention_scaling`` (YaRN's mscale), which the cached key
  already carries once; the delta rotation divides it out so it is a pure rotation;
- partial rotary (StableLM, Phi, GPT-NeoX): the module's cos/sin cover only the first
  ``rot_dim = cos.shape[-1]`` dims of each head; only those are rotated, the rest are copied.

The ``rotate_half`` layout (pairs ``(j, j + rot_dim/2)``) of Llama, Qwen, Mistral, Gemma and
StableLM is assumed; rope types whose frequencies depend on the sequence length (``dynamic``,
``longrope``) are refused (a delta rotation is not defined for them). A rotation is applied
element-wise (:func:`rotate_into`) or as a ``[head_dim, head_dim]`` matrix (:func:`rotation_matrix`,
one GEMM for many layers). Composition (:mod:`kvnotes.ops.compose`) moves precompiled chunks with it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from kvnotes.models.adapters import Adapter
from kvnotes.errors import KvnotesError


#: Rope types whose frequencies do not depend on the sequence length: a delta rotation exists.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_type(rotary, layer_type: str | None) -> str:
    rt = getattr(rotary, "rope_type", "default")
    if isinstance(rt, dict):
        rt = rt.get(layer_type, "default")
    return rt


def _cos_sin(out) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary module's output as ``(cos, sin)`` ``[..., rot_dim]`` with ``cos[..., :rot_dim/2]``
    the per-pair values: a ``(cos, sin)`` pair as returned (rotate_half modules, ``cat(f, f)``), or
    one complex tensor ``[..., rot_dim/2]`` (DeepSeek-V2's ``freqs_cis``) spread the same way."""
    if isinstance(out, torch.Tensor) and out.is_complex():
        return torch.cat([out.real, out.real], -1), torch.cat([out.imag, out.imag], -1)
    return out


@torch.no_grad()
def delta_rotations(model, delta) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the pure rotation by ``delta`` positions as ``(cos, sin)``, each ``[rot_dim]`` fp32
    (per-token deltas: ``[n, rot_dim]``).

    Taken from the model's rotary module (adapter path ``rotary``) at ``position_ids = [[delta]]``,
    once per layer type when the module is per-type (Gemma-3), with the module's
    ``attention_scaling`` divided out (it is already inside every cached key; paper §5, YaRN). A
    module returning complex ``freqs_cis`` (DeepSeek-V2) is read as ``cos = Re``, ``sin = Im``.

    Args:
        delta: an int (every token moves by it; on an M-RoPE model all three channels move), or
            per-token deltas: ``[n]`` (1-D positions) or ``[3, n]`` (M-RoPE temporal, height, width
            deltas, mapped to per-pair angles by the module's own sections / interleaving).

    Raises:
        KvnotesError: a rope type whose frequencies depend on the sequence length
            (see :data:`STATIC_ROPE_TYPES`), or ``[3, n]`` deltas on a model without M-RoPE.
    """
    adapter = Adapter.for_model(model)
    rotary = adapter.module(model, "rotary")
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    x = torch.zeros(1, dtype=torch.float32, device=model.device)
    per_token = isinstance(delta, torch.Tensor)
    if not per_token:
        pos = torch.tensor([[delta]], dtype=torch.long, device=model.device)
    elif delta.dim() == 2:
        if getattr(rotary, "mrope_section", None) is None:
            raise KvnotesError(f"3-D position deltas on model_type '{adapter.model_type}', whose rotary "
                               f"embedding has no M-RoPE sections")
        pos = delta.to(model.device, torch.long).unsqueeze(1)          # [3, 1, n]
    else:
        pos = delta.to(model.device, torch.long).view(1, -1)
    by_type = {}
    for lt in dict.fromkeys(adapter.layer_types):
        key = lt if per_type else None
        if key in by_type:
            continue
        rt = _rope_type(rotary, key)
        if rt not in STATIC_ROPE_TYPES:
            raise KvnotesError(f"cannot re-position keys under rope type '{rt}' (supported: {', '.join(STATIC_ROPE_TYPES)})")
        if per_type:
            cos, sin = _cos_sin(rotary(x, pos, layer_type=lt))
            scale = getattr(rotary, f"{lt}_attention_scaling", 1.0)
        else:
            cos, sin = _cos_sin(rotary(x, pos))
            scale = getattr(rotary, "attention_scaling", 1.0)
        shape = (-1, cos.shape[-1]) if per_token else (-1,)
        by_type[key] = (cos.reshape(shape).float() / scale, sin.reshape(shape).float() / scale)
    return [by_type[lt if per_type else None] for lt in adapter.layer_types]


def rotate_into(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
                interleaved: bool = False) -> torch.Tensor:
    """Write ``keys`` rotated by ``(cos, sin)`` into ``out`` (``rotate_half`` layout, partial rotary).

    ``out[..., :r] = keys[..., :r] * cos + rotate_half(keys[..., :r]) * sin`` with ``r = len(cos)``
    and ``out[..., r:] = keys[..., r:]``; computed in fp32 and cast to ``out``'s dtype. ``out`` may
    be ``keys`` itself (the halves are computed before writing) or a slice of a preallocated cache.
    With ``interleaved`` the pairs are ``(2j, 2j + 1)`` (DeepSeek's layout; pair ``j`` still turns
    by ``cos[..., j]``, ``sin[..., j]``) instead of ``(j, j + r/2)``.

    Args:
        keys: ``[..., n, head_dim]``, post-RoPE keys (MLA: the cached rotary keys ``k_rot``).
        cos: ``[rot_dim]`` from :func:`delta_rotations`, or ``[n, rot_dim]`` (one rotation per token).
        sin: as ``cos``.
        out: a tensor of ``keys``' shape (broadcast over batch allowed).
        interleaved: pairs ``(2j, 2j + 1)``.

    Returns:
        ``out``.
    """
    r = cos.shape[-1]
    h = r // 2
    c, s = cos[..., :h].to(keys.device), sin[..., :h].to(keys.device)
    one, two = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, h), slice(h, r))
    k1, k2 = keys[..., one].float(), keys[..., two].float()
    first = k1 * c - k2 * s
    second = k2 * c + k1 * s
    out[..., one] = first
    out[..., two] = second
    if r < keys.shape[-1] and out.data_ptr() != keys.data_ptr():
        out[..., r:] = keys[..., r:]
    return out


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    dtype: torch.dtype | None = None, interleaved: bool = False) -> torch.Tensor:
    """The delta rotation as a matrix ``R`` ``[head_dim, head_dim]`` with ``keys @ R`` equal to
    :func:`rotate_into` (``rotate_half`` pairs ``(j, j + r/2)`` for ``r = len(cos)``, or pairs
    ``(2j, 2j + 1)`` with ``interleaved``; identity on the dims ``>= r``, the partial-rotary ones).

    Built in fp32 from :func:`delta_rotations`' ``(cos, sin)`` and cast to ``dtype`` (the keys'
    dtype; the GEMM accumulates in fp32, and in bf16 the coefficients are rounded as the model's own
    bf16 ``cos``/``sin`` are).
    """
    r = cos.shape[-1]
    h = r // 2
    c, s = cos[:h].float(), sin[:h].float()
    R = torch.eye(head_dim, dtype=torch.float32, device=cos.device)
    j = torch.arange(h, device=cos.device)
    a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + h)
    R[a, a] = c
    R[b, b] = c
    R[b, a] = -s
    R[a, b] = s
    return R if dtype is None else R.to(dtype)


def rope_layout(model) -> tuple[str, bool]:
    """``(slot, interleaved)``: which cache tensor of a layer carries the rotary sub-vector
    (``"keys"``, or ``"values"`` for MLA whose cache holds the latent and ``k_rot``) and whether its
    pairs are interleaved; from the adapter (``adapters.yaml``, ``rope``)."""
    a = Adapter.for_model(model)
    return a.rope_slot, a.rope_interleaved


def _rotated(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
             rots: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    slot, interleaved = rope_layout(model)
    moving = keys if slot == "keys" else values
    moved = [rotate_into(t, c, sn, torch.empty_like(t), interleaved) for t, (c, sn) in zip(moving, rots, strict=True)]
    return (moved, list(values)) if slot == "keys" else (list(keys), moved)


def reposition(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               delta) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer cached K/V of tokens moved by ``delta`` positions.

    Only the part that carries the rotary sub-vector is rotated (:func:`rope_layout`): the keys'
    first ``rot_dim`` dims (Llama-style, partial rotary), or for MLA the cached ``k_rot`` (the
    cache's ``values`` slot in transformers' layout); everything else is returned as given (the same
    tensors, not copies).

    Args:
        keys: per layer, as a cache layer holds them (``[batch, heads, n, dim]``).
        values: per layer, likewise.
        delta: as :func:`delta_rotations` (an int, or per-token ``[n]`` / M-RoPE ``[3, n]`` deltas).

    Returns:
        (keys, values), new tensors for the rotated side.

    Raises:
        KvnotesError: from :func:`delta_rotations`.
    """
    return _rotated(model, keys, values, delta_rotations(model, delta))


def rotate_keys(model, keys: Sequence[torch.Tensor], delta: int) -> list[torch.Tensor]:
    """Per layer keys re-positioned by ``delta`` (new tensors; see :func:`rotate_into`).

    Args:
        keys: per layer ``[batch, kv_heads, n, head_dim]`` post-RoPE keys.

    Raises:
        KvnotesError: the model caches its rotary sub-vector outside the keys (MLA: use
            :func:`reposition`), or from :func:`delta_rotations`.
    """
    slot, interleaved = rope_layout(model)
    if slot != "keys":
        raise KvnotesError(f"model_type '{model.config.model_type}' caches its rotary key in the '{slot}' slot; "
                           f"re-position with kvnotes.kv.rope.reposition")
    rots = delta_rotations(model, delta)
    return [rotate_into(k, c, s, torch.empty_like(k), interleaved) for k, (c, s) in zip(keys, rots, strict=True)]
