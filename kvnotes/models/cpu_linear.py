"""Prepacked oneDNN kernels for a CPU model's fp32 linear layers.

PyTorch sends an fp32 ``F.linear`` on the CPU to MKL's sgemm. On this project's CPU machines that
is slow for the few-row products the batched probes make (a decision forward of 21-64 variant
rows per call, a 100-row prompt prefill): oneDNN's inner product on a weight reordered once into
its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``, the ops
``torch.compile``'s CPU backend uses for frozen linear layers) is faster there
(docs/results/performance.md, "Linear kernels on the CPU"). Results equal ``F.linear`` up to fp32
summation order (the tests compare them within a named tolerance).

:func:`pack_linears` gives each ``nn.Linear`` of a model a packed copy of its weight and an
instance ``forward`` that uses it. The module stays an ``nn.Linear`` with its dense weight (forward
hooks, nnsight, TransformerLens and the code that reads weights see what they saw before); a
weight that changed in place after packing, moved off the CPU or changed dtype falls back to
``F.linear`` on the dense weight, so a stale packed copy is never used; so do the layers of a
``copy.deepcopy`` of the model.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

#: ``model.cpu_linear`` values: ``onednn`` (pack, :func:`pack_linears`) or ``torch`` (PyTorch's default).
CPU_LINEAR = ("onednn", "torch")

#: Largest total of linear weights packed (bytes): the packed copies double their memory.
MAX_PACKED_BYTES = 4 << 30


def available() -> bool:
    """Whether this torch build has the oneDNN ops :func:`pack_linears` needs."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU weight ``[out, in]`` reordered into oneDNN's blocked layout (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on a weight packed by :func:`pack_weight`: ``x [..., in]`` ->
    ``[..., out]``, fp32 on the CPU."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _Packed:
    """A layer's packed weight and the version of the dense weight it was packed from. A copy of the
    model (``copy.deepcopy``) gets ``None`` instead (oneDNN's opaque tensors cannot be copied), so
    the copy's layers run PyTorch's default kernel."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.tensor = pack_weight(weight)
        self.version = weight._version

    def __reduce__(self):
        return type(None), ()


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, packed = self.weight, self._kvnotes_packed
    if packed is None or w._version != packed.version or w.dtype != torch.float32 or w.device.type != "cpu" \
            or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, w, self.bias)
    return packed_linear(x, packed.tensor, self.bias)


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    # "forward" in __dict__: already packed, or wrapped by something else (accelerate's hooks); a
    # copied packed layer (its packed weight None) is packed again
    repack = module.__dict__.get("_kvnotes_packed", False) is None
    return (type(module) is torch.nn.Linear and ("forward" not in module.__dict__ or repack)
            and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu" and not w.is_meta
            and (module.bias is None or module.bias.dtype == torch.float32))


def pack_linears(model: torch.nn.Module, max_bytes: int = MAX_PACKED_BYTES) -> int:
    """Route every fp32 CPU ``nn.Linear`` of ``model`` through oneDNN with its weight prepacked.

    Args:
        model: any module; layers of other types, dtypes or devices (quantized, bf16, on a GPU,
            subclasses of ``nn.Linear``, layers whose ``forward`` something already replaced, such
            as accelerate's offloading hooks or an earlier packing) are left as they are.
        max_bytes: pack nothing when the packable weights exceed this many bytes (each packed copy
            doubles its layer's weight memory).

    Returns:
        The number of layers packed (0 when the build lacks the ops, nothing is packable, or the
        weights exceed ``max_bytes``).
    """
    if not available():
        return 0
    layers: list[torch.nn.Linear] = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and _packable(m)]
    if sum(m.weight.numel() * 4 for m in layers) > max_bytes:
        return 0
    with torch.no_grad():
        for m in layers:
            m._kvnotes_packed = _Packed(m.weight)
            m.forward = types.MethodType(_packed_forward, m)
    return len(layers)


def packed_layers(model: torch.nn.Module) -> int:
    """How many linear layers of ``model`` run on packed oneDNN weights."""
    return sum(m.__dict__.get("_kvnotes_packed") is not None for m in model.modules())
