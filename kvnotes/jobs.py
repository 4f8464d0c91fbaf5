"""One job: composed run config -> model -> pairs -> probe -> record. ``run.py`` (Hydra's entry
point) and the zoo conformance lane (``tests/test_zoo.py``) call :func:`run_job`, so the lane
exercises the command line's own path.

User errors (:data:`kvnotes.errors.USER_ERRORS`) propagate as exceptions; ``run.py`` turns them
into one line and exit status 2. No record is written unless the probe completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_bundle(cfg: Any):
    """The :class:`kvnotes.models.ModelBundle` of a run config (``cfg.model`` on ``cfg.device``)."""
    from kvnotes.models import load_model

    return load_model(cfg.model, cfg.device)


def run_job(cfg: Any, out_dir: Path, hydra_info: dict, log: Callable[[str], None] = print,
            bundle: Any = None) -> Path:
    """Run the probe of a composed run config and write its record under ``out_dir``.

    Args:
        cfg: the composed run config (``conf/config.yaml`` with model, probe, scenario chosen).
        out_dir: the job's directory; the record is ``out_dir/record.json``.
        hydra_info: ``{choices, overrides, output_dir, mode}`` of the Hydra run, kept in the record.
        log: where progress lines go.
        bundle: an already loaded model for ``cfg.model`` (the conformance lane reuses one per zoo
            entry); None loads it.

    Returns:
        the record path.

    Raises:
        KvnotesError, ScenarioError: bad input (nothing written).
    """
    from omegaconf import OmegaConf

    import probes
    from kvnotes.errors import KvnotesError
    from kvnotes.pairs import prepare_for_probe
    from kvnotes.records import RECORD_NAME, Timer, complete_record, to_jsonable, write_atomic
    from kvnotes.schema import check_result, result_schema

    record_path = Path(out_dir) / RECORD_NAME
    timer = Timer()
    t0 = time.perf_counter()
    probe_cfg = probes.typed_config(cfg.probe)
    probe_run = probes.get(probe_cfg)
    probes.check_variant(probe_cfg, cfg.scenario.get("variant", "direct"))
    with timer("load_model"):
        bundle = bundle if bundle is not None else load_bundle(cfg)
    with timer("pairs"):
        pairs = prepare_for_probe(bundle.tokenizer, probe_cfg.pairs, cfg.scenario, cfg.model)
    if not pairs.pairs:
        raise KvnotesError(f"no token-aligned pairs in scenario '{cfg.scenario.name}' "
                           f"(excluded: {pairs.exclusion_counts()})")
    ctx = probes.ProbeContext.from_run_config(cfg, probe_cfg, bundle, pairs, timer)
    with timer("probe"):
        result = probe_run(ctx)
    result = to_jsonable(result)
    check_result(result, result_schema(probes.module(probe_cfg)))       # the declared Result
    record = complete_record(OmegaConf.to_container(cfg, resolve=True), hydra_info, bundle, pairs, cfg.scenario,
                             result, timer.stages | {"total": time.perf_counter() - t0})
    write_atomic(record_path, record)
    log(f"kvnotes: wrote {record_path}")
    if cfg.plot:
        from kvnotes.plots import plot_record

        for path in plot_record(record, out_dir):
            log(f"kvnotes: wrote {path}")
    return record_path
