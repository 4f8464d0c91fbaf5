"""Shared steps of the circuit probes: readout from engine log-probs, prefix caches for resumed
prefills, the selection / held-out split of flipping pairs, and per-family summaries."""

from __future__ import annotations


import torch
from transformers import DynamicCache

from kvnotes import cache as kvcache
from kvnotes.errors import KvnotesError
from kvnotes.probing import (exclusions_by_family, families_of, pair_rng, split_instances,  # noqa: F401
                             summaries_by_family)


def require_first_token(ctx) -> None:
    """Circuit probes read the first-token score (docs/design.md §3) from the engine's decision-position
    log-probs.

    Raises:
        KvnotesError: ``readout`` is not ``first_token``.
    """
    if ctx.readout != "first_token":
        raise KvnotesError(f"circuit probes use the first-token readout; got readout={ctx.readout}")


def scores(logprobs: torch.Tensor, pair) -> torch.Tensor:
    """First-token scores ``log p(cand_new) - log p(cand_old)`` (nats) from decision-position
    log-probs ``[V, vocab]`` or ``[V, n, vocab]`` (last position used). Returns ``[V]`` fp32."""
    lp = logprobs[:, -1] if logprobs.dim() == 3 else logprobs
    return (lp[:, pair.cand_new[0]] - lp[:, pair.cand_old[0]]).float().cpu()


def prefix_cache(model, cache: DynamicCache | None, ids: torch.Tensor, p: int) -> DynamicCache:
    """A cache over positions ``[0, p)`` of the prompt ``ids``: a sliced view of ``cache`` (which
    holds ``[0, q)``, ``q >= p``) when every layer still holds slots ``0..p-1`` (no filled sliding
    window), else a fresh prefill of ``ids[:p]``. Forwards on the result leave ``cache`` unchanged.

    Args:
        ids: ``[T]`` prompt token ids.
        p: prefix length, ``1 <= p``.
    """
    if cache is not None and kvcache.seq_length(cache) >= p:
        keys, values = [], []
        for layer in cache.layers:
            pos = kvcache.slot_positions(layer)
            if len(pos) < p or int(pos[0]) != 0:
                break
            keys.append(layer.keys[:, :, :p])
            values.append(layer.values[:, :, :p])
        else:
            return kvcache.cache_from_tensors(model.config, keys, values, p)
    return kvcache.prefill(model, ids[:p])


def with_split(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], set[str], set[str]]:
    """Tag rows with ``split`` = ``"selection"`` / ``"heldout"`` by instance
    (:func:`kvnotes.probing.split_instances`). Returns (rows, selection ids, held-out ids)."""
    sel, held = split_instances(rows, fraction, seed)
    return [r | {"split": "selection" if r["instance"] in sel else "heldout"} for r in rows], sel, held


def by_family(rows: list[dict], key: str, flipped_key: str | None, families: list[str], n_boot: int,
              seed: int) -> dict:
    """:func:`kvnotes.probing.summaries_by_family` of ``row[key]`` (flip share from ``row[flipped_key]``)."""
    return summaries_by_family(rows, lambda r: r[key], (lambda r: r[flipped_key]) if flipped_key else None,
                               families, n_boot, seed)


def no_circuit_note(families: list[str], rows: list[dict], excluded: list[dict]) -> dict:
    """Per family: ``"no flipping pairs: no circuit to find"`` where a family has no flipping pair
    (e.g. policy_gate on a 135M model), else the number of flipping pairs."""
    out = {}
    for f in families:
        n = sum(r["family"] == f for r in rows)
        out[f] = n if n else f"no flipping pairs ({sum(r.get('family') == f for r in excluded)} excluded): no circuit to find"
    return out
