"""``components``: per-layer attention vs MLP contributions to the conclusion direction at the
note position (DESIGN.md §6).

**Direction (choice).** The unembedding difference of the two candidates'
first tokens, ``u = W_U[cand_new] - W_U[cand_old]`` (fp32), unit-normalised ``û``. It is defined
per pair without fitting, so it cannot leak between selection and held-out instances; the
difference-of-means alternative is the fitted direction of :mod:`circuits.direction`.

**Contributions.** For every flipping pair the old and new prompts are run once each, capturing
what each sublayer *adds to the residual stream* (:mod:`circuits.engine` sites ``attn`` / ``mlp``:
after the post-attention / post-MLP norm on Gemma-2/3, the raw sublayer output elsewhere), the
embedding (``resid_in`` of layer 0, including Gemma's embedding scale) and the final pre-norm
residual (``resid`` of the last layer). Contribution of a component at position ``p`` =
``(x_new[p] - x_old[p]) · û`` in residual units. By construction
``embed + Σ_l (attn_l + mlp_l) == final`` (the record keeps the worst absolute error, a check).

**Note position.** The top note position is an offset ``d - p`` from the decision position,
chosen per family on the **selection** split as the downstream position with the highest mean
single-position KV-patch recovery (all layers, :func:`kvnotes.cache.position_masks`);
contributions are aggregated over **held-out** pairs at that offset, and at ``d`` itself (where
``û`` is the pre-norm logit-difference direction).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from circuits import _common as C
from circuits.engine import Engine, Site, make_engine
from kvnotes import cache as kvcache
from kvnotes.probing import flipping_pairs
from kvnotes.readout import PairRun, variant_scores
from kvnotes.stats import summarize


def residual_parts(engine: Engine, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual-stream decomposition of a full forward of ``ids`` (``[T]``).

    Returns:
        ``embed`` ``[T, D]``, ``attn`` / ``mlp`` ``[n_layers, T, D]`` (the residual additions),
        ``final`` ``[T, D]`` (last layer output, before the final norm); fp32.
    """
    L = engine.adapter.n_layers
    sites = [Site("resid_in", 0), Site("resid", L - 1)] + [Site(k, l) for l in range(L) for k in ("attn", "mlp")]
    acts = engine.run(ids, capture=sites).acts
    return {"embed": acts[Site("resid_in", 0)][0].float(),
            "attn": torch.stack([acts[Site("attn", l)][0] for l in range(L)]).float(),
            "mlp": torch.stack([acts[Site("mlp", l)][0] for l in range(L)]).float(),
            "final": acts[Site("resid", L - 1)][0].float()}


def decomposition_error(parts: dict[str, torch.Tensor]) -> float:
    """Max abs of ``embed + Σ_l (attn_l + mlp_l) - final`` over positions and dimensions."""
    total = parts["embed"] + parts["attn"].sum(0) + parts["mlp"].sum(0)
    return float((total - parts["final"]).abs().max())


def unembed_direction(model, engine: Engine, pair) -> torch.Tensor:
    """Unit vector ``(W_U[cand_new] - W_U[cand_old]) / ||·||``, ``[D]`` fp32 (first tokens)."""
    W = engine.adapter.module(model, "unembed").weight
    u = (W[pair.cand_new[0]] - W[pair.cand_old[0]]).float()
    return u / u.norm().clamp_min(torch.finfo(torch.float32).tiny)


def contributions(old: dict, new: dict, u: torch.Tensor, p: int) -> dict:
    """Projections of new-minus-old residual parts at position ``p`` onto ``u``: ``embed``,
    ``attn`` / ``mlp`` per layer (lists), ``final``, and ``sum_error`` (|embed + Σ - final|)."""
    e = float((new["embed"][p] - old["embed"][p]) @ u)
    a = ((new["attn"][:, p] - old["attn"][:, p]) @ u).tolist()
    m = ((new["mlp"][:, p] - old["mlp"][:, p]) @ u).tolist()
    f = float((new["final"][p] - old["final"][p]) @ u)
    return {"embed": e, "attn": a, "mlp": m, "final": f, "sum_error": abs(e + sum(a) + sum(m) - f)}


def position_map(model, run: PairRun, budget_bytes: int) -> np.ndarray:
    """Recovery of patching each downstream position alone (all layers) from the new cache:
    ``[d - b]``, index ``i`` = position ``b + i``."""
    pair = run.pair
    b, d = pair.field[1], pair.decision
    masks = kvcache.position_masks(len(run.old_cache.layers), d, [[p] for p in range(b, d)])
    s = variant_scores(model, pair, run.old_cache, run.new_cache, masks, "first_token", budget_bytes)
    return run.recovery(s).numpy()


def top_offset(maps: list[np.ndarray]) -> int | None:
    """Offset ``d - p`` (1 = last downstream position) with the highest mean recovery over the
    given position maps (each aligned so index ``i`` is position ``b + i``); None without maps."""
    if not maps:
        return None
    n = max(len(m) for m in maps)
    acc = np.full((len(maps), n), np.nan)
    for i, m in enumerate(maps):
        acc[i, : len(m)] = m[::-1]                 # column j = offset j + 1
    mean = np.nanmean(acc, axis=0)
    return int(np.nanargmax(mean)) + 1


def run(ctx) -> dict:
    """Attention vs MLP contributions per layer; see the module docstring."""
    C.require_first_token(ctx)
    cfg = ctx.cfg
    model = ctx.bundle.model
    engine = make_engine(model, cfg.get("backend", "nnsight"))
    L = engine.adapter.n_layers
    n_boot = int(cfg.n_boot)
    fs = flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = C.with_split(fs.rows, float(cfg.selection_fraction), ctx.seed)
    progress = bool(cfg.get("progress", True))
    # 1. the top note offset per family, from selection pairs only
    for run_, row in tqdm(list(zip(fs.runs, rows)), desc="components: position maps", disable=not progress):
        if row["split"] == "selection":
            with ctx.timer("position_map"):
                row["position_map"] = position_map(model, run_, ctx.budget_bytes).tolist()
    families = C.families_of(ctx, rows + fs.excluded)
    offsets = {}
    for f in families:
        src = [r for r in rows if r["split"] == "selection" and r["family"] == f]
        off = top_offset([np.asarray(r["position_map"]) for r in src])
        if off is not None:
            offsets[f] = {"offset": off, "pairs": [r["pair"] for r in src]}
    # 2. decomposition of every pair at the decision position and the family's note offset
    for i, (run_, row) in enumerate(tqdm(list(zip(fs.runs, rows)), desc="components: decompose", disable=not progress)):
        with ctx.timer("decompose"):
            old = residual_parts(engine, run_.pair.old.ids)
            new = residual_parts(engine, run_.pair.new.ids)
        u = unembed_direction(model, engine, run_.pair)
        row["decomposition_error"] = max(decomposition_error(old), decomposition_error(new))
        row["at_decision"] = contributions(old, new, u, run_.pair.decision)
        o = offsets.get(row["family"])
        b, d = row["field"][1], row["decision"]
        if o is not None and b <= d - o["offset"] < d:
            row["note_position"] = d - o["offset"]
            row["at_note"] = contributions(old, new, u, row["note_position"])
        fs.runs[i] = C.release(run_)
    held_rows = [r for r in rows if r["split"] == "heldout"]
    with ctx.timer("statistics"):
        def per_layer(rs, where, comp):
            rs = [r for r in rs if where in r]
            return [summarize([r[where][comp][l] for r in rs], [r["scenario"] for r in rs],
                              [r["instance"] for r in rs], n_boot, ctx.seed) for l in range(L)]

        def scalar(rs, where, comp):
            rs = [r for r in rs if where in r]
            return summarize([r[where][comp] for r in rs], [r["scenario"] for r in rs], [r["instance"] for r in rs],
                             n_boot, ctx.seed)

        contrib = {}
        for where in ("at_note", "at_decision"):
            contrib[where] = {}
            for f in families + ["all"]:
                rs = [r for r in held_rows if f == "all" or r["family"] == f]
                contrib[where][f] = {"attn": per_layer(rs, where, "attn"), "mlp": per_layer(rs, where, "mlp"),
                                     "embed": scalar(rs, where, "embed"), "final": scalar(rs, where, "final")}
    checks = {"max_decomposition_error": max((r["decomposition_error"] for r in rows), default=None),
              "max_projection_sum_error": max((r[w]["sum_error"] for r in rows for w in ("at_note", "at_decision")
                                               if w in r), default=None),
              "offset_pairs_in_heldout": sum(p in {r["pair"] for r in held_rows}
                                             for o in offsets.values() for p in o["pairs"])}
    aggregates = {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows),
                  "n_selection": len(rows) - len(held_rows), "n_heldout": len(held_rows), "families": families,
                  "n_layers": L, "direction": "unembedding difference W_U[cand_new] - W_U[cand_old], unit norm",
                  "note_offsets": offsets, "contributions": contrib, "checks": checks,
                  "post_norms": engine.adapter.has_post_norms,
                  "per_family": C.no_circuit_note(families, rows, fs.excluded),
                  "exclusions_by_family": C.exclusions_by_family(fs.excluded, families)}
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": engine.backend,
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates}
