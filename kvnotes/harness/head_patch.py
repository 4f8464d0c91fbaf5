"""Activation patching of attention-head outputs (TransformerLens ``hook_z``, the ``o_proj`` input)
from a pair's clean new run into its old run, at the decision position (read heads) or the note
positions (write heads), through a :class:`kvnotes.kv.engine.Engine` (docs/design.md §6).

Used by the head-patching circuit and its benchmark (:mod:`kvnotes.bench.circuits`). Head outputs are not K/V sites: they are patched after attention,
as engine interventions (docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvnotes.harness.readout import PairRun, first_token_scores
from kvnotes.kv.engine import Engine, Intervention
from kvnotes.kv.sites import Site


#: Where head outputs are patched: at the decision position (read) or the note positions (write).
HEAD_SITES = ("read", "write")


def head_outputs(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """Per-head outputs of a full forward of ``ids`` (``[T]``).

    Returns:
        ``[n_layers, T, n_heads, head_dim]`` (the o_proj input, model dtype).
    """
    L = engine.adapter.n_layers
    out = engine.run(ids, capture=[Site("hook_z", l) for l in range(L)])
    return torch.stack([out.acts[Site("hook_z", l)][0] for l in range(L)])


def set_masks(sets: Sequence[Sequence[tuple[int, int]]], n_layers: int, n_heads: int) -> torch.Tensor:
    """Bool ``[V, n_layers, n_heads]``: variant ``v`` patches the (layer, head) pairs of ``sets[v]``.

    Raises:
        IndexError: a head or layer out of range.
    """
    m = torch.zeros(len(sets), n_layers, n_heads, dtype=torch.bool)
    for v, s in enumerate(sets):
        for l, h in s:
            m[v, l, h] = True
    return m


def clean_residuals(engine: Engine, run: PairRun, prefix) -> torch.Tensor:
    """The old run's residual stream entering every layer at the write positions ``[b, d]``
    (resumed on ``prefix``, the clean old cache ``[0, b)``): ``[n_layers, d - b + 1, hidden]``.
    A write variant whose heads all lie in layers ``>= l`` starts from ``[l]`` (:meth:`Engine.run`
    ``resume``): below ``l`` it is the clean run."""
    pair = run.pair
    b, d = pair.field[1], pair.decision
    L = engine.adapter.n_layers
    out = engine.run(pair.old.ids[b: d + 1], capture=[Site("resid_pre", l) for l in range(L)], cache=prefix, start=b)
    return torch.stack([out.acts[Site("resid_pre", l)][0] for l in range(L)])


def patched_scores(engine: Engine, run: PairRun, source: torch.Tensor, masks: torch.Tensor, mode: str,
                   prefix, chunk: int, resid: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of head-patch variants of the old run, ``chunk`` variants per forward.

    Args:
        source: ``[n_layers, T, n_heads, head_dim]`` new-run head outputs (:func:`head_outputs`).
        masks: bool ``[V, n_layers, n_heads]`` (:func:`set_masks`).
        mode: ``"read"`` (positions ``[d]``, prefix = old cache ``[0, d)``) or ``"write"``
            (positions ``[b, d)``, prefix = old cache ``[0, b)``).
        prefix: the clean old prefix cache of the mode (batch 1; not modified).
        resid: write mode: :func:`clean_residuals`; variants are then run in order of their
            lowest patched layer and each chunk starts at its lowest layer (the layers below are
            the clean run), else every chunk runs every layer.

    Returns:
        ``[V]`` fp32 scores (nats), in the order of ``masks``.

    Raises:
        ValueError: unknown mode.
    """
    pair = run.pair
    d, b = pair.decision, pair.field[1]
    if mode not in HEAD_SITES:
        raise ValueError(f"mode must be one of {HEAD_SITES}")
    start = d if mode == "read" else b
    positions = list(range(start, d)) if mode == "write" else [d]
    ids = pair.old.ids[start: d + 1]
    P = len(positions)
    L = masks.shape[1]
    lowest = torch.where(masks.any(2), torch.arange(L), L).min(1).values          # [V]; L: patches nothing
    order = torch.argsort(lowest, stable=True) if resid is not None else torch.arange(masks.shape[0])
    out = torch.empty(masks.shape[0])
    for s in range(0, masks.shape[0], chunk):
        idx = order[s: s + chunk]
        m = masks[idx]
        ivs = [Intervention(Site("hook_z", l, positions), source[l, positions][None],
                            where=m[:, l][:, None, :].expand(-1, P, -1))
               for l in range(m.shape[1]) if bool(m[:, l].any())]
        l0 = min(int(lowest[idx].min()), L - 1)
        resume = (l0, resid[l0][None]) if resid is not None and l0 > 0 else None
        lp = engine.run(ids[None].expand(m.shape[0], -1), ivs, cache=prefix, start=start, resume=resume).logprobs
        out[idx] = first_token_scores(lp[:, -1], pair).float().cpu()
    return out


def single_head_map(engine: Engine, run: PairRun, source: torch.Tensor, mode: str, prefix, chunk: int,
                    resid: torch.Tensor | None = None) -> np.ndarray:
    """Recovery of patching each head alone: ``[n_layers, n_heads]`` (``resid``: see
    :func:`patched_scores`)."""
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    sets = [[(l, h)] for l in range(L) for h in range(H)]
    s = patched_scores(engine, run, source, set_masks(sets, L, H), mode, prefix, chunk, resid)
    return run.recovery(s).view(L, H).numpy()
