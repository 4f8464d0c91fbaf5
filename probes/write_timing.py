"""``write_timing``: when the notes are written and when the decision commits, each read with two
instruments at two positions (the paper's timing control; anchors §7.3).

Specification: ``docs/probes/write_timing.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge

import numpy as np
import torch

from kvnotes.harness import kit as K
from kvnotes.harness.constraints import Count, NonNegativeFloat, PositiveFloat, Share, one_of
from kvnotes.harness.kit import ProbeConfig, summary
from kvnotes.harness.protocol import pair_loop
from kvnotes.harness.selection import sample_pairs
from kvnotes.kv.engine import BACKENDS, make_engine
from kvnotes.kv.sites import Site
from kvnotes.kv.patch import candidate_logits
from kvnotes.models.adapters import Adapter
from kvnotes.records.figures import Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult, PairRow
from kvnotes.records.tables import Lines, ci

#: Where each instrument reads: the pair's top note position (the downstream position whose K/V alone
#: recovers most of the decision) and the decision position.
POSITIONS = ("note", "decision")
#: The two instruments: a linear probe on the residual stream, and the logit lens.
INSTRUMENTS = ("probe", "lens")
RUNS = ("old", "new")


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/write_timing.yaml`` (the defaults are here; see the specification)."""

    #: flipping pairs measured, stratified over scenarios and instances (None: every one)
    max_pairs: Count | None = 48
    #: write depth: the first layer whose probe accuracy reaches this
    accuracy: Share = 0.9
    #: the probe's cross-validation groups: ``scenario`` (no scenario trains and tests a probe; a
    #: held-out scenario's conclusions must be decided in others) or ``instance`` (no instance does)
    cv_groups: Annotated[str, one_of("scenario", "instance")] = "scenario"
    #: folds of the probe's group cross-validation (at most the number of groups)
    n_splits: Annotated[int, Ge(2)] = 5
    #: nats: a lens score has a sign only when at least this far from 0 (smaller is rounding or a
    #: softmax leak, not a commitment)
    lens_margin: NonNegativeFloat = 0.01
    #: inverse regularisation of the logistic regression (scikit-learn ``C``)
    C: PositiveFloat = 1.0
    #: activation engine of the residual capture (``nnsight`` or ``transformer_lens``)
    backend: Annotated[str, one_of(*BACKENDS)] = "nnsight"


class TimingRow(PairRow):
    """A measured pair: its top note position and the logit lens at both positions, per layer."""

    note_position: int
    note_offset: int
    note_recovery: float
    label_old: str
    label_new: str


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[TimingRow]
    layers: list[int]


def top_note(model, run, mode: str, budget_bytes: int) -> tuple[int, float]:
    """The downstream position ``p`` in ``[b, d)`` whose K/V alone, patched from the new run in every
    layer, recovers most of the decision (:func:`kvnotes.harness.kit.single_position_scores`).

    Returns:
        (``p``, its recovery).

    Raises:
        ValueError: the pair has no downstream position.
    """
    b, d = run.pair.field[1], run.pair.decision
    if d <= b:
        raise ValueError("the pair has no downstream position")
    r = run.recovery(K.single_position_scores(model, run, mode, budget_bytes))
    i = int(torch.argmax(r))
    return b + i, float(r[i])


@torch.no_grad()
def residuals(engine, ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """The residual stream after every decoder layer (TransformerLens ``blocks.l.hook_resid_post``,
    before the final norm) at ``positions`` of the prompts ``ids`` ``[B, T]`` (one forward).

    Returns:
        fp32 ``[n_layers, B, len(positions), d_model]``.
    """
    sites = [Site("resid_post", layer) for layer in range(engine.adapter.n_layers)]
    acts = engine.run(ids, capture=sites, n_keep=1).acts
    return torch.stack([acts[s][:, positions].float() for s in sites])


@torch.no_grad()
def lens_scores(model, resid: torch.Tensor, cand_old: int, cand_new: int) -> torch.Tensor:
    """The logit lens: the final norm then the unembedding (and the model's final soft-capping)
    applied to residuals (nostalgebraist 2020), read as the score ``logit(cand_new) - logit(cand_old)``.

    Args:
        resid: ``[..., d_model]`` residual-stream vectors (before the final norm).

    Returns:
        ``[...]`` scores (logit differences, nats up to a shared constant).
    """
    ad = Adapter.for_model(model)
    norm = ad.module(model, "final_norm")
    p = next(norm.parameters())
    normed = norm(resid.to(p.device, p.dtype))
    logits = candidate_logits(model, normed.reshape(-1, 1, normed.shape[-1]),
                              torch.tensor([cand_old, cand_new]))
    return (logits[:, 0, 1] - logits[:, 0, 0]).reshape(resid.shape[:-1]).cpu()


def commit_depth(scores: list[float], sign: float, margin: float = 0.0) -> int | None:
    """The first layer from which the lens score has the conclusion's sign (``sign``, +1 or -1) at
    every later layer, a score having a sign when it is more than ``margin`` (nats) from 0; None
    when the last layer's does not."""
    depth = None
    for layer in range(len(scores) - 1, -1, -1):
        if scores[layer] * sign <= margin:
            break
        depth = layer
    return depth


def probe_accuracy(X: np.ndarray, y: list[str], groups: list[str], n_splits: int, C: float, seed: int) -> dict:
    """Cross-validated accuracy of a linear probe decoding the conclusion ``y`` from ``X``: scikit-learn
    ``StandardScaler`` + ``LogisticRegression(C)``, ``GroupKFold`` over ``groups`` (no group is in both
    a training and a test fold). A test example whose label no training example has cannot be
    decoded by any probe; it is left out and counted (``n_unseen``).

    Args:
        X: ``[n, d_model]`` features; ``y`` the labels; ``groups`` the folds' groups (scenarios).

    Returns:
        ``correct`` (per example: 1/0, None when left out) and ``n_unseen``.
    """
    from sklearn.model_selection import GroupKFold
    from threadpoolctl import threadpool_limits

    labels = np.asarray(y)
    correct: list[float | None] = [None] * len(y)
    splits = GroupKFold(n_splits=min(n_splits, len(set(groups)))).split(X, labels, groups)
    with threadpool_limits(1):            # small fits: BLAS threads beside torch's made them 30x slower (measured)
        _fit_folds(X, labels, splits, C, seed, correct)
    return {"correct": correct, "n_unseen": sum(c is None for c in correct)}


def _fit_folds(X: np.ndarray, labels: np.ndarray, splits, C: float, seed: int, correct: list) -> None:
    """Fit and score each fold of :func:`probe_accuracy` (``correct`` filled in place)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    for train, test in splits:
        seen = set(labels[train])
        keep = [i for i in test if labels[i] in seen]
        if not keep:
            continue
        if len(seen) == 1:                                     # one class: the probe predicts it
            pred = np.full(len(keep), next(iter(seen)))
        else:
            clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000, random_state=seed))
            pred = clf.fit(X[train], labels[train]).predict(X[keep])
        for i, p in zip(keep, pred):
            correct[i] = float(p == labels[i])


def first_layer(curve: list[dict], key: str, bar: float) -> int | None:
    """The first layer whose ``curve[layer][key]`` reaches ``bar`` (None: none does)."""
    return next((i for i, s in enumerate(curve) if s.get(key) is not None and s[key] >= bar), None)


def run(ctx) -> dict:
    """Write and commit depth of every measured pair (see the specification).

    Raises:
        KvnotesError: a readout other than ``first_token`` (the lens reads first tokens).
    """
    cfg: Config = ctx.cfg
    K.require_first_token(ctx)
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    engine = make_engine(model, cfg.backend)
    n_layers = engine.adapter.n_layers
    pr = pair_loop(ctx, "write_timing: screen", keep=True)
    chosen = sample_pairs(pr.rows, cfg.max_pairs, ctx.seed, by=())
    rows, feats, excluded = [], [], list(pr.excluded)
    for sp, row in K.units(ctx, [(sp, r) for sp, r in zip(pr.pairs, pr.rows) if r["pair"] in chosen],
                           "write_timing: residuals"):
        pair = sp.pair
        if pair.decision <= pair.field[1]:
            excluded.append(row | {"reason": "no_downstream"})
            continue
        with ctx.timer("note_position"):
            note, rec = top_note(model, sp.run.with_caches(model), ctx.readout, ctx.budget_bytes)
        with ctx.timer("residuals"):
            ids = torch.stack([pair.old.ids, pair.new.ids])
            x = residuals(engine, ids, [note, pair.decision])                 # [L, 2 runs, 2 positions, d]
            lens = lens_scores(model, x, pair.cand_old[0], pair.cand_new[0])  # [L, 2, 2]
        labels = tok.convert_ids_to_tokens([pair.cand_old[0], pair.cand_new[0]])
        out = row | {"note_position": note, "note_offset": pair.decision - note, "note_recovery": rec,
                     "label_old": labels[0], "label_new": labels[1]}
        for j, position in enumerate(POSITIONS):
            for i, (run_name, s) in enumerate(zip(RUNS, (sp.s_old, sp.s_new))):
                curve = lens[:, i, j].tolist()
                out[f"lens_{position}_{run_name}"] = curve
                out[f"commit_{position}_{run_name}"] = commit_depth(curve, 1.0 if s > 0 else -1.0, cfg.lens_margin)
        rows.append(out)
        feats.append(x.numpy())
    excluded += [r | {"reason": "beyond_max_pairs"} for r in pr.rows if r["pair"] not in chosen]
    with ctx.timer("statistics"):
        aggregates = _aggregates(rows, feats, n_layers, cfg, ctx.seed)
    if rows:
        final = max(abs(r[f"lens_decision_{run_name}"][-1] - r[f"s_{run_name}"]) for r in rows for run_name in RUNS)
        aggregates["checks"] = {"max_abs_lens_final_minus_score": final}
    return {"rows": rows, "excluded": excluded, "exclusions": K.exclusion_counts(excluded),
            "layers": list(range(n_layers)), "aggregates": aggregates,
            "warnings": aggregates.pop("warnings")}


def _aggregates(rows: list[dict], feats: list[np.ndarray], n_layers: int, cfg: Config, seed: int) -> dict:
    """Per position and instrument, the per-layer curve (probe accuracy; lens share of prompts
    committed by that layer) with intervals fitted to the clusters, and the depths."""
    n_boot = cfg.n_boot
    # one example per prompt: (row, run)
    examples = [(r, run_name) for r in rows for run_name in RUNS]
    ex_rows = [{"scenario": r["scenario"], "instance": r["instance"], "family": r["family"]} for r, _ in examples]
    labels = [r[f"label_{run_name}"] for r, run_name in examples]
    by = cfg.cv_groups if len({r["scenario"] for r in rows}) >= 2 else "instance"
    groups = [r["scenario"] if by == "scenario" else f"{r['scenario']}/{r['instance']}" for r, _ in examples]
    warnings = []
    if len(set(groups)) < 2:
        warnings.append("write_timing: fewer than two scenarios or instances: the probe cannot be cross-validated")
    timing: dict = {}
    depths: dict = {}
    for j, position in enumerate(POSITIONS):
        probe_curve, lens_curve, unseen = [], [], []
        for layer in range(n_layers):
            if len(set(groups)) >= 2:
                X = np.stack([feats[k // len(RUNS)][layer, k % len(RUNS), j] for k in range(len(examples))])
                acc = probe_accuracy(X, labels, groups, cfg.n_splits, float(cfg.C), seed)
                unseen.append(acc["n_unseen"])
                probe_curve.append(summary([e | {"c": c} for e, c in zip(ex_rows, acc["correct"])], "c", n_boot, seed))
            else:
                probe_curve.append(summary([], "c", n_boot, seed))
            committed = [r[f"commit_{position}_{run_name}"] for r, run_name in examples]
            lens_curve.append(summary([e | {"c": float(c is not None and c <= layer)} for e, c in zip(ex_rows, committed)],
                                      "c", n_boot, seed))          # prompts cluster by scenario: no Wilson
        commits = [e | {"c": r[f"commit_{position}_{run_name}"]} for e, (r, run_name) in zip(ex_rows, examples)]
        timing[position] = {"probe accuracy": dict(enumerate(probe_curve)),
                            "lens committed": dict(enumerate(lens_curve))}
        depths[position] = {
            "probe": {"depth": first_layer(probe_curve, "mean", cfg.accuracy),
                      "n_unseen_label": max(unseen, default=0)},
            "lens": {"depth": summary([c for c in commits if c["c"] is not None], "c", n_boot, seed),
                     "n_never": sum(c["c"] is None for c in commits)}}
    if any(d["probe"]["n_unseen_label"] for d in depths.values()):
        n = max(d["probe"]["n_unseen_label"] for d in depths.values())
        warnings.append(f"write_timing: {n} of {len(examples)} prompts decide a candidate no other {by} "
                        "decides; the probe cannot decode them across groups and leaves them out")
    return {"n_pairs": len(rows), "n_prompts": len(examples), "cv_groups": by, "n_groups": len(set(groups)),
            "n_layers": n_layers, "accuracy_bar": cfg.accuracy,
            "write_depth": depths["note"]["probe"]["depth"],
            "commit_depth": depths["decision"]["lens"]["depth"], "depths": depths, "timing": timing,
            "note_recovery": summary(rows, "note_recovery", n_boot, seed),
            "note_offset": summary(rows, "note_offset", n_boot, seed), "warnings": warnings}


# ---------------------------------------------------------------------------------------------
# presentation


def timing_table(rec: dict) -> str:
    """Write depth and commit depth, each instrument at each position."""
    agg = rec["result"]["aggregates"]
    w = Lines()
    w(f"{agg['n_pairs']} pairs ({agg['n_prompts']} prompts), {agg['n_layers']} layers; probe: logistic regression, "
      f"group {agg['cv_groups']}s ({agg['n_groups']}), depth = first layer with accuracy >= {agg['accuracy_bar']}; "
      "lens: final norm then unembedding, depth = first layer from which the score keeps the decision's sign\n")
    w("| position | probe: first layer decoding the conclusion | lens: commit layer (mean [95% CI]) | lens never commits |")
    w("|---|---|---|---|")
    for position in POSITIONS:
        d = agg["depths"][position]
        probe_depth = "none" if d["probe"]["depth"] is None else str(d["probe"]["depth"])
        if d["probe"]["n_unseen_label"]:
            probe_depth += f" ({d['probe']['n_unseen_label']} prompts undecodable: label unseen)"
        w(f"| {position} | {probe_depth} | {ci(d['lens']['depth'])} | {d['lens']['n_never']} |")
    w(f"\nwrite depth (probe at the note) {agg['write_depth']}; commit depth (lens at the decision) "
      f"{ci(agg['commit_depth'])}; top note: recovery {ci(agg['note_recovery'])}, "
      f"{ci(agg['note_offset'])} tokens before the decision")
    return w.text()


def _curves(res: dict) -> dict:
    """``{position: {instrument curve: {layer: value}}}`` for :class:`Curves` over layers."""
    return res.get("aggregates", {}).get("timing", {})


#: How this probe's records are shown (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(headline="note_recovery", table=timing_table, figures=(
    Reshaped(Curves("timing", "@/*/#", "probe accuracy and lens commitment per layer (95% intervals)",
                    "layer", "accuracy / share committed"), _curves),))
