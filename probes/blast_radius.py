"""``blast_radius``: how far a field change spreads through the KV cache (docs/design.md §5).

Specification: ``docs/probes/blast_radius.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
import torch
from annotated_types import Len

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import PositiveFloat
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import clean_decisions, first_token_score, pair_status, screen_pair
from kvnotes.harness.stats import summarize_rows
from kvnotes.kv.capture import capture_attention
from kvnotes.records.figures import Bars, Curves
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, PairRow

METRICS = ("k_cos", "k_rel", "v_cos", "v_rel", "attn_rel")
EPS = 1e-12
#: A K/V vector whose norm is at most this share of its layer's RMS vector norm, in both runs, is
#: empty: it deviates by 0 (:func:`_kv_deviation`).
EMPTY = 1e-4


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/blast_radius.yaml``
    (the defaults are here; the YAML sets what differs; see the specification)."""

    thresholds: Annotated[list[PositiveFloat], Len(min_length=1)] = field(
        default_factory=lambda: [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])


def _kv_deviation(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine distance and relative L2 per position, averaged over heads.

    Both are undefined on a zero vector, so a head's vector that is *empty* in both runs (its norm
    at most :data:`EMPTY` times the layer's RMS vector norm in the old run, e.g. a head a planted
    model leaves unused) deviates by 0; cosine distance would otherwise call two identical zero
    keys maximally apart, and a relative L2 of two vanishing vectors reads rounding as change.

    Args:
        a, b: ``[kv_heads, T, head_dim]`` (old, new).

    Returns:
        two ``[T]`` tensors.
    """
    a, b = a.float(), b.float()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    floor = EMPTY * na.pow(2).mean().sqrt()
    empty = (na <= floor) & (nb <= floor)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=EPS).masked_fill(empty, 1.0)
    rel = ((b - a).norm(dim=-1) / na.clamp_min(EPS)).masked_fill(empty, 0.0)
    return (1 - cos).mean(0), rel.mean(0)


@torch.no_grad()
def deviation_maps(model, pair, capture=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The five layer x position maps of one pair, each ``[n_layers, T]`` with ``T = d + 1``, and
    the clean runs' decision-position log-probs ``[2, vocab]`` (old, new) from the same forwards.

    Args:
        capture: ``ids -> (layers, log-probs)`` (default :func:`kvnotes.kv.capture.capture_attention`
            of ``model``; ``run`` memoises it per prompt, :func:`kvnotes.harness.kit.per_prompt`)."""
    capture = capture or (lambda ids: capture_attention(model, ids))
    old, lp_old = capture(pair.old.ids)
    new, lp_new = capture(pair.new.ids)
    a, b = pair.field
    maps = {m: [] for m in METRICS}
    for lo, ln in zip(old, new, strict=True):
        k_cos, k_rel = _kv_deviation(lo.key[0], ln.key[0])
        v_cos, v_rel = _kv_deviation(lo.value[0], ln.value[0])
        k_fr, v_fr = lo.key.clone(), lo.value.clone()
        k_fr[:, :, a:b], v_fr[:, :, a:b] = ln.key[:, :, a:b], ln.value[:, :, a:b]
        ref = ln.output[0].flatten(1).float()
        fr = ln.recompute(key=k_fr, value=v_fr)[0].flatten(1).float()
        attn = (fr - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(EPS)
        for m, v in zip(METRICS, (k_cos, k_rel, v_cos, v_rel, attn)):
            maps[m].append(v.cpu())
    return {m: torch.stack(v) for m, v in maps.items()}, torch.stack([lp_old, lp_new])


def summarize_pair(maps: dict[str, torch.Tensor], field: tuple[int, int], decision: int,
                   thresholds: list[float]) -> dict:
    """Per-pair scalars and per-layer profiles over the downstream ``[b, d)``."""
    a, b = field
    out: dict = {"prefix_max_dev": max(float(maps[m][:, :a].max()) if a else 0.0 for m in METRICS)}
    for m in METRICS:
        cells = maps[m][:, b:decision]
        if cells.numel() == 0:
            continue
        flat = cells.flatten().numpy()
        pos_dev = cells.mean(0).numpy()
        out[f"{m}_p50"], out[f"{m}_p95"], out[f"{m}_max"] = np.quantile(flat, [0.5, 0.95]).tolist() + [float(flat.max())]
        out[f"{m}_share"] = [float((pos_dev >= t).mean()) for t in thresholds]
        out[f"{m}_layer_profile"] = cells.mean(1).tolist()
        out[f"{m}_field_mean"] = float(maps[m][:, a:b].mean())
    out["attn_rel_decision"] = maps["attn_rel"][:, decision].tolist()
    return out


def _share_aggregates(rows: list[dict], thresholds: list[float], seed: int) -> dict:
    """Per metric and threshold: per-family mean share of downstream positions above it, with CIs."""
    out = {}
    for m in METRICS:
        key = f"{m}_share"
        usable = [r for r in rows if key in r]
        out[m] = [summarize_rows([r | {"_v": r[key][i]} for r in usable], "_v", seed=seed)
                  for i in range(len(thresholds))]
    return out


class BlastRow(PairRow):
    """A pair's deviation summaries (``<metric>_<p50|p95|max>``, shares above thresholds)."""

    prefix_max_dev: float


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[BlastRow]
    thresholds: list[float]
    metrics: list[str]
    examples: dict[str, dict[str, Any]]


def run(ctx) -> dict:
    """Measure the blast radius of every aligned pair; see the specification."""
    cfg = ctx.cfg
    thresholds = [float(t) for t in cfg.thresholds]
    model = ctx.bundle.model
    rows, examples = [], {}
    capture = K.per_prompt(lambda ids: capture_attention(model, ids))     # a prompt shared by pairs: once
    for pair in K.units(ctx, ctx.pairs.pairs, "blast_radius"):
        with ctx.timer("deviation"):
            maps, lps = deviation_maps(model, pair, capture)
        if ctx.readout == "first_token":       # the capture forwards already hold the clean decisions
            status = pair_status(first_token_score(lps[0], pair), first_token_score(lps[1], pair), ctx.min_effect,
                                 ctx.flip_rule, clean_decisions(lps, pair))
        else:
            with ctx.timer("readout"):
                _, status = screen_pair(model, pair, ctx.readout, ctx.min_effect, ctx.flip_rule)
        row = pair_row(pair) | status | summarize_pair(maps, pair.field, pair.decision, thresholds)
        rows.append(row)
        fam = row["family"]
        # One example map per family for figures: its first flipping pair, else its first pair.
        if fam not in examples or (row["flips"] and not examples[fam]["flips"]):
            examples[fam] = {"pair": row["pair"], "flips": row["flips"], "field": list(pair.field),
                             "decision": pair.decision,
                             "tokens": ctx.bundle.tokenizer.convert_ids_to_tokens(pair.new.ids.tolist()),
                             "maps": {m: v.tolist() for m, v in maps.items()}}
    scalar_keys = [f"{m}_{s}" for m in METRICS for s in ("p50", "p95", "max")]
    flipping = [r for r in rows if r["flips"]]
    with ctx.timer("statistics"):
        aggregates = {
            "n_pairs": len(rows), "n_flip": len(flipping),
            "prefix_max_dev": max((r["prefix_max_dev"] for r in rows), default=None),
            "all": {k: summarize_rows(rows, k, seed=ctx.seed) for k in scalar_keys},
            "flipping": {k: summarize_rows(flipping, k, seed=ctx.seed) for k in scalar_keys} if flipping else {},
            "share_all": _share_aggregates(rows, thresholds, ctx.seed),
            "share_flipping": _share_aggregates(flipping, thresholds, ctx.seed) if flipping else {},
        }
    return {"rows": rows, "exclusions": ctx.pairs.exclusion_counts(), "excluded": ctx.pairs.excluded,
            "thresholds": thresholds, "metrics": list(METRICS), "examples": examples, "aggregates": aggregates}


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(headline="all/k_rel_p95/all",
    figures=(
    Curves("share-curves", "share_all/[k_rel,attn_rel]/#/@", "share of downstream positions whose layer-mean "
           "deviation exceeds a threshold (all pairs; mean, 95% interval)", "threshold on layer-mean relative L2",
           "share of positions", x="thresholds", xlog=True),
    Curves("share-curves-flipping", "share_flipping/[k_rel,attn_rel]/#/@", "share of downstream positions whose "
           "layer-mean deviation exceeds a threshold (flipping pairs; mean, 95% interval)",
           "threshold on layer-mean relative L2", "share of positions", x="thresholds", xlog=True),
    Bars("family-deviation", "all/[k_rel_p50,k_rel_p95,attn_rel_p50,attn_rel_p95]/@",
         "downstream deviation per family (median and 95th percentile over layer x position cells; "
         "mean over pairs, 95% interval)", "relative L2")))
