#!/usr/bin/env python
"""``kvnotes locomo``: LoCoMo question answering with transplanted conversation memory against a
full prefill, as a command: ``probe=locomo`` (:mod:`kvnotes.probes.locomo`) on ``--data FILE`` through
``kvnotes run``'s own job path (its record under ``--out-root``, reused while the file, model and
settings are unchanged), and its report printed.

    kvnotes locomo --data locomo10.json [--model smollm2-135m] [--max-questions 50] [--json out.json]

The same job: ``python run.py probe=locomo scenario=locomo scenario.locomo=locomo10.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


def main() -> None:
    """Run ``probe=locomo`` on the flags' settings and print its report.

    Raises:
        KvnotesError: a bad flag (an unknown model, a count below its least value, malformed
            categories), a malformed LoCoMo file; all before the model loads.
    """
    from kvnotes.cli.errors import conf_name, float_at_least, int_at_least
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    add_machine_flags(ap, device="auto")
    ap.add_argument("--data", required=True, help="a LoCoMo JSON file (data/locomo10.json of snap-research/locomo)")
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"),
                    help="conf/model entry (default smollm2-135m)")
    ap.add_argument("--max-questions", type=int_at_least("--max-questions", 1), default=None,
                    help="most questions in all (default every one)")
    ap.add_argument("--max-new-tokens", type=int_at_least("--max-new-tokens", 1), default=32,
                    help="most answer tokens per arm")
    ap.add_argument("--categories", default="1,2,3,4",
                    help="question categories, comma-separated (default 1,2,3,4; 5 is adversarial)")
    ap.add_argument("--max-context", type=int_at_least("--max-context", 1), default=None,
                    help="most prompt + answer tokens (default: the model's max_position_embeddings)")
    ap.add_argument("--seam", type=int_at_least("--seam", 0), default=0, help="chunk tokens recomputed at each seam")
    ap.add_argument("--no-rotate", action="store_true", help="the control: chunk keys keep their precompiled positions")
    ap.add_argument("--margin", type=float_at_least("--margin", 0.0, strict=True), default=0.05,
                    help="declared TOST margin on the F1 difference")
    ap.add_argument("--out-root", default="runs", help="where the record goes (as kvnotes run out_root=...)")
    args = ap.parse_args()
    try:
        categories = [int(c) for c in args.categories.split(",")]
    except ValueError:
        raise KvnotesError(f"--categories: expected comma-separated integers, got '{args.categories}'") from None

    import torch

    from kvnotes.cli.run import compose_jobs, quiet_job, quoted, run_or_reuse
    from kvnotes.probes.locomo import locomo_table
    from kvnotes.records.store import load_record

    torch.set_num_threads(args.threads)
    null = "null"
    overrides = [f"model={args.model}", "probe=locomo", "scenario=locomo", f"scenario.locomo={quoted(args.data)}",
                 f"probe.max_questions={args.max_questions or null}", f"probe.max_new_tokens={args.max_new_tokens}",
                 f"probe.categories=[{','.join(map(str, categories))}]", f"probe.max_context={args.max_context or null}",
                 f"probe.seam={args.seam}", f"probe.rotate={str(not args.no_rotate).lower()}",
                 f"probe.margin={args.margin}", *quiet_job(args.out_root, args.device)]
    (job,) = compose_jobs([overrides])                  # the LoCoMo file is read and checked before the model loads
    record = load_record(run_or_reuse(job.cfg, job.out_dir, job.hydra_info))
    print(locomo_table(record))
    if args.json:
        res = record["result"]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "data": str(args.data), "record": str(job.out_dir),
                                               "command": " ".join(sys.argv), "records": res["rows"],
                                               "summary": res["aggregates"], "config": res["config"]}, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
