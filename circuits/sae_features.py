"""``sae_features``: a TopK sparse autoencoder on the residual stream at one layer; features ranked by
how well they separate the two conclusions at the top note position on selection instances, and
the top ``K`` clamped on held-out pairs: sufficiency and necessity against random features (the
paper's SAE analysis; anchors §10).

Specification: ``docs/probes/sae_features.md``.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, Counts, NonNegatives, OpenFraction, PositiveFloat, one_of, require_instances
from kvnotes.harness.kit import ProbeConfig, RandomControl
from kvnotes.harness.pairs import outcome_pair, outcomes
from kvnotes.harness.circuit import note_profiles, pair_profile
from kvnotes.harness.readout import PairRun, first_token_scores
from kvnotes.harness.selection import ANCHORS, pair_rng, rank_positions, split_warnings, with_split
from kvnotes.harness.registry import Conformance
from kvnotes.kv import cache as kvcache
from kvnotes.kv.engine import BACKENDS, Engine, Intervention, make_engine
from kvnotes.kv.sites import Site
from kvnotes.records.figures import Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import CircuitResult
from kvnotes.records.tables import Lines, ci

#: The interventions on a held-out pair: the ranked top ``K`` features, and ``K`` random ones.
ARMS = ("top", "random")
#: Engine sites an SAE can read (:class:`kvnotes.kv.engine.Site`).
SITES = ("resid_post", "attn_out")


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/sae_features.yaml`` (the defaults are here; see the specification)."""

    #: activation engine (``nnsight`` or ``transformer_lens``)
    backend: Annotated[str, one_of(*BACKENDS)] = "nnsight"
    #: decoder layers whose ``site`` the SAE may read (null: ``n_layers_scan`` evenly spaced); the SAE
    #: is trained at the one where the whole activation at the top note, new run into old, recovers
    #: most on selection pairs
    layers: Optional[NonNegatives] = None
    #: layers scanned when ``layers`` is null (over ``[0, n_layers - 2]``)
    n_layers_scan: Optional[Count] = 6
    #: what the SAE reads and the clamp adds to: ``resid_post`` (the residual stream after the layer)
    #: or ``attn_out`` (what the layer's attention adds to it: an attention-output SAE sees what the
    #: layer's heads write, e.g. the notes, apart from what the position already held)
    site: Annotated[str, one_of(*SITES)] = "resid_post"
    #: share of each scenario's instances the SAE is trained and its features ranked on
    selection_fraction: OpenFraction = 0.5
    #: how the top note position carries to held-out pairs: aligned | decision | field_end
    topk_anchor: Annotated[str, one_of(*ANCHORS)] = "aligned"
    #: SAE latents per residual dimension
    expansion: Count = 8
    #: SAE latents (overrides ``expansion``)
    n_latents: Optional[Count] = None
    #: active latents per input (TopK)
    k: Count = 32
    #: Adam steps, inputs per step, learning rate
    steps: Count = 1000
    batch: Count = 1024
    lr: PositiveFloat = 1e-3
    #: numbers of top features clamped
    ks: Counts = field(default_factory=lambda: [1, 3, 10])
    #: n_draws: random feature sets per pair and K (Generator from the seed and the pair id)
    random: RandomControl = field(default_factory=lambda: RandomControl(3))

    def check_run(self, run) -> None:
        """The SAE and its ranking are fitted on selection instances, every clamp is held out.

        Raises:
            KvnotesError: ``scenario.n_instances < 2``.
        """
        require_instances(run, 2, "sae_features", "trains the SAE and ranks its features on selection instances "
                          "and clamps them on held-out ones")


# ------------------------------------------------------------------------------------------ the SAE

@dataclass
class TrainedSAE:
    """A trained TopK SAE (EleutherAI ``sparsify.SparseCoder``) on inputs divided by ``scale``."""

    sae: Any
    scale: float
    fvu: float
    dead: float
    #: latents that fire on at least one training input
    alive: list[int]

    @torch.no_grad()
    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """Dense latent activations ``[n, n_latents]`` of residuals ``x`` ``[n, d_model]`` (zero off the top k)."""
        out = self.sae.encode(x.float() / self.scale)
        z = torch.zeros(x.shape[0], self.sae.num_latents)
        return z.scatter_(1, out.top_indices.long(), out.top_acts.float())

    def decoder(self, features: torch.Tensor) -> torch.Tensor:
        """Decoder rows of ``features`` in residual units, ``[len(features), d_model]``."""
        return self.sae.W_dec.detach()[features].float() * self.scale


def train_sae(x: torch.Tensor, n_latents: int, k: int, steps: int, batch: int, lr: float, seed: int) -> TrainedSAE:
    """Train a TopK SAE (Gao et al. 2024; ``sparsify.SparseCoder``: unit-norm decoder rows, gradient
    parallel to them removed, AuxK loss on latents dead for 200 steps) on residuals ``x`` ``[n,
    d_model]`` divided by the mean norm of their deviation from the mean, with Adam (seeded); the
    decoder bias starts at the data mean.

    Returns:
        the SAE with its final fraction of variance unexplained over all of ``x`` and the share of
        latents that never fire on it.
    """
    with contextlib.redirect_stdout(io.StringIO()):          # it prints a line when Triton is absent (CPU)
        from sparsify import SparseCoder, SparseCoderConfig

    x = x.float()
    scale = float((x - x.mean(0)).norm(dim=-1).mean())
    data = x / scale
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        sae = SparseCoder(data.shape[1], SparseCoderConfig(num_latents=n_latents, k=min(k, n_latents)))
        gen = torch.Generator().manual_seed(seed)
    sae.b_dec.data = data.mean(0)
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    since = torch.zeros(sae.num_latents, dtype=torch.long)
    for _ in range(steps):
        xb = data[torch.randint(len(data), (min(batch, len(data)),), generator=gen)]
        out = sae(xb, dead_mask=since > 200)
        opt.zero_grad()
        (out.fvu + out.auxk_loss / 32).backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        sae.set_decoder_norm_to_unit_norm()
        since += 1
        since[out.latent_indices.flatten().unique()] = 0
    with torch.no_grad():
        out = sae(data)
        fired = torch.zeros(sae.num_latents, dtype=torch.bool)
        fired[out.latent_indices.flatten().unique()] = True
    return TrainedSAE(sae.eval(), scale, float(out.fvu), float((~fired).float().mean()), fired.nonzero().flatten().tolist())


def auc(z: torch.Tensor, positive: np.ndarray) -> np.ndarray:
    """Per-feature ROC AUC of activations ``z`` ``[n, F]`` separating ``positive`` (bool ``[n]``)
    from the rest (Mann-Whitney U over average ranks; ties count half)."""
    from scipy.stats import rankdata

    ranks = rankdata(z.numpy(), axis=0)
    n1, n0 = int(positive.sum()), int((~positive).sum())
    return (ranks[positive].sum(0) - n1 * (n1 + 1) / 2) / (n1 * n0)


def rank_features(z: torch.Tensor, positive: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Features ordered by ``|AUC - 0.5|`` (:func:`auc`), ties by the larger difference of means.

    Returns:
        (feature indices, best first; the AUC of every feature ``[F]``).
    """
    a = auc(z, positive)
    gap = (z[torch.from_numpy(positive)].mean(0) - z[torch.from_numpy(~positive)].mean(0)).abs().numpy()
    order = np.lexsort((-gap, -np.abs(a - 0.5)))
    return [int(f) for f in order], a


# ------------------------------------------------------------------------------------------ the run

class Result(CircuitResult):
    """What ``run`` returns (record ``result``); ``warnings``: what could not be measured and why."""

    warnings: list[str]


def clamp_adds(sae: TrainedSAE, x: torch.Tensor, sets: list[list[int]], target: torch.Tensor) -> torch.Tensor:
    """What a clamp adds to the activation ``x`` ``[d_model]``: per feature set, each feature's
    activation set to ``target`` (``[n_latents]``) by ``Σ_f (target_f - z_f(x)) W_dec[f]`` (the SAE's
    reconstruction error stays in the activation; an empty set adds nothing).

    Returns:
        ``[len(sets), d_model]``.
    """
    z = sae.latents(x[None])[0]
    return torch.stack([((target[s] - z[s])[:, None] * sae.decoder(torch.tensor(s, dtype=torch.long))).sum(0)
                        if s else torch.zeros_like(x) for s in sets])


@torch.no_grad()
def added_scores(engine: Engine, run: PairRun, ids: torch.Tensor, prefix, site: Site, p: int,
                 adds: torch.Tensor) -> torch.Tensor:
    """Scores of the prompt ``ids`` (old or new run of ``run``) resumed at the note ``p`` on its clean
    prefix cache over ``[0, p)``, each variant adding a row of ``adds`` ``[V, d_model]`` at ``site``
    and position ``p``.

    Returns:
        ``[V]`` first-token scores (nats).
    """
    d = run.pair.decision
    iv = Intervention(Site(site.kind, site.layers, [p]), adds[:, None], mode="add")
    lp = engine.run(ids[p: d + 1][None].expand(adds.shape[0], -1), [iv], cache=prefix, start=p).logprobs
    return first_token_scores(lp[:, -1], run.pair).float().cpu()


def run(ctx) -> dict:
    """Choose the layer, train the SAE, rank its features, clamp them (see the specification)."""
    cfg: Config = ctx.cfg
    K.require_first_token(ctx)
    engine = make_engine(ctx.bundle.model, cfg.backend)
    layers = K.scan_layers(engine.adapter.n_layers, cfg.layers, cfg.n_layers_scan)
    fs = K.flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = with_split(fs.rows, cfg.selection_fraction, ctx.seed)
    anchor = cfg.topk_anchor
    profiles = note_profiles(ctx, fs.runs, rows, anchor, "sae_features: position maps")
    sites = [Site(cfg.site, layer) for layer in layers]
    acts = K.per_prompt(lambda ids: engine.run(ids, capture=sites).acts)
    notes = []                                   # (row, side, outcome, [n_scan, d_model] activations at the top note)
    train: dict = {}                             # selection prompts' activations at every scanned site, [0, d]
    for run_, row in K.units(ctx, zip(fs.runs, rows), "sae_features: notes"):
        pair = run_.pair
        b, d = pair.field[1], pair.decision
        if (found := pair_profile(profiles, row)) is None:
            continue
        row["note_position"] = p = rank_positions(found[0], (b, d), anchor, pair.downstream_ids)[0]
        with ctx.timer("activations"):
            full = {side: acts(ids[: d + 1]) for side, ids in (("old", pair.old.ids), ("new", pair.new.ids))}
            at_note = {side: torch.stack([a[s][0, p].float() for s in sites]) for side, a in full.items()}
            if row["split"] == "selection":
                train |= {(row["pair"], side): a for side, a in full.items()}
            if row["split"] == "selection" and len(layers) > 1:
                prefix = kvcache.prefix_cache(ctx.bundle.model, run_.old_cache, pair.old.ids, p)
                row["layer_scan"] = [float(run_.recovery(added_scores(engine, run_, pair.old.ids, prefix, s, p,
                                                                      (at_note["new"][i] - at_note["old"][i])[None]))[0])
                                     for i, s in enumerate(sites)]
        notes += [(row, side, o, at_note[side]) for side, o in zip(("old", "new"), outcomes(run_))]
    scan = [r["layer_scan"] for r in rows if "layer_scan" in r]
    li = int(np.argmax(np.mean(scan, axis=0))) if scan else len(layers) // 2
    site = sites[li]
    scanned = {"layers": layers, "selection_recovery": np.mean(scan, axis=0).tolist() if scan else None}
    if not train:
        return _result(ctx, fs, rows, sel, held, site, None, scanned,
                       ["sae_features: no selection pair with a note position: nothing to train the SAE on"])
    with ctx.timer("train"):
        data = torch.cat([a[site][0].float() for a in train.values()])
        sae = train_sae(data, int(cfg.n_latents or cfg.expansion * data.shape[1]), cfg.k, cfg.steps,
                        cfg.batch, cfg.lr, ctx.seed)
    sel_notes = [(o, x[li]) for r, _, o, x in notes if r["split"] == "selection"]
    held_notes = {(r["pair"], side): x[li] for r, side, _, x in notes if r["split"] == "heldout"}
    z_sel = sae.latents(torch.stack([x for _, x in sel_notes]))
    rankings: dict = {}
    for run_, row in K.units(ctx, zip(fs.runs, rows), "sae_features: clamps"):
        if row["split"] == "heldout" and "note_position" in row:
            with ctx.timer("clamp"):
                _clamp(ctx, engine, sae, site, run_, row, (sel_notes, z_sel, held_notes), rankings)
    res = _result(ctx, fs, rows, sel, held, site, sae, scanned, [])
    res["aggregates"]["features"] = {key: {"top": order[:10], "auc": [float(aucs[f]) for f in order[:10]],
                                           "top_decoder": F.normalize(sae.decoder(torch.tensor(order[:1])), dim=-1)[0].tolist()}
                                     for key, (order, aucs) in sorted(rankings.items())}
    return res


def _clamp(ctx, engine, sae: TrainedSAE, site: Site, run_: PairRun, row: dict, notes: tuple, rankings: dict) -> None:
    """Rank features for the pair's outcome pair on selection notes (memo ``rankings``), then clamp
    the top ``K``, and ``K`` random live features (firing on a training input) outside them, at the
    held-out pair's note: sufficiency on the old run, necessity on the new one.

    Args:
        notes: (selection ``[(outcome, activation)]``, their latents ``[n, n_latents]``, held-out
            activations by ``(pair id, side)``), all at the top note position.
    """
    cfg: Config = ctx.cfg
    sel_notes, z_sel, held_notes = notes
    o_old, o_new = outcomes(run_)
    key = outcome_pair(o_old, o_new)
    idx = [i for i, (o, _) in enumerate(sel_notes) if o in (o_old, o_new)]
    positive = np.array([sel_notes[i][0] == o_new for i in idx])
    if not positive.any() or positive.all():
        row["skipped"] = "no_selection_outcomes"
        return
    if key not in rankings:
        rankings[key] = rank_features(z_sel[idx], positive if o_new == max(o_old, o_new) else ~positive)
    order, aucs = rankings[key]
    z = z_sel[idx]
    mean_new, mean_old = z[torch.from_numpy(positive)].mean(0), z[torch.from_numpy(~positive)].mean(0)
    pair, p = run_.pair, row["note_position"]
    rng = pair_rng(ctx.seed, row["pair"])
    out: dict = {"top_features": order[: max(cfg.ks)],
                 "top_auc": [float(aucs[f]) if o_new == max(o_old, o_new) else 1 - float(aucs[f])
                             for f in order[: max(cfg.ks)]]}
    model = ctx.bundle.model
    for name, side, target, s_clean, s_to in (("sufficiency", "old", mean_new, run_.s_old, run_.s_new),
                                              ("necessity", "new", mean_old, run_.s_new, run_.s_old)):
        ids, cache = (pair.old.ids, run_.old_cache) if side == "old" else (pair.new.ids, run_.new_cache)
        x, x_to = held_notes[(row["pair"], side)], held_notes[(row["pair"], "new" if side == "old" else "old")]
        sets: list[list[int]] = [[]]
        for k in cfg.ks:
            sets.append(order[:k])
            others = [f for f in sae.alive if f not in order[:k]]
            sets += [sorted(int(f) for f in rng.choice(others, size=min(k, len(others)), replace=False))
                     for _ in range(int(cfg.random.n_draws))]
        adds = torch.cat([clamp_adds(sae, x, sets, target), (x_to - x)[None]])       # last: the whole activation
        s = added_scores(engine, run_, ids, kvcache.prefix_cache(model, cache, ids, p), site, p, adds)
        share = ((s - s_clean) / (s_to - s_clean)).tolist()
        out[f"{name}_unclamped_error"] = abs(float(s[0]) - s_clean)
        n = 1 + int(cfg.random.n_draws)
        out[name] = {str(k): {"top": share[1 + i * n], "random": float(np.mean(share[2 + i * n: (i + 1) * n + 1])),
                              "flipped": bool((s[1 + i * n] > 0) != (s_clean > 0))}
                     for i, k in enumerate(cfg.ks)} | {"full": share[-1]}
    row |= out


def _result(ctx, fs, rows: list[dict], sel: set, held: set, site: Site, sae: TrainedSAE | None, scanned: dict,
            warnings: list[str]) -> dict:
    cfg: Config = ctx.cfg
    n_boot, seed = cfg.n_boot, ctx.seed
    clamped = [r for r in rows if "sufficiency" in r]

    def by_k(name: str, arm: str) -> dict:
        return {str(k): K.summary(clamped, lambda r, k=k: r[name][str(k)][arm], n_boot, seed) for k in cfg.ks}

    with ctx.timer("statistics"):
        effects = {name: {arm: by_k(name, arm) for arm in ARMS} for name in ("sufficiency", "necessity")}
        full = {name: K.summary(clamped, lambda r, name=name: r[name]["full"], n_boot, seed)
                for name in ("sufficiency", "necessity")}
        flipped = {str(k): K.summary(clamped, lambda r, k=k: float(r["sufficiency"][str(k)]["flipped"]), n_boot, seed)
                 for k in cfg.ks}
    held_rows = [r for r in rows if r["split"] == "heldout"]
    warnings = warnings + split_warnings("sae_features", rows, "clamps", len(clamped),
                                         "have no note position or no selection prompts deciding both their outcomes")
    aggregates = K.pair_counts(ctx, rows, fs.excluded, K.families_of(ctx, rows + fs.excluded)) | {
        "layer": site.layer, "site": site.kind, "layer_scan": scanned, "n_selection": len(rows) - len(held_rows), "n_heldout": len(held_rows),
        "skipped": dict(Counter(r["skipped"] for r in held_rows if "skipped" in r)),
        "n_clamped": len(clamped), "ks": [int(k) for k in cfg.ks], "effects": effects, "decision_flipped": flipped,
        "full_activation": full,
        "top_separation": K.summary(clamped, lambda r: 0.5 + abs(r["top_auc"][0] - 0.5), n_boot, seed),
        "sae": None if sae is None else {"n_latents": int(sae.sae.num_latents), "k": int(sae.sae.cfg.k),
                                          "fvu": sae.fvu, "dead": sae.dead, "scale": sae.scale,
                                          "library": "sparsify (EleutherAI) SparseCoder"},
        "checks": {"max_unclamped_error": max((max(r["sufficiency_unclamped_error"], r["necessity_unclamped_error"])
                                               for r in clamped), default=None)}}
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": cfg.backend,
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates,
            "warnings": warnings}


# ---------------------------------------------------------------------------------------------
# presentation


def sae_table(rec: dict) -> str:
    """Sufficiency and necessity of the top ``K`` features against random ones (held-out pairs)."""
    agg = rec["result"]["aggregates"]
    w = Lines()
    sae = agg["sae"] or {}
    w(f"layer {agg['layer']} ({agg['site']}); SAE {sae.get('n_latents')} latents, top-{sae.get('k')}, FVU {sae.get('fvu', float('nan')):.3f}, "
      f"dead {sae.get('dead', float('nan')):.2f}; {agg['n_clamped']} held-out pairs; top feature max(AUC, 1 - AUC) {ci(agg['top_separation'])}")
    w(f"the whole activation at the note (old <-> new run): sufficiency {ci(agg['full_activation']['sufficiency'])}, "
      f"necessity {ci(agg['full_activation']['necessity'])}\n")
    w("| K | sufficiency: top K | random K | decision flipped | necessity: top K | random K |")
    w("|---|---|---|---|---|---|")
    e = agg["effects"]
    for k in agg["ks"]:
        k = str(k)
        w(f"| {k} | {ci(e['sufficiency']['top'][k])} | {ci(e['sufficiency']['random'][k])} | "
          f"{ci(agg['decision_flipped'][k])} | {ci(e['necessity']['top'][k])} | {ci(e['necessity']['random'][k])} |")
    return w.text()


def _curves(res: dict) -> dict:
    """``{effect: {arm: {K: summary}}}`` for :class:`Curves` over K."""
    return res.get("aggregates", {}).get("effects", {})


#: How this probe's records are shown (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(headline="top_separation", table=sae_table, figures=(
    Reshaped(Curves("clamps", "@/[top,random]/#", "held-out recovery by features clamped (95% intervals)",
                    "features clamped (K)", "recovery"), _curves),))


#: The zoo conformance lane runs it on its two cache shapes (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.n_layers_scan=2", "probe.expansion=1", "probe.k=4", "probe.steps=10",
                                  "probe.batch=64", "probe.ks=[1]", "probe.random.n_draws=1"), shapes="two")
