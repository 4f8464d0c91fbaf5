"""Patch and knockout masks: which K/V sites (layer, KV head, position) each variant acts on
(docs/design.md §4, §5).

A mask is a bool ``[V, n_layers, T]`` tensor (every KV head of a layer), or a :class:`FactoredMasks`,
which may also name the KV heads per layer (a head patch). In a **patch** variant ``v`` takes layer
``l``'s key/value at position ``p`` from the source run where it is true (:mod:`kvnotes.kv.patch`); in a
**knockout** the decision query cannot attend to that key (:mod:`kvnotes.kv.knockout`). Most
variants act on a set of positions in a set of layers, so a mask is often the product of the two;
:class:`FactoredMasks` keeps that product without materialising it. The exact single-position map of an 8,251-token prompt on a 36-layer model
is about 8,000 variants: its dense mask takes 2.4 GB, and a reduction over it (the union of the
substituted slots) took seconds; the factored one takes 66 MB.

The functions below read either kind, so the readout (:mod:`kvnotes.kv.patch`,
:func:`kvnotes.kv.cache.build_variants`) and the knockout hooks take both: position patches, head
patches and knockouts are written in one vocabulary (:func:`site_masks`) and executed by the
:mod:`kvnotes.kv` layer. A probe that names many position sets collects them in a
:class:`VariantPlan`, which deduplicates them and gives one factored mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvnotes.kv.sites import Site, kv_site


@dataclass(frozen=True)
class FactoredMasks:
    """Masks that are products: variant ``v`` acts on position ``p`` of KV head ``h`` in layer ``l``
    iff ``positions[v, p]`` and ``layers[v, l]`` (and ``heads[v, l, h]`` when ``heads`` is given).

    Attributes:
        positions: bool ``[V, T]``.
        layers: bool ``[V, n_layers]``.
        heads: None (every KV head), or bool ``[V, n_layers, kv_heads]``: the KV heads each variant
            acts on in each layer (a head patch or head knockout; GQA: a KV head serves its group of
            query heads).
    """

    positions: torch.Tensor
    layers: torch.Tensor
    heads: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(V, n_layers, T)``, the dense mask's shape."""
        return (self.positions.shape[0], self.layers.shape[1], self.positions.shape[1])

    def __len__(self) -> int:
        return self.positions.shape[0]

    def __getitem__(self, idx) -> FactoredMasks:
        """The variants ``idx`` (an index tensor, slice or bool tensor over ``V``)."""
        return FactoredMasks(self.positions[idx], self.layers[idx], None if self.heads is None else self.heads[idx])

    def to(self, device) -> FactoredMasks:
        return FactoredMasks(self.positions.to(device), self.layers.to(device),
                             None if self.heads is None else self.heads.to(device))

    def dense(self) -> torch.Tensor:
        """The bool ``[V, n_layers, T]`` mask.

        Raises:
            ValueError: the masks name KV heads (a dense mask acts on every head).
        """
        if self.heads is not None:
            raise ValueError("head masks have no dense [V, n_layers, T] form (it would act on every KV head)")
        return self.layers[:, :, None] & self.positions[:, None, :]


#: A dense bool ``[V, n_layers, T]`` mask or its factored form.
Masks = torch.Tensor | FactoredMasks


def layer_mask(masks: Masks, layer: int) -> torch.Tensor:
    """Bool ``[V, T]``: the positions each variant acts on in ``layer``."""
    if isinstance(masks, FactoredMasks):
        return masks.positions & masks.layers[:, layer: layer + 1]
    return masks[:, layer]


def layer_heads(masks: Masks, layer: int) -> torch.Tensor | None:
    """Bool ``[V, kv_heads]``: the KV heads each variant acts on in ``layer``; None for every head
    (a dense mask, or factored masks without ``heads``)."""
    if isinstance(masks, FactoredMasks) and masks.heads is not None:
        return masks.heads[:, layer]
    return None


def head_layer_mask(masks: Masks, layer: int, kv_heads: int) -> torch.Tensor:
    """Bool ``[V, kv_heads, T]``: the positions each variant acts on in each KV head of ``layer``."""
    m, h = layer_mask(masks, layer), layer_heads(masks, layer)
    if h is None:
        return m[:, None, :].expand(-1, kv_heads, -1)
    if h.shape[1] != kv_heads:
        raise ValueError(f"a head mask of {h.shape[1]} KV heads for a layer with {kv_heads}")
    return m[:, None, :] & h[:, :, None]


def query_heads(per_kv_head: torch.Tensor, heads: int, dim: int = 1) -> torch.Tensor:
    """A per-KV-head tensor repeated to the ``heads`` query heads along ``dim`` (GQA: KV head ``j``
    serves query heads ``j g .. (j + 1) g - 1``, ``g = heads / kv_heads``, as transformers'
    ``repeat_kv``)."""
    return per_kv_head.repeat_interleave(heads // per_kv_head.shape[dim], dim=dim)


def layer_key(masks: Masks, layer: int) -> torch.Tensor:
    """A tensor whose equality for two layers means equal :func:`head_layer_mask`: the layer's column
    of a factored mask (bool ``[V]``, with its head column ``[V, 1 + kv_heads]``; no ``[V, T]``
    tensor built), the dense mask's slice."""
    if isinstance(masks, FactoredMasks):
        col = masks.layers[:, layer: layer + 1]
        return col[:, 0] if masks.heads is None else torch.cat([col, masks.heads[:, layer]], 1)
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


def site_masks(n_layers: int, T: int, sites: Sequence[Site | Sequence], kv_heads: int | None = None) -> FactoredMasks:
    """Masks of K/V sites, one variant per entry of ``sites``: a :class:`kvnotes.kv.sites.Site` of
    kind ``"kv"`` (:func:`kvnotes.kv.sites.kv_site`) or a tuple ``(positions, layers, heads)``, the
    positions ``[0, T)`` it acts on in ``layers`` (None: every layer) and, per those layers, the KV
    ``heads`` (None: every head). A position patch names no heads; a head patch names them; the same
    masks are a knockout where the decision row's attention reads them (:mod:`kvnotes.kv.knockout`).

    Args:
        kv_heads: KV heads per layer; needed when any site names heads.

    Returns:
        :class:`FactoredMasks` ``[V, n_layers, T]`` (``heads`` set when any site names heads).

    Raises:
        ValueError: a site of another kind (residual and head-output sites run in the engine), a
            site that names heads without ``kv_heads``, or a position, layer or head out of range
            (negative indices included: they would wrap around).
    """
    kv_sites = [s if isinstance(s, Site) else kv_site(*s) for s in sites]
    for v, site in enumerate(kv_sites):
        if site.kind != "kv":
            raise ValueError(f"site {v} is a {site.kind!r} site: only K/V sites are masks (the engine runs the others)")
        if site.positions is None:
            raise ValueError(f"site {v}: a K/V site names its positions")
        for what, idx, n in (("position", site.positions, T), ("layer", site.layers, n_layers),
                             ("KV head", site.heads, kv_heads)):
            bad = [int(i) for i in (idx if idx is not None else ()) if n is not None and not 0 <= int(i) < n]
            if bad:
                raise ValueError(f"site {v}: {what} {bad[0]} outside [0, {n})")
    positions = torch.zeros(len(kv_sites), T, dtype=torch.bool)
    layers = torch.zeros(len(kv_sites), n_layers, dtype=torch.bool)
    named = any(site.heads is not None for site in kv_sites)
    if named and kv_heads is None:
        raise ValueError("sites that name KV heads need kv_heads")
    heads = torch.ones(len(kv_sites), n_layers, kv_heads, dtype=torch.bool) if named else None
    for v, site in enumerate(kv_sites):
        pos, lay, hs = site.positions or (), site.layers, site.heads
        positions[v, list(pos)] = True
        layers[v, list(range(n_layers)) if lay is None else list(lay)] = True
        if hs is not None:
            heads[v] = False
            heads[v][:, list(hs)] = True
    return FactoredMasks(positions, layers, heads)


class VariantPlan:
    """Position-patch variants of one pair, deduplicated by mask.

    ``add(positions, layers)`` registers a variant (all layers when ``layers`` is None) and
    returns its index into the unique masks; :meth:`masks` gives the unique masks, factored
    (:class:`kvnotes.kv.masks.FactoredMasks`: the single-position map of an 8k-token prompt is
    thousands of variants, gigabytes as a dense mask).
    """

    def __init__(self, n_layers: int, d: int) -> None:
        self.n_layers, self.d = n_layers, d
        self.index: dict[tuple, int] = {}
        self.specs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def add(self, positions: Sequence[int], layers: Sequence[int] | None = None) -> int:
        layer_key = tuple(range(self.n_layers)) if layers is None else tuple(layers)
        key = (tuple(sorted(int(p) for p in positions)), layer_key)
        if key not in self.index:
            self.index[key] = len(self.specs)
            self.specs.append(key)
        return self.index[key]

    def masks(self) -> FactoredMasks:
        positions = torch.zeros(len(self.specs), self.d, dtype=torch.bool)
        layers = torch.zeros(len(self.specs), self.n_layers, dtype=torch.bool)
        for v, (pos, lay) in enumerate(self.specs):
            positions[v, list(pos)] = True
            layers[v, list(lay)] = True
        return FactoredMasks(positions, layers)
