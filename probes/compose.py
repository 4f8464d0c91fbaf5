"""``compose``: does a prompt composed from precompiled chunks decide like its full prefill (paper §5)?

Prompts use the chunked layout of :mod:`scenarios.chunks` (rule and filler precompiled as chunks;
field, request and decision live). For every token-aligned pair, both prompts (old and new field
value, batched) are run

- as a **full prefill** (the reference; same tokens, same layout), and
- **composed** (:func:`kvnotes.compose.compose`): the live prefix prefilled, each chunk precompiled
  in isolation — behind no sink, behind the prompt's first token (``bos``), or behind the real live
  prefix (``prefix``) — its keys rotated to their positions (``rotate``) or left where they were
  precompiled (``no_rotate``, the control), the first ``s`` tokens of each chunk recomputed against
  the real prefix (seam repair, ``s`` in ``seams``), and the live tokens computed on top.

Per variant ``<rotate|no_rotate>/sink=<sink>/seam=<s>``, at the decision position:

- ``decision_agreement``: share of prompts whose full prefill *owns* its decision (vocabulary top-1
  is the expected candidate's first token) where the composed run's vocabulary top-1 is the same
  token (Wilson CI);
- ``top1_agreement``: the same over every prompt;
- ``kl``: KL(full || composed) in nats (mean of the pair's two prompts; cluster-bootstrap CI);
- ``recovery`` on pairs that flip (:func:`kvnotes.probing.flipping_pairs` on the chunked layout):
  ``(s_composed_new - s_full_old) / (s_full_new - s_full_old)``, and the share whose composed new
  run takes the new decision;
- ``logit_cosine``: reported only for comparability with the paper (high for the control too).

Check: seam repair over whole chunks recomputes them, so it must give the full prefill's logits
(``checks.max_abs_logit_diff_full_seam``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from kvnotes import compose as kvcompose
from kvnotes.errors import KvnotesError
from kvnotes.pairs import pair_row
from kvnotes.probing import exclusions_by_family, families_of, flipping_pairs, summaries_by_family
from kvnotes.stats import proportion
from scenarios.chunks import chunked_pairs

SINKS = ("none", "bos", "prefix")


def variant_name(rotate: bool, sink: str, seam: int) -> str:
    return f"{'rotate' if rotate else 'no_rotate'}/sink={sink}/seam={seam}"


def prompt_parts(ids: torch.Tensor, spans, chunks: list) -> list:
    """Interleave live token slices of ``ids`` (``[B, T]``) with chunks at ``spans``, in order."""
    parts, pos = [], 0
    for (a, b), chunk in zip(spans, chunks, strict=True):
        if a > pos:
            parts.append(ids[:, pos:a])
        parts.append(chunk)
        pos = b
    parts.append(ids[:, pos:])
    return parts


def sink_ids(ids: torch.Tensor, sink: str, first_chunk: int) -> torch.Tensor | None:
    """The sink tokens a chunk is precompiled behind: none, the prompt's first token, or the whole
    live prefix before the first chunk.

    Raises:
        KvnotesError: unknown sink name.
    """
    if sink == "none":
        return None
    if sink == "bos":
        return ids[:1]
    if sink == "prefix":
        return ids[:first_chunk]
    raise KvnotesError(f"unknown compose sink '{sink}' (known: {', '.join(SINKS)})")


def score(logits: torch.Tensor, cand_old: int, cand_new: int) -> torch.Tensor:
    """``log p(cand_new) - log p(cand_old)`` per row of fp32 logits ``[B, vocab]`` (nats)."""
    lp = torch.log_softmax(logits, -1)
    return lp[:, cand_new] - lp[:, cand_old]


@torch.no_grad()
def compose_pair(model, pair, variants: list[tuple[bool, str, int]]) -> dict:
    """Full prefill and every composed variant of one chunked pair, all variants' old and new prompts
    in one batched :func:`kvnotes.compose.compose`.

    Returns:
        row columns: full-run decisions (``full_top1``, ``owned``, ``s_full``; lists [old, new]),
        ``variants``: name -> per-prompt ``kl``, ``top1_agree``, ``logit_cosine``, ``s`` (lists
        [old, new]), and ``max_abs_logit_diff_full_seam`` (the check).
    """
    ids = torch.stack([pair.old.ids, pair.new.ids])
    co, cn = pair.cand_old[0], pair.cand_new[0]
    full = kvcompose.full_logits(model, ids)
    top1 = full.argmax(-1).tolist()
    out = {"full_top1": top1, "owned": [top1[0] == co, top1[1] == cn], "s_full": score(full, co, cn).tolist(),
           "variants": {}}
    first = pair.chunks[0][0]
    chunk_ids = [pair.old.ids[a:b] for a, b in pair.chunks]
    compiled = {sink: [kvcompose.precompile(model, c, sink_ids(pair.old.ids, sink, first)) for c in chunk_ids]
                for sink in dict.fromkeys(v[1] for v in variants)}
    # every variant's old and new prompt in one batch: rows 2i, 2i + 1 are variant i
    per_row = [(rot, sink, seam) for rot, sink, seam in variants for _ in (0, 1)]
    chunk_parts = [[compiled[sink][k] for _, sink, _ in per_row] for k in range(len(chunk_ids))]
    _, logits = kvcompose.compose(model, prompt_parts(ids.repeat(len(variants), 1), pair.chunks, chunk_parts),
                                  [r for r, _, _ in per_row], [s for _, _, s in per_row])
    m = kvcompose.decision_metrics(full.repeat(len(variants), 1), logits)
    sc = score(logits, co, cn)
    for i, v in enumerate(variants):
        sl = slice(2 * i, 2 * i + 2)
        out["variants"][variant_name(*v)] = {
            "kl": m["kl"][sl].tolist(), "top1_agree": m["top1_agree"][sl].tolist(),
            "logit_cosine": m["logit_cosine"][sl].tolist(), "s": sc[sl].tolist()}
    whole = max(b - a for a, b in pair.chunks)
    _, logits = kvcompose.compose(model, prompt_parts(ids, pair.chunks, compiled[variants[0][1]]), True, whole)
    out["max_abs_logit_diff_full_seam"] = float((logits - full).abs().max())
    return out


def _prompt_share(rows, name: str, owned_only: bool) -> dict:
    k = n = 0
    for r in rows:
        for i in (0, 1):
            if owned_only and not r["owned"][i]:
                continue
            n += 1
            k += bool(r["variants"][name]["top1_agree"][i])
    return proportion(k, n)


def aggregate(rows: list[dict], names: list[str], families: list[str], n_boot: int, seed: int) -> dict:
    """Per variant and family (and ``all``): decision agreement on owned prompts, top-1 agreement,
    KL and logit cosine (pair means), recovery on flipping pairs (see the module docstring)."""
    out = {}
    for v in names:
        groups = {g: rows if g == "all" else [r for r in rows if r["family"] == g] for g in ["all", *families]}
        out[v] = {
            "decision_agreement": {g: _prompt_share(rs, v, True) for g, rs in groups.items()},
            "top1_agreement": {g: _prompt_share(rs, v, False) for g, rs in groups.items()},
            "kl": summaries_by_family(rows, lambda r, v=v: sum(r["variants"][v]["kl"]) / 2, None, families,
                                      n_boot, seed),
            "logit_cosine": summaries_by_family(rows, lambda r, v=v: sum(r["variants"][v]["logit_cosine"]) / 2, None,
                                                families, n_boot, seed),
            "recovery": summaries_by_family(
                rows, lambda r, v=v: r["variants"][v]["r"] if r["flips"] else None,
                lambda r, v=v: (r["variants"][v]["s"][1] > 0) == (r["s_full"][1] > 0), families, n_boot, seed),
        }
    return out


def run(ctx) -> dict:
    """Composed vs full prefill for every chunked pair and variant; see the module docstring."""
    cfg = ctx.cfg
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    n_boot = int(cfg.get("n_boot", 2000))
    sinks = list(cfg.get("sinks", ["none", "bos"]))
    seams = [int(s) for s in cfg.get("seams", [0, 1, 2, 4, 8])]
    for s in sinks:
        if s not in SINKS:
            raise KvnotesError(f"unknown compose sink '{s}' (known: {', '.join(SINKS)})")
    variants = [(rot, sink, seam) for rot in (True, False) for sink in sinks for seam in seams]
    names = [variant_name(*v) for v in variants]
    tk = cfg.get("template_kwargs")
    tk = OmegaConf.to_container(tk) if tk is not None and not isinstance(tk, dict) else (tk or {})
    with ctx.timer("chunked_pairs"):
        cpairs = chunked_pairs(tok, ctx.scenario_cfg, tk)
    if not cpairs.pairs:
        raise KvnotesError(f"no chunked token-aligned pairs (excluded: {cpairs.exclusion_counts()})")
    fs = flipping_pairs(replace(ctx, pairs=cpairs), keep_caches=False)
    flips = {r["pair"] for r in fs.rows}
    rows = []
    for pair in tqdm(cpairs.pairs, desc="compose", disable=not cfg.get("progress", True)):
        with ctx.timer("variants"):
            res = compose_pair(model, pair, variants)
        row = pair_row(pair) | {"chunks": [list(c) for c in pair.chunks], "chunk_names": list(pair.chunk_names),
                                "standalone": list(pair.standalone), "flips": pair.spec.id in flips} | res
        effect = row["s_full"][1] - row["s_full"][0]
        for v in row["variants"].values():
            v["r"] = (v["s"][1] - row["s_full"][0]) / effect if effect else None
        rows.append(row)
    families = families_of(replace(ctx, pairs=cpairs), rows)
    with ctx.timer("statistics"):
        agg = aggregate(rows, names, families, n_boot, ctx.seed)
    checks = {"max_abs_logit_diff_full_seam": max(r["max_abs_logit_diff_full_seam"] for r in rows),
              "chunks_tokenised_standalone": sum(all(r["standalone"]) for r in rows), "n_rows": len(rows)}
    aggregates = {"n_pairs": len(cpairs.pairs) + len(cpairs.excluded), "n_aligned": len(cpairs.pairs),
                  "n_flip": len(flips), "n_owned_prompts": sum(sum(r["owned"]) for r in rows),
                  "families": families, "sinks": sinks, "seams": seams, "variants": agg, "checks": checks,
                  "exclusions_by_family": exclusions_by_family(fs.excluded, families)}
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "variant_names": names,
            "aggregates": aggregates}
