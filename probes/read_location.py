"""``read_location``: where the decision query reads, and what a knockout of that read does
(docs/design.md §3, §5).

**Attention masses.** For each token-aligned pair and each run (old, new), the decision token is
fed at position ``d`` on the run's prefix cache ``[0, d)``. Inside :func:`kvnotes.capture.attention_hook`
the decision row's attention probabilities are computed with the model's own eager attention
function (its scaling, logit soft-capping and GQA grouping; the mask the model built, which carries
the sliding window), called with keyword arguments, in fp32. Mean over heads, per layer, the
probability mass is summed over five disjoint key groups that cover every visible key:

- ``sinks``: positions ``[0, n_sinks)`` (the first token(s), e.g. BOS; clipped at the field start);
- ``prefix``: the rest of the prefix before the field, ``[n_sinks, a)``;
- ``field``: ``[a, b)``;  ``downstream``: ``[b, d)``;  ``decision``: the decision token itself.

Masses sum to 1 per layer (keys outside a sliding window carry no mass). As a check, the eager
output is compared with the output of the implementation the model actually ran (``recon_err``).

**Knockout.** For a key group (or a union of groups) and a layer band, the attention mask that the
decision query (row ``d`` only) sees is changed inside the hook so that it cannot attend to those
keys in the band's layers (sdpa and eager implementations); every other row and layer is untouched
(with ``readout=full`` the teacher-forced continuation tokens read the cache unmodified). All
variants of a pair run batched over an expanded view of the prefix cache, chunked to the memory
budget. Reported per run: the score change ``delta = s_knock - s_clean`` (nats) and
``delta_toward_other`` (the same, signed so that positive moves towards the other run's clean
score). A knockout can change the decision merely by destroying the readout, so each
(pair, run, variant) is classified:

- ``collapsed`` (readout destroyed): both candidates' first-token log-probs fall by at least
  ``collapse.drop_nats`` below their clean values, OR neither candidate is in the knocked
  distribution's top-``collapse.top_k`` while at least one was in the clean top-k;
- ``decision_changed``: the sign of the score differs from the clean run's;
- ``flip_intact``: decision changed and not collapsed — the only case that counts as a flip.

Aggregates are per family (and ``all``), over flipping pairs and over all aligned pairs, with
cluster-bootstrap CIs (scenarios, then instances; docs/design.md §8).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from kvnotes import cache as kvcache
from kvnotes.capture import attention_hook
from kvnotes.errors import KvnotesError
from kvnotes.pairs import pair_row
from kvnotes.readout import run_pair
from kvnotes.stats import bootstrap_weights, proportion, summarize

GROUPS = ("sinks", "prefix", "field", "downstream", "decision")
KNOCKABLE = ("sinks", "prefix", "field", "downstream")
RUNS = ("old", "new")
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")


# --------------------------------------------------------------------------------------------
# key groups and layer bands


def key_groups(field: tuple[int, int], decision: int, n_sinks: int) -> dict[str, tuple[int, int]]:
    """Disjoint position ranges ``[start, end)`` of the key groups, covering ``[0, d]``.

    Args:
        field: token span ``(a, b)`` of the field.
        decision: decision position ``d``.
        n_sinks: number of leading positions counted as attention sinks (clipped at ``a``).

    Raises:
        ValueError: ``n_sinks < 0`` or a span outside ``[0, d)``.
    """
    a, b = field
    if n_sinks < 0:
        raise ValueError(f"n_sinks must be >= 0, got {n_sinks}")
    if not 0 <= a <= b <= decision:
        raise ValueError(f"field {field} is not inside [0, {decision})")
    s = min(n_sinks, a)
    return {"sinks": (0, s), "prefix": (s, a), "field": (a, b), "downstream": (b, decision),
            "decision": (decision, decision + 1)}


def layer_bands(n_layers: int, bands, units: str = "fraction") -> list[dict]:
    """Resolve configured bands to layer ranges.

    Args:
        bands: list of ``[lo, hi]``; with ``units="fraction"`` fractions of depth (layer range
            ``[floor(lo * L + 0.5), floor(hi * L + 0.5))``), with ``units="layer"`` layer indices
            ``[lo, hi)``.

    Returns:
        ``[{"name": "L<lo>-<hi-1>", "layers": [lo, hi)}]``.

    Raises:
        ValueError: unknown units or an empty / out-of-range band.
    """
    out = []
    for lo, hi in bands:
        if units == "fraction":
            l0, l1 = math.floor(float(lo) * n_layers + 0.5), math.floor(float(hi) * n_layers + 0.5)
        elif units == "layer":
            l0, l1 = int(lo), int(hi)
        else:
            raise ValueError(f"band units must be 'fraction' or 'layer', got {units!r}")
        if not 0 <= l0 < l1 <= n_layers:
            raise ValueError(f"band [{lo}, {hi}] ({units}) gives an empty or out-of-range layer range "
                             f"[{l0}, {l1}) for {n_layers} layers")
        out.append({"name": f"L{l0}-{l1 - 1}", "layers": [l0, l1]})
    return out


def knockout_masks(n_layers: int, decision: int, groups: dict[str, tuple[int, int]],
                   variants: list[tuple[list[str], list[int]]]) -> torch.Tensor:
    """Knockout masks: variant ``v`` hides the keys of its groups in its layers.

    Args:
        variants: ``(group names, [l0, l1))`` per variant; an empty group list knocks out nothing.

    Returns:
        bool ``[V, n_layers, d]`` over prefix positions (the decision token's own key is never hidden).

    Raises:
        ValueError: a group that cannot be knocked out (``decision``) or is unknown.
    """
    masks = torch.zeros(len(variants), n_layers, decision, dtype=torch.bool)
    for v, (names, (l0, l1)) in enumerate(variants):
        for g in names:
            if g not in KNOCKABLE:
                raise ValueError(f"cannot knock out group '{g}' (knockable: {KNOCKABLE})")
            s, e = groups[g]
            masks[v, l0:l1, s:e] = True
    return masks


# --------------------------------------------------------------------------------------------
# the decision-row hook


def _causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bool ``[1, 1, q_len, kv_len]``: query ``i`` sees key ``j`` iff ``j <= kv_len - q_len + i``
    (queries are the last ``q_len`` positions of the keys)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return (j <= kv_len - q_len + i)[None, None]


def additive_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The mask an attention implementation received, as an fp32 additive mask ``[B|1, 1, q, kv]``.

    ``None`` means what sdpa does without a mask: all keys for a single query row, causal
    (bottom-right aligned) otherwise. Bool masks are True where attending is allowed.
    """
    if mask is None:
        allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device) if q_len == 1 \
            else _causal(q_len, kv_len, device)
        mask = allowed
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask.float().clamp_min(torch.finfo(torch.float32).min)


def eager_probabilities(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities and output from the model's own eager attention function, in fp32.

    The function is the ``eager_attention_forward`` of the module's modeling file (Gemma-2's applies
    logit soft-capping), called with keyword arguments (docs/design.md §4, §10).

    Args:
        query: ``[B, heads, r, head_dim]`` (the rows of interest).
        key, value: ``[B, kv_heads, kv_len, head_dim]``.
        mask: additive fp32 ``[B|1, 1, r, kv_len]``.

    Returns:
        (probabilities ``[B, heads, r, kv_len]``, output ``[B, r, heads, head_dim]``), fp32.
    """
    eager = sys.modules[type(module).__module__].eager_attention_forward
    kw = dict(kwargs)
    kw["dropout"] = 0.0
    out, weights = eager(module, query.float(), key.float(), value.float(), mask, **kw)
    return weights.float(), out.float()


class DecisionRowHook:
    """``attention_hook`` function that knocks out keys for the decision row and/or records its
    attention probabilities.

    Queries fed in the hooked forward sit at positions ``start .. start + q_len - 1`` and the keys
    are the contiguous positions ending at the last query (true for prefix caches built by
    :mod:`kvnotes.cache`, including filled sliding windows).

    Args:
        decision: position ``d`` of the decision query.
        start: position of the first fed token.
        knock: optional bool ``[V, n_layers, P]``: hide key position ``p < P`` from the decision
            row in layer ``l`` for batch row ``v``.
        capture: record per layer the decision row's head-mean probabilities over positions.
        keep_heads: with ``capture``, also keep the per-head probabilities.

    Attributes:
        probs: layer -> fp32 ``[B, d + 1]`` head-mean probabilities by absolute position.
        head_probs: layer -> fp32 ``[B, heads, d + 1]`` (only with ``keep_heads``).
        recon_err: layer -> max |eager output - executed output| at the decision row.

    Raises:
        KvnotesError: (when called) a knockout under an attention implementation other than sdpa/eager.
    """

    def __init__(self, model, decision: int, start: int, knock: torch.Tensor | None = None, capture: bool = False,
                 keep_heads: bool = False):
        self.impl = model.config._attn_implementation
        self.decision, self.start, self.knock, self.capture = decision, start, knock, capture
        self.keep_heads = keep_heads
        self.probs: dict[int, torch.Tensor] = {}
        self.head_probs: dict[int, torch.Tensor] = {}
        self.recon_err: dict[int, float] = {}

    def _knocked(self, mask, q_len, kv_len, layer, row, k_pos, device):
        if self.impl not in SUPPORTED_IMPLEMENTATIONS:
            raise KvnotesError(f"attention knockout needs attn_implementation sdpa or eager, got '{self.impl}'")
        V, _, P = self.knock.shape
        hide = torch.zeros(V, kv_len, dtype=torch.bool, device=device)
        valid = (k_pos >= 0) & (k_pos < P)
        hide[:, valid] = self.knock[:, layer, k_pos[valid]].to(device)
        if mask is None or mask.dtype == torch.bool:
            allowed = _causal(q_len, kv_len, device) if (mask is None and q_len > 1) else \
                (torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device) if mask is None else mask)
            allowed = allowed.expand(V, allowed.shape[1], q_len, kv_len).clone()
            allowed[:, :, row, :] &= ~hide[:, None, :]
            return allowed
        out = mask.expand(V, mask.shape[1], q_len, kv_len).clone()
        out[:, :, row, :] = out[:, :, row, :].masked_fill(hide[:, None, :], torch.finfo(out.dtype).min)
        return out

    def __call__(self, base, module, query, key, value, attention_mask, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        row = self.decision - self.start
        if not 0 <= row < q_len:
            return base(module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        end = self.start + q_len
        k_pos = torch.arange(end - kv_len, end, device=query.device)
        if self.knock is not None and bool(self.knock[:, layer].any()):
            attention_mask = self._knocked(attention_mask, q_len, kv_len, layer, row, k_pos, query.device)
        out, weights = base(module, query, key, value, attention_mask, **kwargs)
        if self.capture:
            mask = additive_mask(attention_mask, q_len, kv_len, query.device)[..., row:row + 1, :]
            probs, eout = eager_probabilities(module, query[:, :, row:row + 1], key, value, mask, **kwargs)
            seen = k_pos <= self.decision                     # later keys (teacher-forced tokens) are masked
            full = torch.zeros(*probs.shape[:2], self.decision + 1, dtype=torch.float32, device=query.device)
            full[:, :, k_pos[seen]] = probs[:, :, 0, seen]
            self.probs[layer] = full.mean(1).cpu()
            if self.keep_heads:
                self.head_probs[layer] = full.cpu()
            ref = out[:, row:row + 1].float()
            self.recon_err[layer] = float((eout - ref).abs().max())
        return out, weights


@dataclass
class DecisionRead:
    """Output of :func:`decision_forward`.

    Attributes:
        logprobs: fp32 ``[V, n, vocab]`` log-probs after each fed token.
        probs: fp32 ``[V, n_layers, d + 1]`` head-mean decision-row attention by position, or None.
        recon_err: max over layers of |eager - executed attention output| at the decision row, or None.
    """

    logprobs: torch.Tensor
    probs: torch.Tensor | None
    recon_err: float | None


@torch.no_grad()
def decision_forward(model, cache, tokens: torch.Tensor, knock: torch.Tensor | None = None,
                     capture: bool = False, budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> DecisionRead:
    """Feed ``tokens`` (the first at the decision position ``d = seq_length(cache)``) on a prefix
    cache, optionally knocking out keys for the decision row and capturing its attention.

    Variants run batched over an expanded view of ``cache``, in chunks whose materialised variant
    caches fit ``budget_bytes``.

    Args:
        cache: batch-1 prefix cache over ``[0, d)`` (left unchanged).
        tokens: ``[n]`` token ids (decision token, then any teacher-forced continuation).
        knock: bool ``[V, n_layers, d]`` (see :func:`knockout_masks`); None = one clean variant.
        capture: compute the decision row's attention probabilities per layer.

    Returns:
        :class:`DecisionRead`.

    Raises:
        KvnotesError: a knockout under an attention implementation other than sdpa/eager.
    """
    d = kvcache.seq_length(cache)
    V = 1 if knock is None else knock.shape[0]
    lps, probs, errs = [], [], []
    for sl in kvcache.chunks(V, kvcache.variant_bytes(cache), budget_bytes):
        hook = DecisionRowHook(model, d, d, None if knock is None else knock[sl].to(model.device), capture)
        with attention_hook(model, hook):
            lps.append(kvcache.continuation_logprobs(model, kvcache.expand_cache(cache, model.config, sl.stop - sl.start),
                                                     tokens, d))
        if capture:
            probs.append(torch.stack([hook.probs[l] for l in sorted(hook.probs)], dim=1))
            errs.append(max(hook.recon_err.values()))
    return DecisionRead(torch.cat(lps), torch.cat(probs) if capture else None, max(errs) if capture else None)


def group_masses(probs: torch.Tensor, groups: dict[str, tuple[int, int]]) -> torch.Tensor:
    """Sum probabilities over each key group.

    Args:
        probs: ``[..., d + 1]`` probabilities by position.

    Returns:
        ``[..., len(GROUPS)]`` in :data:`GROUPS` order.
    """
    return torch.stack([probs[..., s:e].sum(-1) for s, e in (groups[g] for g in GROUPS)], dim=-1)


def _scores(model, pair, cache, knock, mode: str, capture: bool,
            budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> tuple[torch.Tensor, DecisionRead]:
    """Scores ``[V]`` of knockout variants and the first forward's :class:`DecisionRead`."""
    d_tok = pair.old.ids[pair.decision: pair.decision + 1]
    if mode == "first_token":
        read = decision_forward(model, cache, d_tok, knock, capture, budget_bytes)
        lp = read.logprobs[:, 0]
        return lp[:, pair.cand_new[0]] - lp[:, pair.cand_old[0]], read
    if mode != "full":
        raise ValueError(f"readout mode must be 'first_token' or 'full', got {mode!r}")
    totals, first = [], None
    for cand in (pair.cand_old, pair.cand_new):
        tokens = torch.cat([d_tok, torch.tensor(cand[:-1], dtype=torch.long)])
        read = decision_forward(model, cache, tokens, knock, capture and first is None, budget_bytes)
        if first is None:
            first = read
        idx = torch.tensor(cand, device=read.logprobs.device)
        lps = read.logprobs
        totals.append(lps.gather(2, idx.view(1, -1, 1).expand(lps.shape[0], -1, 1)).sum(dim=(1, 2)))
    return totals[1] - totals[0], first


def collapse_flags(lp: torch.Tensor, cands: tuple[int, int], drop_nats: float, top_k: int) -> dict[str, torch.Tensor]:
    """Readout-destroyed criterion per variant against variant 0 (the clean, nothing-knocked run).

    Args:
        lp: fp32 ``[V, vocab]`` first-token log-probs at the decision position; row 0 is clean.
        cands: first tokens of the two candidates.
        drop_nats: both candidates must fall by at least this much (nats) for ``drop``.
        top_k: ``topk_lost`` when neither candidate is in the top-k but one was in the clean top-k.

    Returns:
        bool ``[V]`` tensors ``drop``, ``topk_lost``, ``collapsed`` (either).
    """
    c = torch.tensor(cands, device=lp.device)
    cl = lp[:, c]                                                  # [V, 2]
    drop = ((cl[0:1] - cl) >= drop_nats).all(dim=1)
    kth = lp.topk(min(top_k, lp.shape[1]), dim=1).values[:, -1:]   # [V, 1]
    in_top = (cl >= kth).any(dim=1)
    lost = in_top[0] & ~in_top
    return {"drop": drop, "topk_lost": lost, "collapsed": drop | lost}


# --------------------------------------------------------------------------------------------
# the probe


def _mass_matrix_summary(rows: list[dict], key: str, n_boot: int, seed: int, level: float = 0.95) -> dict:
    """Mean ``[L, G]`` mass matrix over rows with cluster-bootstrap percentile CIs per cell."""
    if not rows:
        return {"n": 0, "n_scenarios": 0, "mean": None, "ci_low": None, "ci_high": None}
    X = np.asarray([r[key] for r in rows], dtype=float)             # [n, L, G]
    w = bootstrap_weights([r["scenario"] for r in rows], [r["instance"] for r in rows], n_boot, seed).astype(float)
    reps = np.einsum("bn,nlg->blg", w, X) / w.sum(1)[:, None, None]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha], axis=0)
    return {"n": len(rows), "n_scenarios": len({r["scenario"] for r in rows}), "mean": X.mean(0).tolist(),
            "ci_low": lo.tolist(), "ci_high": hi.tolist(), "ci_level": level}


def _by_family(rows: list[dict]) -> dict[str, list[dict]]:
    out = {"all": rows}
    for f in sorted({r["family"] for r in rows}):
        out[f] = [r for r in rows if r["family"] == f]
    return out


def _attention_aggregates(rows, bands, n_boot, seed) -> dict:
    """Per family and subset (flipping / all) and run: the layer x group mass matrix with CIs and
    the band-mean mass per group (summarize)."""
    out = {}
    for subset, sel in (("flipping", [r for r in rows if r["flips"]]), ("all", rows)):
        out[subset] = {}
        for fam, rs in _by_family(sel).items():
            entry = {}
            for run in RUNS:
                key = f"mass_{run}"
                band_stats = {}
                for band in bands:
                    l0, l1 = band["layers"]
                    band_stats[band["name"]] = {
                        g: summarize([float(np.mean([m[gi] for m in r[key][l0:l1]])) for r in rs],
                                     [r["scenario"] for r in rs], [r["instance"] for r in rs], n_boot, seed)
                        for gi, g in enumerate(GROUPS)}
                entry[run] = {"layers": _mass_matrix_summary(rs, key, n_boot, seed), "bands": band_stats}
            out[subset][fam] = entry
    return out


def _knockout_aggregates(ko_rows, variants, n_boot, seed) -> dict:
    """Per subset, family, run and variant: score change with CIs and the collapse / flip counts."""
    out = {}
    for subset, sel in (("flipping", [r for r in ko_rows if r["flips"]]), ("all", ko_rows)):
        out[subset] = {}
        for fam, rs in _by_family(sel).items():
            out[subset][fam] = {}
            for run in RUNS:
                cells = {}
                for v in variants:
                    cell = [r for r in rs if r["run"] == run and r["variant"] == v["name"]]
                    n = len(cell)
                    changed = sum(r["decision_changed"] for r in cell)
                    collapsed = sum(r["collapsed"] for r in cell)
                    intact = sum(r["flip_intact"] for r in cell)
                    cells[v["name"]] = {
                        "group": v["group"], "band": v["band"], "layers": v["layers"],
                        "delta": summarize([r["delta"] for r in cell], [r["scenario"] for r in cell],
                                           [r["instance"] for r in cell], n_boot, seed),
                        "delta_toward_other": summarize([r["delta_toward_other"] for r in cell],
                                                        [r["scenario"] for r in cell],
                                                        [r["instance"] for r in cell], n_boot, seed),
                        "n": n, "n_decision_changed": changed, "n_collapsed": collapsed,
                        "n_collapsed_drop": sum(r["collapse_drop"] for r in cell),
                        "n_collapsed_topk": sum(r["collapse_topk"] for r in cell),
                        "n_changed_but_collapsed": changed - intact,
                        "flip_intact": proportion(intact, n), "collapse_rate": proportion(collapsed, n),
                    }
                out[subset][fam][run] = cells
    return out


def _variants(cfg, n_layers: int) -> tuple[list[dict], list[dict]]:
    bands = layer_bands(n_layers, [list(b) for b in cfg.bands], cfg.get("band_units", "fraction"))
    variants = []
    for names in cfg.knockout_groups:
        names = [str(g) for g in (names if not isinstance(names, str) else [names])]
        for band in bands:
            variants.append({"name": f"{'+'.join(names)}@{band['name']}", "group": "+".join(names),
                             "groups": names, "band": band["name"], "layers": band["layers"]})
    return bands, variants


def run(ctx) -> dict:
    """Attention masses and knockouts of every aligned pair; see the module docstring.

    Returns:
        ``rows`` (one per pair: clean status, per-run ``[L, G]`` masses ``mass_old``/``mass_new``,
        clean first-token candidate log-probs ``lp_cand_old``/``lp_cand_new``, the reconstruction
        check), ``knockout_rows`` (one per pair x run x variant: score change, knocked candidate
        log-probs, collapse flags),
        ``aggregates`` (``attention``, ``knockout``, checks), ``exclusions``/``excluded``
        (tokenisation exclusions and pairs that do not flip, which are left out of the ``flipping``
        aggregates), ``groups``, ``bands``, ``variants``, ``collapse``.
    """
    cfg = ctx.cfg
    model = ctx.bundle.model
    n_layers = ctx.bundle.adapter.n_layers
    n_sinks = int(cfg.n_sinks)
    drop_nats, top_k = float(cfg.collapse.drop_nats), int(cfg.collapse.top_k)
    n_boot = int(cfg.get("n_boot", 2000))
    budget = getattr(ctx, "budget_bytes", kvcache.DEFAULT_BUDGET_BYTES)  # budget_mb
    bands, variants = _variants(cfg, n_layers)
    rows, ko_rows, examples = [], [], {}
    for pair in tqdm(ctx.pairs.pairs, desc="read_location", disable=not cfg.get("progress", True)):
        with ctx.timer("clean_runs"):
            pr = run_pair(model, pair, ctx.readout)
        status = pr.status(ctx.min_effect, ctx.flip_rule)
        groups = key_groups(pair.field, pair.decision, n_sinks)
        masks = torch.cat([torch.zeros(1, n_layers, pair.decision, dtype=torch.bool)] +
                          [knockout_masks(n_layers, pair.decision, groups, [(v["groups"], v["layers"])])
                           for v in variants])
        row = pair_row(pair) | status | {"groups": {g: list(s) for g, s in groups.items()}}
        base = {k: row[k] for k in ("pair", "scenario", "family", "instance", "flips")}
        null_err = 0.0
        for run_name, cache, s_clean, s_other in (("old", pr.old_cache, pr.s_old, pr.s_new),
                                                  ("new", pr.new_cache, pr.s_new, pr.s_old)):
            with ctx.timer("knockout"):
                scores, read = _scores(model, pair, cache, masks, ctx.readout, True, budget)
            mass = group_masses(read.probs[0], groups)                       # [L, G] clean variant
            row[f"mass_{run_name}"] = mass.tolist()
            row[f"recon_err_{run_name}"] = read.recon_err
            row[f"knocked_mass_max_{run_name}"] = max(
                float(group_masses(read.probs[i + 1], groups)[l0:l1][:, [GROUPS.index(g) for g in v["groups"]]].sum(-1).max())
                for i, v in enumerate(variants) for l0, l1 in [v["layers"]])
            null_err = max(null_err, abs(float(scores[0]) - s_clean))
            flags = collapse_flags(read.logprobs[:, 0], (pair.cand_old[0], pair.cand_new[0]), drop_nats, top_k)
            lp_c = read.logprobs[:, 0][:, [pair.cand_old[0], pair.cand_new[0]]]
            row[f"lp_cand_{run_name}"] = lp_c[0].tolist()                  # clean [cand_old, cand_new]
            toward = 1.0 if s_other > s_clean else -1.0
            for i, v in enumerate(variants, start=1):
                s_k = float(scores[i])
                changed = (s_k > 0) != (float(scores[0]) > 0)
                ko_rows.append(base | {
                    "run": run_name, "variant": v["name"], "group": v["group"], "band": v["band"],
                    "s_clean": float(scores[0]), "s_knock": s_k, "delta": s_k - float(scores[0]),
                    "delta_toward_other": toward * (s_k - float(scores[0])),
                    "lp_cand_knock": lp_c[i].tolist(),
                    "collapse_drop": bool(flags["drop"][i]), "collapse_topk": bool(flags["topk_lost"][i]),
                    "collapsed": bool(flags["collapsed"][i]), "decision_changed": changed,
                    "flip_intact": changed and not bool(flags["collapsed"][i]),
                })
        row["null_knockout_err"] = null_err
        rows.append(row)
        fam = row["family"]
        if fam not in examples or (row["flips"] and not examples[fam]["flips"]):
            examples[fam] = {"pair": row["pair"], "flips": row["flips"], "field": list(pair.field),
                             "decision": pair.decision, "mass_new": row["mass_new"]}
    excluded = list(ctx.pairs.excluded) + [r for r in rows if not r["flips"]]
    excluded = [{k: r[k] for k in ("pair", "scenario", "family", "instance", "reason")} for r in excluded]
    with ctx.timer("statistics"):
        aggregates = {
            "n_pairs": len(rows), "n_flip": sum(r["flips"] for r in rows),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in rows if r["flips"])),
            "checks": {
                "max_mass_sum_err": max((abs(sum(m) - 1) for r in rows for run in RUNS for m in r[f"mass_{run}"]),
                                        default=None),
                "max_recon_err": max((r[f"recon_err_{run}"] for r in rows for run in RUNS), default=None),
                "max_null_knockout_err": max((r["null_knockout_err"] for r in rows), default=None),
                "max_knocked_mass": max((r[f"knocked_mass_max_{run}"] for r in rows for run in RUNS), default=None),
            },
            "attention": _attention_aggregates(rows, bands, n_boot, ctx.seed),
            "knockout": _knockout_aggregates(ko_rows, variants, n_boot, ctx.seed),
        }
    return {"rows": rows, "knockout_rows": ko_rows, "aggregates": aggregates,
            "exclusions": dict(Counter(r["reason"] for r in excluded)), "excluded": excluded,
            "groups": list(GROUPS), "n_sinks": n_sinks, "bands": bands,
            "variants": [{k: v[k] for k in ("name", "group", "band", "layers")} for v in variants],
            "collapse": {"drop_nats": drop_nats, "top_k": top_k,
                         "rule": "collapsed = both candidates' first-token log-probs fall by >= drop_nats, "
                                 "or neither candidate stays in the top_k that held one of them"},
            "examples": examples}
