#!/usr/bin/env python
"""Which expected-flip pairs of some scenario files the model OWNS: a quick view for prompt work.

A pair is owned when it flips under the ``owned`` rule of :func:`kvnotes.harness.readout.pair_status` (the
candidate decision differs, ``|s_new - s_old| >= min_effect`` nats, and each clean run's top-1 token
over the whole vocabulary is its expected candidate's first token; ``flips_owned`` of ``probe=screen``).
The scan is ``probe=screen`` on the given files, run through ``kvnotes run``'s own job path (its record
under ``--out-root``, reused while the files, model and settings are unchanged), shown per scenario:
owned / expected-flip pairs, and for every clean run whose top-1 is not its candidate the top-1
token, its probability and the candidates' probability mass
(:func:`kvnotes.records.ownership.ownership_lines`).

    OMP_NUM_THREADS=1 kvnotes ownership-scan scenarios/suites/lookup scenarios/suites/language
    kvnotes ownership-scan scenarios/suites/lookup --n-instances 4 --seed 0 --quiet
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvnotes.cli.helptext import PlainHelpFormatter


def overrides(paths: list[str], model: str, n_instances: int, seed: int, variant: str, min_effect: float,
              device: str, out_root: str) -> list[str]:
    """The ``kvnotes run`` overrides of the scan: ``probe=screen`` on ``paths`` (the default suite's
    settings otherwise), the ``owned`` flip rule, no figures."""
    from kvnotes.cli.run import quiet_job, quoted

    return [f"model={model}", "probe=screen", "scenario=default", f"scenario.paths=[{','.join(map(quoted, paths))}]",
            f"scenario.n_instances={n_instances}", f"scenario.seed={seed}", f"scenario.variant={variant}",
            f"min_effect={min_effect}", "flip_rule=owned", *quiet_job(out_root, device)]


def main() -> None:
    """Scan (see the module docstring).

    Raises:
        KvnotesError: an unknown model, fewer than one instance, a negative seed or margin, a variant
            no selected scenario has; ScenarioError: a missing path or an invalid scenario file. All
            before the model loads.
    """
    from kvnotes.cli import add_machine_flags
    from kvnotes.cli.errors import conf_name, float_at_least, int_at_least, one_of
    from kvnotes.errors import KvnotesError
    from kvnotes.scenarios import load_suite

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__)
    ap.add_argument("paths", nargs="+", help="scenario files or directories")
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"), help="conf/model/<name>.yaml")
    ap.add_argument("--n-instances", type=int_at_least("--n-instances", 1), default=4, help='instances drawn per scenario')
    ap.add_argument("--seed", type=int_at_least("--seed", 0), default=0, help='instance generator seed')
    ap.add_argument("--variant", default="direct", type=one_of("--variant", ("direct", "cot")),
                    help="prompt variant of the scenarios: direct or cot")
    ap.add_argument("--min-effect", type=float_at_least("--min-effect", 0.0), default=1.0, help="flip margin in nats")
    ap.add_argument("--quiet", action="store_true", help="counts only, no per-prompt misses")
    ap.add_argument("--out-root", default="runs", help="where the screen record goes (as kvnotes run out_root=...)")
    add_machine_flags(ap, device="auto")
    args = ap.parse_args()

    import torch

    from kvnotes.cli.run import compose_jobs, run_or_reuse
    from kvnotes.records.ownership import ownership, ownership_lines
    from kvnotes.records.store import load_record

    torch.set_num_threads(args.threads)
    scenarios = load_suite(args.paths)           # every file checked before the model loads
    if not any(args.variant in sc.variants for sc in scenarios):
        known = sorted({v for sc in scenarios for v in sc.variants})
        raise KvnotesError(f"--variant: no selected scenario has variant '{args.variant}' (theirs: {', '.join(known)})")
    (job,) = compose_jobs([overrides(args.paths, args.model, args.n_instances, args.seed, args.variant,
                                     args.min_effect, args.device, args.out_root)])
    record = load_record(run_or_reuse(job.cfg, job.out_dir, job.hydra_info))
    print("\n".join(ownership_lines(record, args.quiet)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)      # checked writable before the model loaded
        Path(args.json).write_text(json.dumps({"model": args.model, "record": str(job.out_dir),
                                               "scenarios": ownership(record)}, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
