"""``direction``: a difference-of-means conclusion direction in the residual stream at the note
positions, tested for sufficiency and necessity (``docs/design.md``, "Circuits").

Specification: ``docs/probes/direction.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

import numpy as np
import torch

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegatives, OpenFraction, one_of, require_instances
from kvnotes.harness.kit import ProbeConfig, RandomControl, scan_layers
from kvnotes.harness.pairs import outcome_pair, outcomes
from kvnotes.harness.circuit import start_circuit
from kvnotes.harness.readout import PairRun, first_token_scores
from kvnotes.harness.selection import pair_rng, sample_pairs, selection_source, split_warnings
from kvnotes.harness.registry import Conformance
from kvnotes.kv import cache as kvcache
from kvnotes.kv.engine import BACKENDS, Engine, Intervention
from kvnotes.kv.sites import Site
from kvnotes.records.figures import Curves
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import CircuitResult

# ------- residual-stream interventions along directions (resid_post at the note positions [b, d))

def capture_notes(engine: Engine, ids: torch.Tensor, prefix, b: int, d: int, layers: Sequence[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residuals (site ``resid_post``) at the note positions ``[b, d)`` of a clean run, resumed at ``b``.

    Args:
        ids: ``[T]`` prompt ids (``T > d``).
        prefix: the run's clean prefix cache over ``[0, b)`` (batch 1; not modified).
        layers: decoder layers to capture.

    Returns:
        (``[len(layers), d - b, hidden]`` fp32 residuals, ``[1, vocab]`` fp32 log-probs at ``d``).
    """
    out = engine.run(ids[b: d + 1], capture=[Site("resid_post", l) for l in layers], cache=prefix, start=b)
    acts = torch.stack([out.acts[Site("resid_post", l)][0, : d - b].float() for l in layers])
    return acts, out.logprobs[:, -1]


def random_directions(rng: np.random.Generator, n: int, dim: int) -> torch.Tensor:
    """``[n, dim]`` fp32 unit vectors, isotropic (normalised standard Gaussian draws from ``rng``)."""
    g = torch.from_numpy(rng.standard_normal((n, dim))).float()
    return g / g.norm(dim=-1, keepdim=True)


def injections(delta: torch.Tensor, u: torch.Tensor, rand: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sufficiency additions at one layer.

    Args:
        delta: ``[P, hidden]`` clean-minus-corrupt residual difference at the note positions.
        u: ``[hidden]`` unit direction.
        rand: ``[R, hidden]`` unit random directions.

    Returns:
        ``direction`` ``[P, hidden]`` = ``(delta·u) u``; ``orthogonal`` = ``delta - direction``;
        ``full`` = ``delta``; ``random`` ``[R, P, hidden]`` = ``(delta·u) r̂`` (same norm as
        ``direction`` at every position, hence per pair); ``random_subspace`` ``[R, P, hidden]`` =
        ``(delta·r̂) r̂``, the part of the difference inside a random one-dimensional subspace,
        rescaled per draw to the total norm of ``direction`` (zero where that norm is zero).
    """
    c = delta @ u                                             # [P]
    along = c[:, None] * u[None]
    sub = (delta @ rand.T).T[:, :, None] * rand[:, None, :]   # [R, P, hidden]
    scale = along.norm() / sub.flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return {"direction": along, "orthogonal": delta - along, "full": delta,
            "random": c[None, :, None] * rand[:, None, :], "random_subspace": sub * scale[:, None, None]}


def ablations(x: torch.Tensor, dirs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Necessity additions: ``(mu_k - x_p·e_k) e_k`` per direction ``e_k``, so the projection of
    every note residual on ``e_k`` becomes ``mu_k``.

    Args:
        x: ``[P, hidden]`` clean note residuals.
        dirs: ``[K, hidden]`` unit directions; mu: ``[K]`` target projections.

    Returns:
        ``[K, P, hidden]``.
    """
    proj = x @ dirs.T                                         # [P, K]
    return ((mu[None] - proj).T)[:, :, None] * dirs[:, None, :]


def added_scores(engine: Engine, run: PairRun, ids: torch.Tensor, prefix, layer: int, values: torch.Tensor
                 ) -> torch.Tensor:
    """Scores of variants of a run resumed at ``b`` with ``values`` added to the residual (site
    ``resid_post`` of ``layer``) at the note positions ``[b, d)``.

    Args:
        ids: ``[T]`` prompt ids of the run (old for sufficiency, new for necessity).
        prefix: that run's clean prefix cache over ``[0, b)``.
        values: ``[V, d - b, hidden]``.

    Returns:
        ``[V]`` fp32 first-token scores (nats).
    """
    pair = run.pair
    b, d = pair.field[1], pair.decision
    iv = Intervention(Site("resid_post", layer, range(b, d)), values, mode="add")
    lp = engine.run(ids[b: d + 1][None].expand(values.shape[0], -1), [iv], cache=prefix, start=b).logprobs
    return first_token_scores(lp[:, -1], pair).float().cpu()

SCOPES = ("all", "family", "scenario")
ABLATE_TO = ("all", "old")
SUFF = ("direction", "orthogonal", "full", "random", "random_subspace")
NEC = ("direction", "random")


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/direction.yaml``
    (the defaults are here; the YAML sets what differs; see the specification)."""

    #: nnsight | transformer_lens (engine backend, kvnotes/kv/engine.py)
    backend: Annotated[str, one_of(*BACKENDS)] = "nnsight"
    #: explicit decoder layers to scan; null = n_layers_scan evenly spaced
    layers: Optional[NonNegatives] = None
    #: over [0, n_layers - 2] (null = all of them); bounds the work
    n_layers_scan: Optional[Count] = 5
    #: all | family: LOSO fit on other scenarios (of any / the same family) sharing the pair's outcome pair;
    #: scenario: other selection instances of its own scenario
    fit_scope: Annotated[str, one_of(*SCOPES)] = "all"
    #: necessity target projection: mean over all fitting runs | old-value runs
    ablate_to: Annotated[str, one_of(*ABLATE_TO)] = "all"
    #: n_draws: norm-matched random directions per pair (Generator from seed + pair id)
    random: RandomControl = field(default_factory=lambda: RandomControl(3))
    #: share of each scenario's instances used to fit and to choose the layer
    selection_fraction: OpenFraction = 0.5
    #: Pairs evaluated by interventions per family and split (seeded draw); every selection pair is still
    #: fitted on. Each evaluated held-out pair costs 2 batched resumed prefills per scanned layer. null =
    #: every pair (full runs).
    max_pairs_per_family: Optional[Count] = 3

    def check_run(self, run) -> None:
        """The direction is fitted and its layer chosen on selection instances, every number is held out.

        Raises:
            KvnotesError: ``scenario.n_instances < 2``.
        """
        require_instances(run, 2, "direction", "fits the direction and chooses its layer on selection instances "
                          "and tests it on held-out ones")


def accumulate(stats: dict, row: dict, outs: tuple[str, str], x_old: torch.Tensor, x_new: torch.Tensor) -> None:
    """Add one fitting pair's note residuals to the per-instance, per-outcome sums of ``stats``
    (in place): the old run's residuals count for the outcome it decides, the new run's for its own.

    Args:
        stats: ``{instance: {"scenario", "family", "pairs", "by_outcome_pair": {key: {"n_pairs",
            "n_pos", "sums": {outcome: [n_scan, hidden] fp32 sum over note positions}}}}}``.
        row: the pair row (``pair``, ``scenario``, ``instance``, ``family``).
        outs: ``(outcome of the old run, outcome of the new run)`` (:func:`outcomes`).
        x_old, x_new: ``[n_scan, P, hidden]`` residuals of the old and new runs.

    Raises:
        ValueError: old and new residuals of different shapes.
    """
    if x_old.shape != x_new.shape:
        raise ValueError(f"old/new residual shapes differ: {tuple(x_old.shape)} vs {tuple(x_new.shape)}")
    inst = stats.setdefault(row["instance"], {"scenario": row["scenario"], "family": row["family"], "pairs": [],
                                              "by_outcome_pair": {}})
    inst["pairs"].append(row["pair"])
    e = inst["by_outcome_pair"].setdefault(outcome_pair(*outs), {"n_pairs": 0, "n_pos": 0, "sums": {}})
    e["n_pairs"] += 1
    e["n_pos"] += int(x_old.shape[1])
    for o, x in zip(outs, (x_old, x_new)):
        e["sums"][o] = e["sums"].get(o, 0) + x.float().sum(1)


@dataclass
class Fit:
    """A difference-of-means fit for one outcome pair (all tensors fp32, per scanned layer).

    Attributes:
        mean_old, mean_new: ``[n_scan, hidden]`` mean note residual of the fitting runs that decide
            the evaluated pair's old-run outcome / new-run outcome.
        u: ``[n_scan, hidden]`` unit direction ``(mean_new - mean_old) / ||·||`` (signs aligned to
            the evaluated pair: it points from its old conclusion to its new one).
        scenarios: the scenarios fitted on; instances: the instances fitted on.
        n_pairs, n_pos: fitting pairs and note positions per outcome.
    """

    mean_old: torch.Tensor
    mean_new: torch.Tensor
    u: torch.Tensor
    scenarios: list[str]
    instances: list[str]
    n_pairs: int
    n_pos: int

    def mu(self, li: int, dirs: torch.Tensor, ablate_to: str = "all") -> torch.Tensor:
        """Mean projection, at scanned layer index ``li``, of the fitting runs' note residuals on
        unit directions ``dirs`` ``[K, hidden]``: over both outcomes (``"all"``; equal position
        counts, so the mean of the two means) or over the runs deciding the old-run outcome
        (``"old"``). Returns ``[K]``.

        Raises:
            ValueError: unknown ``ablate_to``.
        """
        if ablate_to not in ABLATE_TO:
            raise ValueError(f"ablate_to must be one of {ABLATE_TO}, got {ablate_to!r}")
        m = (self.mean_old[li] + self.mean_new[li]) / 2 if ablate_to == "all" else self.mean_old[li]
        return dirs @ m


def fit_direction(stats: dict, row: dict, outs: tuple[str, str], scope: str = "all") -> Fit | None:
    """Difference-of-means direction for the outcome pair of ``row``, from the fitting instances
    that share that outcome pair, signs aligned so it points from ``outs[0]`` to ``outs[1]``.

    Sources by ``scope``: ``all`` — every other scenario; ``family`` — other scenarios of the
    row's family (both leave-one-scenario-out); ``scenario`` — the other fitting instances of the
    row's own scenario (a within-scenario fit; never the row's own instance). None when no source
    shares the outcome pair or the two means coincide.

    Raises:
        ValueError: unknown scope.
    """
    if scope not in SCOPES:
        raise ValueError(f"fit_scope must be one of {SCOPES}, got {scope!r}")
    key = outcome_pair(*outs)

    def usable(inst: str, v: dict) -> bool:
        if key not in v["by_outcome_pair"]:
            return False
        if scope == "scenario":
            return v["scenario"] == row["scenario"] and inst != row["instance"]
        return v["scenario"] != row["scenario"] and (scope == "all" or v["family"] == row["family"])

    src = sorted(i for i, v in stats.items() if usable(i, v))
    if not src:
        return None
    entries = [stats[i]["by_outcome_pair"][key] for i in src]
    n = sum(e["n_pos"] for e in entries)
    mean_old = sum(e["sums"][outs[0]] for e in entries) / n
    mean_new = sum(e["sums"][outs[1]] for e in entries) / n
    diff = mean_new - mean_old
    norm = diff.norm(dim=-1, keepdim=True)
    if bool((norm == 0).any()):
        return None
    return Fit(mean_old, mean_new, diff / norm, sorted({stats[i]["scenario"] for i in src}), src,
               sum(e["n_pairs"] for e in entries), n)


def eval_pairs(rows: list[dict], per_family: int | None, seed: int) -> set[str]:
    """Pairs evaluated by interventions: all, or pairs drawn across scenarios and their instances
    until each family and split holds ``per_family`` pairs (:func:`kvnotes.harness.selection.sample_pairs`)."""
    return sample_pairs(rows, per_family, seed, by=("family", "split"))


def choose_layers(rows: list[dict], layers: Sequence[int], families: Sequence[str]) -> dict:
    """Per family, the layer with the highest mean sufficiency recovery (``row["selection_suff"]``,
    a list over ``layers``) over that family's **selection** rows (every selection row when the
    family has none; ties to the lower layer). Rows of other splits are ignored.

    Returns:
        ``{family: {"layer", "curve" (mean per layer), "pairs", "source"}}`` (families without any
        selection row are absent).
    """
    sel = [r for r in rows if r.get("split") == "selection" and "selection_suff" in r]
    out = {}
    for f in families:
        src, level = selection_source(sel, {"family": f}, ("family", "all"))
        if not src:
            continue
        curve = np.nanmean(np.asarray([r["selection_suff"] for r in src], dtype=float), axis=0)
        if not np.isfinite(curve).any():
            continue
        out[f] = {"layer": int(layers[int(np.nanargmax(curve))]), "curve": curve.tolist(),
                  "pairs": [r["pair"] for r in src],
                  "source": "family" if level == "family" else "all_selection"}
    return out


def _heldout_layer(engine, run_, x_old, x_new, fit, li, layer, rand, ablate_to, prefixes) -> dict:
    """Every sufficiency and necessity variant of one held-out pair at scanned layer index ``li``."""
    pair = run_.pair
    u = fit.u[li]
    inj = injections(x_new[li] - x_old[li], u, rand)
    R = rand.shape[0]
    vals = torch.cat([inj["direction"][None], inj["orthogonal"][None], inj["full"][None], inj["random"],
                      inj["random_subspace"]])
    s = added_scores(engine, run_, pair.old.ids, prefixes[0], layer, vals)
    r = run_.recovery(s).numpy()
    fl = run_.decision_flipped(s).numpy()
    rnd, sub = slice(3, 3 + R), slice(3 + R, 3 + 2 * R)
    dirs = torch.cat([u[None], rand])
    mu = fit.mu(li, dirs, ablate_to)
    s_abl = added_scores(engine, run_, pair.new.ids, prefixes[1], layer, ablations(x_new[li], dirs, mu))
    drop = (run_.s_new - s_abl).numpy()
    back = ((s_abl > 0) == (run_.s_old > 0)).numpy()
    inj_norm = float(inj["direction"].norm())
    rand_norms = [float(inj["random"][k].norm()) for k in range(R)]
    pos_err = float((inj["random"].norm(dim=-1) - inj["direction"].norm(dim=-1)[None]).abs().max()) if R else 0.0
    denom = max(inj_norm, torch.finfo(torch.float32).tiny)
    return {
        "suff": {"direction": float(r[0]), "orthogonal": float(r[1]), "full": float(r[2]),
                 "random": float(r[rnd].mean()) if R else None, "random_draws": r[rnd].tolist(),
                 "random_subspace": float(r[sub].mean()) if R else None, "random_subspace_draws": r[sub].tolist()},
        "suff_flipped": {"direction": bool(fl[0]), "orthogonal": bool(fl[1]), "full": bool(fl[2]),
                         "random": bool(fl[rnd].mean() > 0.5) if R else None,
                         "random_subspace": bool(fl[sub].mean() > 0.5) if R else None},
        "nec": {"direction": float(drop[0] / run_.effect),
                "random": float(drop[1:].mean() / run_.effect) if R else None,
                "random_draws": (drop[1:] / run_.effect).tolist()},
        "nec_nats": {"direction": float(drop[0]), "random": float(drop[1:].mean()) if R else None},
        "nec_flipped": {"direction": bool(back[0]), "random": bool(back[1:].mean() > 0.5) if R else None},
        "inj_norm": inj_norm, "random_norms": rand_norms,
        "random_norm_rel_error": max([abs(n - inj_norm) / denom for n in rand_norms] + [pos_err / denom]
                                     + [abs(float(inj["random_subspace"][k].norm()) - inj_norm) / denom
                                        for k in range(R)] if inj_norm > 0 else [0.0]),
        "orth_norm": float(inj["orthogonal"].norm()), "delta_norm": float(inj["full"].norm()),
        "cos_mean_delta": float(torch.nn.functional.cosine_similarity((x_new[li] - x_old[li]).mean(0), u, dim=0)),
        "random_k": [int(inj["random"][k].shape[0]) for k in range(R)], "k": int(inj["direction"].shape[0]),
    }


class Result(CircuitResult):
    """What ``run`` returns (record ``result``): evaluated held-out rows carry ``layers`` (per
    scanned layer: sufficiency and necessity of every variant); ``warnings``: what could not be
    measured and why, one line each (also said on stderr)."""

    warnings: list[str]


@dataclass
class _Work:
    """What the stages of :func:`run` share: the engine, the flipping pairs and their rows, the
    scanned layers, the evaluated pairs, and per evaluated pair its clean note residuals, prefix
    caches and fitted direction."""

    ctx: Any
    engine: Any
    fs: Any
    rows: list[dict]
    layers: list[int]
    evaluated: set
    stats: dict = field(default_factory=dict)
    caps: dict = field(default_factory=dict)
    prefixes: dict = field(default_factory=dict)
    fits: dict = field(default_factory=dict)
    resume_err: list = field(default_factory=list)

    def fitted(self, split: str):
        """Evaluated pairs of one split that have a fit: ``(run, row, fit, x_old, x_new)``."""
        for run_, row in K.units(self.ctx, zip(self.fs.runs, self.rows), f"direction: {split}"):
            if row["split"] != split or row["pair"] not in self.evaluated:
                continue
            if self.fits[row["pair"]] is None:
                row["skipped"] = "no_shared_outcome_pair"
                continue
            yield run_, row, self.fits[row["pair"]], *self.caps[row["pair"]]


def _capture_residuals(w: _Work, scope: str) -> None:
    """Stage 1: clean note residuals of every selection pair (fitting) and every evaluated pair,
    then one direction fit per evaluated pair."""
    model = w.ctx.bundle.model
    for run_, row in K.units(w.ctx, zip(w.fs.runs, w.rows), "direction: residuals"):
        if row["split"] != "selection" and row["pair"] not in w.evaluated:
            continue
        pair = run_.pair
        b, d = pair.field[1], pair.decision
        with w.ctx.timer("capture"):
            pre = (kvcache.prefix_cache(model, run_.old_cache, pair.old.ids, b),
                   kvcache.prefix_cache(model, run_.new_cache, pair.new.ids, b))
            x_old, lp_old = capture_notes(w.engine, pair.old.ids, pre[0], b, d, w.layers)
            x_new, lp_new = capture_notes(w.engine, pair.new.ids, pre[1], b, d, w.layers)
        w.resume_err.append(max(abs(float(first_token_scores(lp_old, pair)[0]) - run_.s_old),
                                abs(float(first_token_scores(lp_new, pair)[0]) - run_.s_new)))
        row["outcomes"] = list(outcomes(run_))
        if row["split"] == "selection":
            accumulate(w.stats, row, outcomes(run_), x_old, x_new)
        if row["pair"] in w.evaluated:
            w.caps[row["pair"]] = (x_old, x_new)
            w.prefixes[row["pair"]] = pre
    for row in w.rows:
        if row["pair"] in w.evaluated:
            w.fits[row["pair"]] = fit_direction(w.stats, row, tuple(row["outcomes"]), scope)


def _selection_scan(w: _Work) -> None:
    """Stage 2: sufficiency of the direction per layer on the evaluated selection pairs."""
    for run_, row, fit, x_old, x_new in w.fitted("selection"):
        curve = []
        for li, layer in enumerate(w.layers):
            with w.ctx.timer("selection_scan"):
                v = injections(x_new[li] - x_old[li], fit.u[li], torch.empty(0, fit.u.shape[1]))["direction"]
                s = added_scores(w.engine, run_, run_.pair.old.ids, w.prefixes[row["pair"]][0], layer, v[None])
            curve.append(float(run_.recovery(s)[0]))
        row["selection_suff"] = curve
        row["fit_scenarios"], row["fit_instances"] = fit.scenarios, fit.instances


def _heldout_scan(w: _Work, chosen: dict, n_draws: int, ablate_to: str) -> None:
    """Stage 3: every variant per layer on the evaluated held-out pairs (the chosen layer marked)."""
    for run_, row, fit, x_old, x_new in w.fitted("heldout"):
        rand = random_directions(pair_rng(w.ctx.seed, row["pair"]), n_draws, x_old.shape[-1])
        row["fit_scenarios"], row["fit_instances"], row["fit_n_pairs"] = fit.scenarios, fit.instances, fit.n_pairs
        row["layers"] = {}
        for li, layer in enumerate(w.layers):
            with w.ctx.timer("heldout_scan"):
                row["layers"][str(layer)] = _heldout_layer(w.engine, run_, x_old, x_new, fit, li, layer, rand,
                                                           ablate_to, w.prefixes[row["pair"]])
        if row["family"] in chosen:
            row["chosen_layer"] = chosen[row["family"]]["layer"]


def _summaries(held_rows: list[dict], layers: list[int], families, n_boot: int, seed: int) -> tuple[dict, dict]:
    """Stage 4: recovery curves per variant and layer, and at each family's chosen layer."""
    def flat(rs, layer_of, kind, variant):
        return [r | {"_r": r["layers"][str(layer_of(r))][kind][variant],
                     "_f": r["layers"][str(layer_of(r))][f"{kind}_flipped"][variant]} for r in rs]

    curves = {}
    for kind, variants in (("suff", SUFF), ("nec", NEC)):
        curves[kind] = {v: {str(l): K.summaries_by_family(flat(held_rows, lambda r, l=l: l, kind, v), "_r", "_f",
                                                          families, n_boot, seed) for l in layers}
                        for v in variants}
    at_chosen = {}
    hc = [r for r in held_rows if "chosen_layer" in r]
    for kind, variants in (("suff", SUFF), ("nec", NEC)):
        at_chosen[kind] = {v: K.summaries_by_family(flat(hc, lambda r: r["chosen_layer"], kind, v), "_r", "_f",
                                                    families, n_boot, seed) for v in variants}
    nats = [r | {"_d": r["layers"][str(r["chosen_layer"])]["nec_nats"]["direction"]} for r in hc]
    at_chosen["nec_nats_direction"] = K.summaries_by_family(nats, "_d", None, families, n_boot, seed)
    return curves, at_chosen


def _checks(w: _Work, chosen: dict, held_rows: list[dict], held_ids: set, scope: str) -> dict:
    """The probe's self-checks: no selection leaks into held-out numbers, exact resumes, matched controls."""
    rows = w.rows
    return {
        "layer_choice_pairs_in_heldout": sum(p in held_ids for c in chosen.values() for p in c["pairs"]),
        # leave-one-scenario-out scopes never fit on the pair's scenario; no scope on its instance
        "fit_scenario_equals_own": (sum(r["scenario"] in r.get("fit_scenarios", []) for r in rows)
                                    if scope != "scenario" else None),
        "fit_instance_equals_own": sum(r["instance"] in r.get("fit_instances", []) for r in rows),
        "fit_pairs_in_heldout": sum(p in held_ids for v in w.stats.values() for p in v["pairs"]),
        "fit_pairs": sum(len(v["pairs"]) for v in w.stats.values()),
        "max_resume_score_error": max(w.resume_err, default=None),
        "max_random_norm_rel_error": max((lv["random_norm_rel_error"] for r in held_rows
                                          for lv in r["layers"].values()), default=None),
        "random_k_matched": all(all(k == lv["k"] for k in lv["random_k"]) for r in held_rows
                                for lv in r["layers"].values()),
    }


def run(ctx) -> dict:
    """Difference-of-means conclusion direction: sufficiency, necessity, controls, layer chosen on
    the selection split; see the specification. Stages: clean residuals and fits
    (:func:`_capture_residuals`), the selection scan (:func:`_selection_scan`) and layer choice, the
    held-out scan (:func:`_heldout_scan`), summaries and checks.

    Returns:
        the probe result (``rows``, ``aggregates``, ``exclusions``, ``excluded``, ``split``,
        ``backend``).

    Raises:
        KvnotesError: a readout other than ``first_token``.
        ModelFitError: (a ``KvnotesError`` and ``ValueError``) a layer of ``layers`` outside the model,
            raised before any work (:func:`kvnotes.harness.kit.scan_layers`).
        ValueError: bad ``fit_scope`` / ``ablate_to``, or ``random.n_draws < 1``.
    """
    cfg = ctx.cfg
    L = ctx.bundle.adapter.n_layers
    layers = scan_layers(L, cfg.layers, cfg.n_layers_scan)
    scope, ablate_to = cfg.fit_scope, cfg.ablate_to
    if scope not in SCOPES or ablate_to not in ABLATE_TO:
        raise ValueError(f"fit_scope in {SCOPES}, ablate_to in {ABLATE_TO}; got {scope!r}, {ablate_to!r}")
    n_draws = int(cfg.random.n_draws)
    if n_draws < 1:
        raise ValueError("random.n_draws must be >= 1: the norm-matched random control is required")
    engine, fs, rows, sel, held = start_circuit(ctx)
    n_boot = cfg.n_boot
    w = _Work(ctx, engine, fs, rows, layers, eval_pairs(rows, cfg.max_pairs_per_family, ctx.seed))
    families = K.families_of(ctx, rows + fs.excluded)
    _capture_residuals(w, scope)
    _selection_scan(w)
    chosen = choose_layers(rows, layers, families)
    _heldout_scan(w, chosen, n_draws, ablate_to)
    fs.runs = [r.released() for r in fs.runs]
    w.caps.clear()
    w.prefixes.clear()
    held_rows = [r for r in rows if r["split"] == "heldout" and "layers" in r]
    with ctx.timer("statistics"):
        curves, at_chosen = _summaries(held_rows, layers, families, n_boot, ctx.seed)
        hc = [r for r in held_rows if "chosen_layer" in r]

        def at(kind, variant):
            return lambda r: r["layers"][str(r["chosen_layer"])][kind][variant]

        verdict = {f"{kind}_direction": K.verdicts(hc, at(kind, "direction"), at(kind, "random"), families,
                                                   f"{what} along the fitted direction vs norm-matched random "
                                                   f"directions, held-out pairs at the family's chosen layer",
                                                   n_boot, ctx.seed)
                   for kind, what in (("suff", "sufficiency (recovery adding)"),
                                      ("nec", "necessity (drop ablating)"))}
    sel_ids = {r["pair"] for r in rows if r["split"] == "selection"}
    held_ids = {r["pair"] for r in rows if r["split"] == "heldout"}
    aggregates = K.pair_counts(ctx, rows, fs.excluded, families) | {
        "n_selection": len(sel_ids), "n_heldout": len(held_ids),
        "n_evaluated": {"selection": sum(r["pair"] in w.evaluated for r in rows if r["split"] == "selection"),
                        "heldout": len(held_rows)},
        "n_skipped": {"no_shared_outcome_pair": sum(r.get("skipped") == "no_shared_outcome_pair" for r in rows)},
        "layers": layers, "n_layers": L, "fit_scope": scope, "ablate_to": ablate_to,
        "n_draws": n_draws, "note_positions": "downstream [b, d)", "site": "resid_post (decoder layer output)",
        "chosen_layers": chosen, "curves": curves, "at_chosen": at_chosen, "verdicts": verdict,
        "checks": _checks(w, chosen, held_rows, held_ids, scope),
        "fit_scenarios_per_family": {f: sorted({v["scenario"] for v in w.stats.values() if v["family"] == f})
                                     for f in families},
        "outcome_pairs": {f: sorted({outcome_pair(*r["outcomes"]) for r in rows if r["family"] == f and "outcomes" in r})
                          for f in families},
        "per_family": K.no_circuit_note(families, rows, fs.excluded),
    }
    return {"rows": rows, "exclusions": fs.exclusions, "excluded": fs.excluded, "backend": engine.backend,
            "split": {"selection": sorted(sel), "heldout": sorted(held)}, "aggregates": aggregates,
            "warnings": _warnings(rows, held_rows, chosen, aggregates["n_skipped"]["no_shared_outcome_pair"])}


def _warnings(rows: list[dict], held_rows: list[dict], chosen: dict, n_unfitted: int) -> list[str]:
    """What the run could not measure, one line each: no selection pair, no evaluated held-out
    pair with a fit, no layer chosen."""
    out = split_warnings("direction", rows, "held-out numbers")
    if out or not rows:
        return out
    if not held_rows:
        return [f"direction: no held-out pair was evaluated: {n_unfitted} pairs share no outcome pair with a "
                f"selection fit (aggregates.n_skipped)"]
    if not chosen:
        return ["direction: no layer was chosen: no evaluated selection pair has a fit, so the at_chosen numbers are empty"]
    return []


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Curves("layer-curves-suff", "curves/suff/*/#/@", "sufficiency: recovery adding along the direction in the "
           "old prefill, per layer (held-out; mean, 95% interval)", "layer", "recovery"),
    Curves("layer-curves-nec", "curves/nec/*/#/@", "necessity: drop / (s_new - s_old) mean-ablating the "
           "projection in the new prefill, per layer (held-out; mean, 95% interval)", "layer", "drop")))


#: The zoo conformance lane's settings for it (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.n_layers_scan=2", "probe.random.n_draws=1", "probe.max_pairs_per_family=1",
                                  "probe.fit_scope=scenario"), transformer_lens="two")
