"""Patch and knockout masks: which (layer, position) K/V entries each variant acts on
(docs/design.md §4, §5).

A mask is a bool ``[V, n_layers, T]`` tensor. In a **patch** variant ``v`` takes layer ``l``'s
key/value at position ``p`` from the source run where it is true (:mod:`kvnotes.kv.patch`); in a
**knockout** the decision query cannot attend to that key (:mod:`kvnotes.kv.knockout`). Most
variants act on a set of positions in a set of layers, so a mask is often the product of the two;
:class:`FactoredMasks` keeps that product without materialising it. The exact single-position map of an 8,251-token prompt on a 36-layer model
is about 8,000 variants: its dense mask takes 2.4 GB, and a reduction over it (the union of the
substituted slots) took seconds; the factored one takes 66 MB.

The functions below read either kind, so the readout (:mod:`kvnotes.kv.patch`,
:func:`kvnotes.kv.cache.build_variants`) and the knockout hooks take both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FactoredMasks:
    """Masks that are products: variant ``v`` acts on position ``p`` in layer ``l`` iff
    ``positions[v, p]`` and ``layers[v, l]``.

    Attributes:
        positions: bool ``[V, T]``.
        layers: bool ``[V, n_layers]``.
    """

    positions: torch.Tensor
    layers: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(V, n_layers, T)``, the dense mask's shape."""
        return (self.positions.shape[0], self.layers.shape[1], self.positions.shape[1])

    def __len__(self) -> int:
        return self.positions.shape[0]

    def __getitem__(self, idx) -> FactoredMasks:
        """The variants ``idx`` (an index tensor, slice or bool tensor over ``V``)."""
        return FactoredMasks(self.positions[idx], self.layers[idx])

    def to(self, device) -> FactoredMasks:
        return FactoredMasks(self.positions.to(device), self.layers.to(device))

    def dense(self) -> torch.Tensor:
        """The bool ``[V, n_layers, T]`` mask."""
        return self.layers[:, :, None] & self.positions[:, None, :]


#: A dense bool ``[V, n_layers, T]`` mask or its factored form.
Masks = torch.Tensor | FactoredMasks


def layer_mask(masks: Masks, layer: int) -> torch.Tensor:
    """Bool ``[V, T]``: the positions each variant acts on in ``layer``."""
    if isinstance(masks, FactoredMasks):
        return masks.positions & masks.layers[:, layer: layer + 1]
    return masks[:, layer]


def layer_key(masks: Masks, layer: int) -> torch.Tensor:
    """A tensor whose equality for two layers means equal :func:`layer_mask`: the layer's column of
    a factored mask (bool ``[V]``, no ``[V, T]`` tensor built), the dense mask's slice."""
    if isinstance(masks, FactoredMasks):
        return masks.layers[:, layer]
    return masks[:, layer]


def patched_positions(masks: Masks) -> torch.Tensor:
    """Bool ``[V, T]``: the positions each variant patches in any layer."""
    if isinstance(masks, FactoredMasks):
        return masks.positions & masks.layers.any(dim=1, keepdim=True)
    return masks.any(dim=1)


def union_slots(masks: Masks) -> int:
    """The most positions one layer takes from the source over all variants (the size of the
    union, in the widest layer); 0 for no variant."""
    if not len(masks):
        return 0
    if isinstance(masks, FactoredMasks):             # one union per distinct set of variants a layer has
        cols = torch.unique(masks.layers.T, dim=0)  # [patterns, V]
        return max(int(masks.positions[c].any(dim=0).sum()) for c in cols)
    return int(masks.any(dim=0).sum(dim=1).max())


def most_slots(masks: Masks) -> int:
    """The most positions one variant takes from the source in one layer; 0 for no variant."""
    if not len(masks):
        return 0
    if isinstance(masks, FactoredMasks):
        return int((masks.positions.sum(dim=1) * masks.layers.any(dim=1)).max())
    return int(masks.view(torch.uint8).sum(dim=2, dtype=torch.int32).max())
