"""The one site vocabulary of every intervention (docs/design.md §4, §6).

A :class:`Site` names where an operation acts: a ``kind`` of activation, in some decoder
``layers``, at some token ``positions``, of some ``heads``. One vocabulary, two executors, by kind:

- ``"kv"``: the cached keys and values (per layer, position and KV head), executed in the attention
  backend: a patch from a source run (:mod:`kvnotes.kv.patch`), a knockout of the decision row's
  attention (:mod:`kvnotes.kv.knockout`), both as masks (:func:`kvnotes.kv.masks.site_masks`).
  ``layers`` None: every layer; ``heads`` None: every KV head.
- ``"resid_pre"``, ``"hook_z"``, ``"attn_out"``, ``"mlp_out"``, ``"resid_post"`` (TransformerLens hook
  names): a layer's residual stream or head output, executed by the engine
  (:class:`kvnotes.kv.engine.Engine`): set or add a value (:class:`kvnotes.kv.engine.Intervention`),
  or capture it. One layer; ``positions`` the absolute positions an intervention writes (a capture
  names none: it returns every fed position); ``heads`` (``hook_z`` only) the attention heads.

Operations: patch (from a source run), knock out, set, add.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

SiteKind = Literal["kv", "resid_pre", "hook_z", "attn_out", "mlp_out", "resid_post"]
#: Every kind of site (:data:`SiteKind`).
SITE_KINDS: tuple[str, ...] = get_args(SiteKind)
#: The kinds the engine executes, in their order inside one decoder layer (nnsight requires in-order access).
ENGINE_KINDS: tuple[str, ...] = ("resid_pre", "hook_z", "attn_out", "mlp_out", "resid_post")
#: The kinds whose sites may name heads (KV heads; attention heads).
HEAD_KINDS = ("kv", "hook_z")

#: Indices as a caller may give them: one int, any iterable of ints (a range, a list, a tensor), or None.
Indices: TypeAlias = "int | Iterable[int] | None"


def _indices(x) -> tuple[int, ...] | None:
    """None, or the indices as a tuple of ints (one int: a tuple of one)."""
    if x is None:
        return None
    try:
        return (operator.index(x),)                  # an int (numpy's and 0-d tensors' too)
    except TypeError:
        return tuple(operator.index(i) for i in x)


@dataclass(frozen=True, init=False)
class Site:
    """Where an operation acts (module docstring): ``kind`` in ``layers`` at ``positions`` of ``heads``.

    Attributes:
        kind: one of :data:`SITE_KINDS`.
        layers: decoder layers (one int: that layer; None: every layer, ``"kv"`` only).
        positions: absolute token positions (None: every position).
        heads: KV heads (``"kv"``) or attention heads (``"hook_z"``); None: every head.

    Raises:
        ValueError: an unknown kind, heads on a kind without heads, or an engine site that does
            not name exactly one layer.
    """

    kind: SiteKind
    layers: tuple[int, ...] | None
    positions: tuple[int, ...] | None
    heads: tuple[int, ...] | None

    def __init__(self, kind: SiteKind, layers: Indices = None, positions: Indices = None,
                 heads: Indices = None) -> None:
        if kind not in SITE_KINDS:
            raise ValueError(f"site kind must be one of {SITE_KINDS}, got {kind!r}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "layers", _indices(layers))
        object.__setattr__(self, "positions", _indices(positions))
        object.__setattr__(self, "heads", _indices(heads))
        if self.heads is not None and kind not in HEAD_KINDS:
            raise ValueError(f"heads= only applies to the sites of kinds {HEAD_KINDS}, not {kind!r}")
        if kind != "kv" and (self.layers is None or len(self.layers) != 1):
            raise ValueError(f"an engine site ({kind!r}) names exactly one layer, got {layers!r}")

    @property
    def layer(self) -> int:
        """The one layer of an engine site.

        Raises:
            ValueError: the site names every layer or several.
        """
        if self.layers is None or len(self.layers) != 1:
            raise ValueError(f"site {self} names no single layer")
        return self.layers[0]

    @property
    def at(self) -> "Site":
        """The site's kind and layers alone: where the engine hooks it (and the key of a capture)."""
        return Site(self.kind, self.layers)


def kv_site(positions: Iterable[int], layers: Iterable[int] | None = None,
            heads: Iterable[int] | None = None) -> Site:
    """A K/V site: ``positions`` in ``layers`` (None: every layer) of the KV ``heads`` (None: every head)."""
    return Site("kv", layers, positions, heads)
