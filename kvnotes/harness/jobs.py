"""One job: composed run config -> model -> pairs -> probe -> record. ``run.py`` (Hydra's entry
point) and the zoo conformance lane (``tests/lanes/test_zoo.py``) call :func:`run_job`, so the lane
exercises the command line's own path.

User errors (:data:`kvnotes.harness.runconfig.USER_ERRORS`) propagate as exceptions; ``run.py`` turns them
into one line and exit status 2. No record is written unless the probe completed.

**What a run found**, said when it ends: one summary line, and a warning when no decision flipped.
A record holds every pair and every exclusion, but a user who only reads the terminal should not
have to open it (or run ``kvnotes ownership-scan``) to learn that the probe measured nothing.
:func:`outcome_lines` reads a probe's result and the job's pairs and says: how many pairs were
token-aligned, how many flip under the run's flip rule, and the exclusions by reason (most frequent
first); when none flips, a warning names the top reason with one example in the model's own words
(its top-1 token and probability against the expected candidate, the columns of
:func:`kvnotes.harness.readout.ownership_columns`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvnotes.harness.pairs import pair_meta
from kvnotes.harness.tokens import rendering
from kvnotes.records import store


def load_bundle(cfg: Any):
    """The :class:`kvnotes.models.loading.ModelBundle` of a run config (``cfg.model`` on ``cfg.device``)."""
    from kvnotes.models.loading import load_model

    return load_model(cfg.model, cfg.device)


def run_job(cfg: Any, out_dir: Path, hydra_info: dict, log: Callable[[str], None] = print,
            bundle: Any = None, clean_runs: Any = None, pair_sets: dict | None = None) -> Path:
    """Run the probe of a composed run config and write its record under ``out_dir``.

    Args:
        cfg: the composed run config (``conf/config.yaml`` with model, probe, scenario chosen).
        out_dir: the job's directory; the record is ``out_dir/record.json``.
        hydra_info: ``{choices, overrides, output_dir, mode}`` of the Hydra run, kept in the record.
        log: where progress lines go.
        bundle: an already loaded model for ``cfg.model`` (the conformance lane reuses one per zoo
            entry); None loads it.
        clean_runs: a :class:`kvnotes.harness.kit.CleanRuns` store shared by the jobs of one model
            (prompts prefilled once for all of them; the numbers are the same without it), or None.
        pair_sets: pair sets already prepared for this model and scenario, by kind (``field``,
            ``polarity``): read, and filled with the ones this job prepares (``kvnotes battery``
            prepares each kind once for all its probes), or None.

    Returns:
        the record path. The probe's ``warnings`` (what it could not measure, and why) are kept in
        the record and said on stderr, one ``kvnotes: warning:`` line each (:func:`warning_lines`).

    Raises:
        KvnotesError, ScenarioError: bad input (nothing written): among them the probe's own checks
            of the run settings, before the model loads (:func:`kvnotes.harness.registry.check_run`),
            and a probe value the loaded model cannot take (:class:`kvnotes.errors.ModelFitError`).
    """
    from omegaconf import OmegaConf

    from kvnotes.harness import registry
    from kvnotes.errors import KvnotesError
    from kvnotes.harness.inputs import record_inputs
    from kvnotes.harness.pairs import prepare_for_probe
    from kvnotes.records.store import RECORD_NAME, Timer, to_jsonable, write_atomic
    from kvnotes.records.envelope import check_record
    from kvnotes.records.schema import check_result, result_schema

    record_path = Path(out_dir) / RECORD_NAME
    timer = Timer()
    t0 = time.perf_counter()
    probe_cfg = registry.typed_config(cfg.probe)
    probe_run = registry.get(probe_cfg)
    registry.check_variant(probe_cfg, cfg.scenario.get("variant", "direct"), bool(cfg.model.get("thinking")))
    registry.check_run(probe_cfg, cfg)                                  # the probe's own checks of the run
    with timer("load_model"):
        if bundle is None:
            log(f"kvnotes: loading {cfg.model.name} ...")            # the first load of an embedded model takes minutes
        bundle = bundle if bundle is not None else load_bundle(cfg)
    inputs = record_inputs(cfg)                                         # after the load: a hub snapshot is local now
    with timer("pairs"):
        pair_sets = {} if pair_sets is None else pair_sets
        if probe_cfg.pairs not in pair_sets:
            pair_sets[probe_cfg.pairs] = prepare_for_probe(bundle.tokenizer, probe_cfg.pairs, cfg.scenario, cfg.model)
        pairs = pair_sets[probe_cfg.pairs]
    if not pairs.pairs and probe_cfg.pairs != "none":
        raise KvnotesError(f"no token-aligned pairs in scenario '{cfg.scenario.name}' "
                           f"(excluded: {pairs.exclusion_counts()})")
    ctx = registry.ProbeContext.from_run_config(cfg, probe_cfg, bundle, pairs, timer, clean_runs)
    with timer("probe"):
        result = probe_run(ctx)
    result = to_jsonable(result)
    check_result(result, result_schema(registry.module(probe_cfg)))       # the declared Result
    record = complete_record(OmegaConf.to_container(cfg, resolve=True), hydra_info, bundle, pairs, cfg.scenario,
                             result, timer.stages | {"total": time.perf_counter() - t0})
    record["inputs"] = inputs
    check_record(to_jsonable(record))                                   # the published envelope
    write_atomic(record_path, record)
    log(f"kvnotes: wrote {record_path}")
    for line in outcome_lines(result, pairs, bundle.tokenizer, str(cfg.flip_rule)):
        log(line)
    for line in warning_lines(result):
        print(line, file=sys.stderr)
    if cfg.plot:
        from kvnotes.plots import plot_record

        for path in plot_record(record, out_dir):
            log(f"kvnotes: wrote {path}")
    return record_path


def warning_lines(result: dict) -> list[str]:
    """``kvnotes: warning: <line>`` for each entry of the result's ``warnings``: what a probe could not
    measure and why (e.g. an analysis left empty because no pair was on a selection instance), said
    on stderr as well as kept in the record, each on one line."""
    return [f"kvnotes: warning: {' '.join(str(w).split())}" for w in result.get("warnings") or ()]


def complete_record(cfg: dict, hydra: dict, bundle, pairs, scenario_cfg, result: dict, timing: dict) -> dict:
    """A complete record of one probe run: provenance (:func:`new_record`), the model as loaded and
    the attention implementation actually used (an engine such as the TransformerLens bridge may
    switch it during the probe), the scenario suite and its rendering, the probe's ``result``
    (already JSON-able and checked against its schema), the stage ``timing`` in seconds, and the
    pairs' decoded tokens (:func:`prompt_tokens`), so figures and reports need no model.

    Args:
        cfg: the resolved run config (``conf/config.yaml`` composed), as a dict.
        bundle: the :class:`kvnotes.models.loading.ModelBundle` the probe ran on.
        pairs: the :class:`kvnotes.harness.pairs.PairSet` it was given.
    """
    model_info = bundle.info | {"attn_implementation_loaded": bundle.info.get("attn_implementation"),
                                "attn_implementation": bundle.attn_implementation}
    record = store.new_record(cfg["probe"]["name"], cfg, hydra, model_info, int(cfg["seed"]))
    record["scenario"] = {"name": scenario_cfg.name, "n_scenarios": len(pairs.scenarios),
                          "n_pairs_aligned": len(pairs.pairs), "n_excluded": len(pairs.excluded),
                          "families": sorted({s.family for s in pairs.scenarios}),
                          "rendering": rendering(bundle.tokenizer, bool(scenario_cfg.get("chat_template", True)))}
    record["prompts"] = prompt_tokens(bundle.tokenizer, pairs)
    record["vocab"] = row_vocabulary(bundle.tokenizer, result)
    record["result"] = result
    record["timing"] = timing
    record["status"] = "complete"
    return record


def row_vocabulary(tokenizer, result: dict) -> dict[str, str]:
    """The decoded text of every token id the rows name as a clean run's top-1 (``top1_id_*``), so a
    reader shows the model's answers without its tokenizer."""
    ids = {int(v) for row in result.get("rows", []) for k, v in row.items()
           if k.startswith("top1_id_") and isinstance(v, int)}
    return {str(i): tokenizer.decode([i]) for i in sorted(ids)}


def prompt_tokens(tokenizer, pairs) -> dict:
    """What a reader needs to show a pair without the model: per aligned pair id, the old prompt's
    tokens decoded one by one (their concatenation is the rendered prompt), the new value's field
    tokens, the field span ``[a, b)``, the decision position and the candidates' texts."""
    out = {}
    for pair in pairs.pairs:
        a, b = pair.field
        out[pair_meta(pair.spec)["pair"]] = {
            "tokens": tokenizer.batch_decode([[int(i)] for i in pair.old.ids]),
            "new_field": tokenizer.batch_decode([[int(i)] for i in pair.new.ids[a:b]]),
            "field": [a, b], "decision": pair.decision,
            "cand_old": tokenizer.decode(list(pair.cand_old)), "cand_new": tokenizer.decode(list(pair.cand_new)),
        }
    return out


# ---------------------------------------------------------------------------------------------
# what a run found


def _example(rows: list[dict], reason: str, pairs: Any, tokenizer: Any) -> str:
    """One pair excluded for ``reason``, in words: which clean run answered what instead of its
    expected candidate (``not_owned``), or its effect in nats (the other reasons); ``""`` if no
    excluded row carries the columns."""
    by_id = {pair_meta(p.spec)["pair"]: p for p in getattr(pairs, "pairs", [])}
    for row in rows:
        if row.get("reason") != reason:
            continue
        pair = by_id.get(row.get("pair"))
        if reason == "not_owned" and pair is not None:
            for side, cand in (("old", pair.cand_old), ("new", pair.cand_new)):
                if row.get(f"owns_{side}") is False and row.get(f"top1_id_{side}") is not None:
                    top = tokenizer.decode([int(row[f"top1_id_{side}"])])
                    want = tokenizer.decode([int(cand[0])])
                    return (f"e.g. pair {row['pair']}: the {side} run's top-1 is {top!r} "
                            f"(p={float(row[f'p_top1_{side}']):.3f}), not the expected {want!r}")
        if row.get("effect") is not None:
            return f"e.g. pair {row['pair']}: effect {float(row['effect']):+.3f} nats"
    return ""


def outcome_lines(result: dict, pairs: Any, tokenizer: Any, flip_rule: str) -> list[str]:
    """The lines a job prints about what it found (module docstring).

    Args:
        result: the probe's result (``rows``, ``exclusions``, ``excluded``).
        pairs: the :class:`kvnotes.harness.pairs.PairSet` the probe was given (empty for probes
            that take no pairs: then nothing is said).
        tokenizer: decodes the example's tokens.
        flip_rule: the run's flip rule, named in the line.

    Returns:
        ``["kvnotes: found: ..."]``, plus ``"kvnotes: warning: ..."`` when no pair flips.
    """
    aligned, at_tokens = len(getattr(pairs, "pairs", [])), len(getattr(pairs, "excluded", []))
    if not aligned and not at_tokens:
        return []
    rows = result.get("rows") or []
    excluded = result.get("excluded") or []
    exclusions = {str(k): int(v) for k, v in (result.get("exclusions") or {}).items() if v}
    screened = [r for r in rows if "flips" in r]
    if not exclusions:                       # a probe that reports every pair as a row (screen) counts none
        exclusions = dict(Counter(str(r["reason"]) for r in [*excluded, *screened]
                                  if r.get("flips") is not True and r.get("reason")))
    n_flip = sum(r["flips"] is True for r in screened) if screened else len(rows)
    ranked = sorted(exclusions.items(), key=lambda kv: (-kv[1], kv[0]))
    why = ", ".join(f"{k} {v}" for k, v in ranked) or "none"
    tokens = f" ({at_tokens} more not token-aligned)" if at_tokens else ""
    lines = [f"kvnotes: found: {aligned} token-aligned pairs{tokens}, {n_flip} flip under the {flip_rule} "
             f"rule; excluded by reason: {why}"]
    if n_flip == 0:
        top, count = ranked[0] if ranked else ("none given", 0)
        example = _example(excluded + rows, top, pairs, tokenizer)
        lines.append(f"kvnotes: warning: no decision flipped under the {flip_rule} rule, so the probe's "
                     f"measurements are empty; the top reason is {top} ({count} pairs)"
                     + (f"; {example}" if example else "")
                     + " (kvnotes ownership-scan shows every prompt's top-1)")
    return lines
