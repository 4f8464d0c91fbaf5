#!/usr/bin/env python
"""kvnotes entry point: compose config -> load model -> build pairs -> run probe -> write record.

    python run.py                                   # blast_radius on the embedded SmolLM2-135M
    python run.py model=qwen3-8b probe=screen       # a hub model (GPU)
    python run.py -m model=smollm2-135m probe=blast_radius,screen   # one record per job

Bad input (unknown model/probe/scenario, invalid scenario file, model unavailable offline) is
reported as one line on stderr with exit status 2, and no record is written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "probe", "scenario")


def fail(msg: str) -> None:
    print(f"kvnotes: error: {msg}", file=sys.stderr)
    sys.exit(2)


def remove_empty_dirs(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while empty, up to (not including) ``stop``."""
    path, stop = path.resolve(), stop.resolve()
    while path != stop and stop in path.parents and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


def check_choices(argv: list[str]) -> None:
    """Reject unknown config-group choices with one line before Hydra prints its own page."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS:
            continue
        known = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
        for choice in value.split(","):
            if choice and choice not in known:
                fail(f"unknown {key} '{choice}' (known: {', '.join(known)})")


def main() -> None:
    check_choices(sys.argv[1:])
    import hydra

    hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")(job)()


def job(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    import probes
    from kvnotes.errors import USER_ERRORS, KvnotesError
    from kvnotes.records import RECORD_NAME, Timer, complete_record, is_complete, write_atomic

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    record_path = out_dir / RECORD_NAME
    if is_complete(record_path) and not cfg.force:
        print(f"kvnotes: {record_path} is complete; skipping (force=true to re-run)")
        return
    timer = Timer()
    t0 = time.perf_counter()
    try:
        probe_cfg = probes.typed_config(cfg.probe)
        probe_run = probes.get(probe_cfg)
        probes.check_variant(probe_cfg, cfg.scenario.get("variant", "direct"))
        with timer("load_model"):
            from kvnotes.models import load_model

            bundle = load_model(cfg.model, cfg.device)
        with timer("pairs"):
            from kvnotes.pairs import prepare_for_probe

            pairs = prepare_for_probe(bundle.tokenizer, probe_cfg.pairs, cfg.scenario, cfg.model)
        if not pairs.pairs:
            raise KvnotesError(f"no token-aligned pairs in scenario '{cfg.scenario.name}' "
                               f"(excluded: {pairs.exclusion_counts()})")
        ctx = probes.ProbeContext.from_run_config(cfg, probe_cfg, bundle, pairs, timer)
        with timer("probe"):
            result = probe_run(ctx)
        from kvnotes.records import to_jsonable
        from kvnotes.schema import check_result, result_schema

        result = to_jsonable(result)
        check_result(result, result_schema(probes.module(probe_cfg)))       # the declared Result
    except USER_ERRORS as exc:
        remove_empty_dirs(out_dir, Path(cfg.out_root))
        fail(str(exc))
    hydra_info = {"choices": dict(hc.runtime.choices), "overrides": list(hc.overrides.task),
                  "output_dir": str(out_dir), "mode": str(hc.mode)}
    record = complete_record(OmegaConf.to_container(cfg, resolve=True), hydra_info, bundle, pairs, cfg.scenario,
                             result, timer.stages | {"total": time.perf_counter() - t0})
    write_atomic(record_path, record)
    print(f"kvnotes: wrote {record_path}")
    if cfg.plot:
        from kvnotes.plots import plot_record

        for path in plot_record(record, out_dir):
            print(f"kvnotes: wrote {path}")


if __name__ == "__main__":
    main()
