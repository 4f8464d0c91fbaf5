#!/usr/bin/env python
"""Precision and recall of the editable-context API's ``auto`` diagnostic against the full re-prefill.

    kvnotes bench auto [--model smollm2-135m] [--scenario small] [--checks field_plus_erratum selective@50%]
    kvnotes bench auto --model planted-mixed --scenario planted --alphas 0.1 0.3 0.7 0.9

For every token-aligned pair of the scenario suite (old -> new field value), the old prompt is built
as an :class:`kvnotes.context.EditableContext` (:func:`kvnotes.harness.edit_prompts.editable_context`),
prefilled, and the new value applied three ways on copies: ``full`` (the reference), ``in_place``,
and each diagnostic check (:meth:`~kvnotes.context.EditableContext.diagnose`). The truth is whether
the in-place decision differs from the full re-prefill's (the in-place edit does not suffice); pairs
whose full re-prefill decision is not owned (the model's top-1 token is no candidate) are excluded
and counted. A check's verdict at margin ``m`` is "needed" when its corrected decision is owned,
differs from the in-place one and leads it by more than ``m`` nats. The margin is chosen on
selection instances (F1; :func:`kvnotes.harness.selection.split_instances`) and precision/recall
are reported on held-out instances and, at margin 0 (nothing fitted), on every pair; intervals are
Wilson 95%. The paper's rule (``needs_erratum``: the erratum moves the stale decision by more than
0.2 in probability and differs from the in-place decision) is scored on the same pairs. Cost is the
diagnostic's tokens forwarded (and wall time) against the full re-prefill's.

On a planted model (:mod:`kvnotes.models.planted`; ``--alphas`` measures one per field share of the
mixed family) the verdicts are also scored against the construction's truth (rule ``flip/pl``,
``extrapolate/pl``): the in-place edit is insufficient exactly where the notes carry the majority
of the decision (:func:`planted_truth`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvnotes import CONF_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter

#: The paper's margin for its ``needs_erratum`` rule (probability units; anchors: editkv).
PAPER_MARGIN = 0.2


def pair_row(model, tokenizer, pair, checks: list[str], chat_template: bool, template_kwargs) -> dict:
    """The per-pair measurements: decisions of stale / full / in-place and each check's verdict inputs."""
    from kvnotes.harness.edit_prompts import editable_context

    spec = pair.spec
    ctx = editable_context(model, tokenizer, spec.instance, spec.old, spec.variant, chat_template, template_kwargs)
    ctx.prefill()
    cands = [spec.cand_old, spec.cand_new]
    row = {"pair": spec.id, "scenario": spec.instance.scenario.id, "instance": spec.instance.id,
           "family": spec.instance.scenario.family, "expect_flip": spec.expect_flip,
           "same_prompt_as_harness": bool(torch.equal(ctx.layout.ids, pair.old.ids))}
    stale = ctx.decide(cands)
    full = ctx.fork()
    t0 = time.perf_counter()
    rep_full = full.edit("field", spec.new, "full")
    d_full = full.decide(cands)
    full_s = time.perf_counter() - t0
    ip = ctx.fork()
    rep_ip = ip.edit("field", spec.new, "in_place")
    d_ip = ip.decide(cands)
    row |= {"scores": {"stale": stale.scores.tolist(), "full": d_full.scores.tolist(), "in_place": d_ip.scores.tolist()},
            "candidates": cands,
            "stale": stale.top1, "full": d_full.top1, "full_owned": d_full.owned, "in_place": d_ip.top1,
            "in_place_applied": rep_ip.applied, "needed": d_ip.top1 != d_full.top1,
            "full_tokens": rep_full.cost.tokens, "full_seconds": full_s, "checks": {}}
    for check in checks:
        t0 = time.perf_counter()
        dg = ctx.diagnose("field", spec.new, cands, margin=0.0, check=check)
        sec = time.perf_counter() - t0
        c = dg.corrected
        gap = float(c.scores[c.candidates.index(c.top1)] - c.scores[c.candidates.index(dg.in_place.top1)])
        p = c.scores.exp()
        moved = float(p[c.candidates.index(c.top1)] - p[c.candidates.index(stale.top1)])
        b = ctx.fork()
        b.edit("field", spec.new, "in_place")
        n_down = b.layout.length - 1 - b.layout.fields["field"][1]
        row["checks"][check] = {"corrected": c.top1, "corrected_owned": c.owned, "gap": gap,
                                "scores": c.scores.tolist(), "in_place_owned": dg.in_place.owned,
                                "share": 1.0 if check == "field_plus_erratum" else share_of(check, n_down),
                                "paper": bool(c.top1 != stale.top1 and moved > PAPER_MARGIN and c.top1 != dg.in_place.top1),
                                "agrees_with_full": c.top1 == d_full.top1,
                                "tokens": dg.cost.tokens, "seconds": sec}
    return row


def share_of(check: str, n_down: int) -> float:
    """The share of the downstream positions ``selective@K`` / ``selective@P%`` recomputes."""
    from kvnotes.context import parse_mode

    _, k = parse_mode(check)
    n = k if isinstance(k, int) else math.ceil(float(k or 0) * n_down)
    return min(n, n_down) / max(1, n_down)


def row_verdict(r: dict, check: str, rule: str, margin: float) -> bool:
    """The API's verdict (:func:`kvnotes.context.verdict`) recomputed from a stored row."""
    from kvnotes.context import Decision, verdict

    c = r["checks"][check]
    cands = tuple(r["candidates"])
    assert check.startswith(("selective@", "field_plus_erratum"))
    empty = torch.zeros(0)
    ip = Decision(cands, torch.tensor(r["scores"]["in_place"]), r["in_place"], bool(c.get("in_place_owned")), empty)
    cor = Decision(cands, torch.tensor(c["scores"]), c["corrected"], bool(c["corrected_owned"]), empty)
    if r["in_place_applied"] != "in_place":
        return False
    share = c.get("share")
    if share is None:            # rows written before the share was stored: the nominal P% of the check
        share = 1.0 if check == "field_plus_erratum" or not check.endswith("%") else float(check[10:-1]) / 100
    return verdict(ip, cor, rule, margin, max(float(share), 1e-9))[0]


def scores(rows: list[dict], check: str, margin: float | None, rule: str = "flip", paper: bool = False,
           truth_key: str = "needed") -> dict:
    """Precision, recall (Wilson 95%) and counts of a check's verdicts against the truth: the row's
    ``needed`` (the in-place decision differs from the full re-prefill's) or ``planted_needed``
    (a planted model's notes carry the majority of the decision, :func:`planted_truth`)."""
    from kvnotes.harness.stats import proportion

    pred = [r["checks"][check]["paper"] if paper else row_verdict(r, check, rule, margin or 0.0) for r in rows]
    truth = [bool(r[truth_key]) for r in rows]
    tp = sum(p and t for p, t in zip(pred, truth))
    fp = sum(p and not t for p, t in zip(pred, truth))
    fn = sum(t and not p for p, t in zip(pred, truth))
    return {"margin": margin, "n": len(rows), "positives": sum(truth), "tp": tp, "fp": fp, "fn": fn,
            "precision": proportion(tp, tp + fp), "recall": proportion(tp, tp + fn),
            "accuracy": proportion(sum(p == t for p, t in zip(pred, truth)), len(rows))}


def auto_outcome(rows: list[dict], check: str, rule: str, margin: float) -> dict:
    """What ``edit(mode="auto", fallback="full")`` would have done on ``rows``: its decision agrees with
    the full re-prefill unless the verdict missed an in-place failure; its cost is the diagnostic's
    tokens plus a full re-prefill on every "needed" verdict (mean share of the full re-prefill's tokens)."""
    from kvnotes.harness.stats import proportion

    pred = [row_verdict(r, check, rule, margin) for r in rows]
    agree = sum(p or not r["needed"] for p, r in zip(pred, rows))
    cost = [r["checks"][check]["tokens"] / r["full_tokens"] + (1.0 if p else 0.0) for p, r in zip(pred, rows)]
    return {"agrees_with_full": proportion(agree, len(rows)), "mean_tokens_over_full": float(np.mean(cost)) if cost else None}


def f1(s: dict) -> float:
    p, r = s["precision"]["p"] or 0.0, s["recall"]["p"] or 0.0
    return 2 * p * r / (p + r) if p + r else 0.0


def choose_margin(rows: list[dict], check: str, rule: str, grid: list[float], truth_key: str = "needed") -> float:
    """The margin with the best F1 against ``truth_key`` on ``rows`` (ties: the margin nearest 0)."""
    return max(grid, key=lambda m: (f1(scores(rows, check, m, rule, truth_key=truth_key)), -abs(m)))


def planted_truth(model) -> bool | None:
    """A planted model's ground truth for the diagnostic (:mod:`kvnotes.models.planted`): the
    in-place field refresh moves only the share the decision reads from the field, so it cannot
    decide like the full re-prefill where the notes carry the majority (``notes.share > 0.5``).
    None for a model without planted truth.

    None too at a share of exactly 0.5 (the refreshed decision is a tie: no truth to score).
    """
    from kvnotes.models.planted import TRUTH_KEY

    truth = getattr(model.config, TRUTH_KEY, None)
    if truth is None or truth["notes"]["share"] == 0.5:
        return None
    return bool(truth["notes"]["share"] > 0.5)


def model_configs(name: str, alphas: list[float] | None) -> list:
    """The model configs to measure: ``conf/model/<name>`` (its defaults merged), once per alpha of
    ``--alphas`` for the planted ``mixed`` family.

    Raises:
        KvnotesError: ``--alphas`` for a model that is not a planted ``mixed`` one.
    """
    from omegaconf import OmegaConf

    from kvnotes.errors import KvnotesError
    from kvnotes.models.planted import PlantedSpec
    from kvnotes.models.zoo import zoo_config

    mcfg = zoo_config(name)
    if not alphas:
        return [mcfg]
    if (mcfg.get("planted") or {}).get("family") != "mixed":
        raise KvnotesError(f"--alphas: model '{name}' is not a planted mixed-family model (try --model planted-mixed)")
    if 0.5 in alphas:
        raise KvnotesError("--alphas: alpha 0.5 leaves the refreshed decision a tie (no truth to score); drop it")
    cfgs = [OmegaConf.merge(mcfg, {"planted": {"alpha": a}}) for a in alphas]
    for cfg in cfgs:
        PlantedSpec.of(cfg.planted)                      # alpha in [0, 1], before any model is built
    return cfgs


def measure(args) -> dict:
    """Run the model (each of ``--alphas``) over the suite's pairs: the measurement (``rows``) and its
    provenance.

    Raises:
        KvnotesError: bad ``--alphas`` (:func:`model_configs`) or a transcript suite, before any model loads.
    """
    from omegaconf import OmegaConf

    from kvnotes.errors import KvnotesError
    from kvnotes.harness.pairs import prepare_pairs, template_kwargs, transcript_turns
    from kvnotes.models.loading import load_model
    from kvnotes.models.planted import TRUTH_KEY

    mcfgs = model_configs(args.model, args.alphas)
    sc = OmegaConf.merge(OmegaConf.load(CONF_DIR / "scenario/default.yaml"),
                         OmegaConf.load(CONF_DIR / "scenario" / f"{args.scenario}.yaml"))
    sc.pop("defaults", None)  # type: ignore[call-arg]   # a DictConfig (the merge of two mappings)
    if transcript_turns(sc) is not None:
        raise KvnotesError(f"--scenario {args.scenario}: a transcript suite; the editable context renders the "
                           f"one-message layout, so bench auto does not take it yet")
    if args.n_instances:
        sc.n_instances = args.n_instances
    rows: list[dict] = []
    t0 = time.perf_counter()
    for mcfg in mcfgs:
        bundle = load_model(mcfg, args.device)
        needed = planted_truth(bundle.model)
        tk = template_kwargs(mcfg)
        ps = prepare_pairs(bundle.tokenizer, sc, template_kwargs=tk or None)
        pairs = ps.pairs[: args.max_pairs] if args.max_pairs else ps.pairs
        for p in pairs:
            row = pair_row(bundle.model, bundle.tokenizer, p, args.checks, bool(sc.get("chat_template", True)), tk or None)
            if needed is not None:
                row |= {"alpha": getattr(bundle.model.config, TRUTH_KEY)["alpha"], "planted_needed": needed}
            rows.append(row)
    return {"model": args.model, "scenario": args.scenario, "checks_run": list(args.checks),
            "alphas": args.alphas, "wall_seconds": time.perf_counter() - t0, "load_average": os.getloadavg()[0],
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "command": "kvnotes bench auto " + " ".join(sys.argv[1:]), "rows": rows}


def fmt(p: dict) -> str:
    """A share with its Wilson interval and counts."""
    if p["p"] is None:
        return f"n/a (0/{p['n']})"
    return f"{p['p']:.2f} [{p['ci'][0]:.2f},{p['ci'][1]:.2f}] {p['k']}/{p['n']}"


def summarize(out: dict, margins: list[float]) -> dict:
    """Score every check under both rules: all owned pairs at margin 0, and held-out instances at the
    margin chosen on selection instances. Prints the table and returns ``out`` with ``summary``."""
    from kvnotes.context import RULES
    from kvnotes.harness.selection import split_instances

    rows = out["rows"]
    owned = [r for r in rows if r["full_owned"]]
    sel_ids, held_ids = split_instances(owned, 0.5, seed=0)
    sel = [r for r in owned if r["instance"] in sel_ids]
    held = [r for r in owned if r["instance"] in held_ids]
    summary = {"pairs": len(rows), "excluded_full_not_owned": len(rows) - len(owned),
               "needed": sum(r["needed"] for r in owned), "selection_pairs": len(sel), "held_out_pairs": len(held),
               "prompt_as_harness": sum(r["same_prompt_as_harness"] for r in rows), "margins": margins, "rules": {}}
    print(f"# kvnotes bench auto: {out['model']} ({out['threads']} threads), scenario {out['scenario']}: "
          f"{len(rows)} aligned pairs, {len(owned)} with an owned full-re-prefill decision, {summary['needed']} where "
          f"the in-place edit differs from it; selection/held-out {len(sel)}/{len(held)} pairs; "
          f"measured in {out['wall_seconds']:.0f} s, load average {out['load_average']:.1f}")
    truths = ["needed", "planted_needed"] if owned and all("planted_needed" in r for r in owned) else ["needed"]
    if len(truths) == 2:
        summary["planted_needed"] = sum(r["planted_needed"] for r in owned)
        summary["planted_disagrees_with_full"] = sum(r["planted_needed"] != r["needed"] for r in owned)
        print(f"# planted truth (alphas {sorted({r['alpha'] for r in owned})}): the notes carry the majority on "
              f"{summary['planted_needed']} owned pairs; the full re-prefill's truth differs from it on "
              f"{summary['planted_disagrees_with_full']}")
    print(f"{'check':<20} {'rule':<14} {'margin':>6} {'precision (all, m=0)':>26} {'recall (all, m=0)':>24} "
          f"{'precision (held-out)':>26} {'recall (held-out)':>24} {'tokens/full':>11} {'time/full':>9} "
          f"{'auto = full (m=0)':>24} {'auto cost':>10}")
    for check in out["checks_run"]:
        tok = float(np.median([r["checks"][check]["tokens"] / r["full_tokens"] for r in rows]))
        sec = float(np.median([r["checks"][check]["seconds"] / r["full_seconds"] for r in rows]))
        for truth, rule in itertools.product(truths, RULES):
            m = choose_margin(sel, check, rule, margins, truth) if sel else 0.0
            allm0, ho = scores(owned, check, 0.0, rule, truth_key=truth), scores(held, check, m, rule, truth_key=truth)
            auto = auto_outcome(owned, check, rule, 0.0)
            label = rule if truth == "needed" else f"{rule}/pl"
            summary["rules"][f"{check}/{label}"] = {"check": check, "rule": rule, "truth": truth, "margin": m,
                                                    "all_margin0": allm0, "held_out": ho, "tokens_over_full": tok,
                                                    "seconds_over_full": sec, "auto_margin0": auto}
            print(f"{check:<20} {label:<14} {m:>6.2f} {fmt(allm0['precision']):>26} {fmt(allm0['recall']):>24} "
                  f"{fmt(ho['precision']):>26} {fmt(ho['recall']):>24} {tok:>11.3f} {sec:>9.2f} "
                  f"{fmt(auto['agrees_with_full']):>24} {auto['mean_tokens_over_full']:>10.2f}")
    if "field_plus_erratum" in out["checks_run"]:
        pr = summary["paper_rule"] = scores(owned, "field_plus_erratum", None, paper=True)
        print(f"{'field_plus_erratum':<20} {'paper':<14} {'p>0.2':>6} {fmt(pr['precision']):>26} {fmt(pr['recall']):>24}")
    out["summary"] = summary
    return out


def check_arg(text: str) -> str:
    """An argparse ``type`` for ``--checks``: ``field_plus_erratum``, ``selective@K`` or ``selective@P%``.

    Raises:
        KvnotesError: another value.
    """
    from kvnotes.context import parse_mode
    from kvnotes.errors import KvnotesError

    if text != "field_plus_erratum":
        try:
            kind, _ = parse_mode(text)
        except KvnotesError:
            kind = None
        if kind != "selective":
            raise KvnotesError(f"--checks: unknown check '{text}' (field_plus_erratum, selective@K or selective@P%)")
    return text


#: The columns of a measured row that re-scoring reads (:func:`summarize`).
ROW_KEYS = ("pair", "scenario", "instance", "same_prompt_as_harness", "full_owned", "needed")


def from_json(path: str) -> dict:
    """The measurement an earlier ``--json`` wrote (its ``rows``, ``checks_run`` and provenance).

    Raises:
        KvnotesError: the file cannot be read, is not JSON, lacks ``rows`` / ``checks_run``, or a row
            lacks a column re-scoring reads (:data:`ROW_KEYS`).
    """
    from kvnotes.errors import KvnotesError

    try:
        out = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KvnotesError(f"--from-json: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise KvnotesError(f"--from-json: {path}: not JSON ({exc})") from None
    missing = [k for k in ("rows", "checks_run", "model", "scenario", "threads", "wall_seconds", "load_average")
               if not isinstance(out, dict) or k not in out]
    if missing:
        raise KvnotesError(f"--from-json: {path}: not a kvnotes bench auto --json output (no {', '.join(missing)})")
    rows = out["rows"]
    for i, row in enumerate(rows if isinstance(rows, list) else [None]):
        lacking = [k for k in ROW_KEYS if not isinstance(row, dict) or k not in row]
        if lacking:
            raise KvnotesError(f"--from-json: {path}: rows[{i}] is not a measured row (no {', '.join(lacking)})")
    return out


def main() -> None:
    """Measure (or re-score ``--from-json``) and print the table (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model, scenario or check, a count below 1, an unreadable
            ``--from-json``) before the model loads.
    """
    from kvnotes.cli.errors import conf_name, int_at_least

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    add_machine_flags(ap)
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"), help="conf/model entry")
    ap.add_argument("--scenario", default="small", type=conf_name("scenario", "--scenario"), help="conf/scenario entry")
    ap.add_argument("--n-instances", type=int_at_least("--n-instances", 1), default=None,
                    help="override the scenario's instances per scenario")
    ap.add_argument("--checks", nargs="+", type=check_arg,
                    default=["field_plus_erratum", "selective@25%", "selective@50%", "selective@75%"],
                    help="diagnostic checks whose verdicts are scored (EditableContext.diagnose)")
    ap.add_argument("--margins", nargs="+", type=float, default=[-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0],
                    help="candidate margins in nats; one is chosen on selection instances")
    ap.add_argument("--alphas", nargs="+", type=float, default=None,
                    help="planted mixed family only: measure one planted model per field share alpha (not 0.5) "
                         "and score the verdicts against the planted truth too")
    ap.add_argument("--max-pairs", type=int_at_least("--max-pairs", 1), default=None,
                    help="pairs evaluated at most (default: every pair)")
    ap.add_argument("--from-json", metavar="FILE", help="re-score the rows of an earlier --json (no model run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = from_json(args.from_json) if args.from_json else measure(args)
    out = summarize(out, args.margins)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
