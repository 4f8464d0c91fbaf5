"""``kvnotes table``: Markdown tables from records (:mod:`kvnotes.records.tables`).

    kvnotes table runs/smollm2-135m/screen/default/record.json [--by scenario]
    kvnotes table runs/smollm2-135m/edit/small/record.json runs/smollm2-135m/agent/default/record.json
    kvnotes table --results runs/smollm2-135m --suite small

Each record gets its probe's table (probes without one: their aggregates); ``--results`` joins the
screen, field_refresh, suffix_recovery and injection records of one model and suite per family.
Every number is read from a record.
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    from kvnotes.records.store import load_record
    from kvnotes.records.tables import record_table, results_table, screen_table, suite_records

    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", help="record.json files or their directories")
    ap.add_argument("--by", choices=("family", "scenario"), default="family", help="rows of a screen table")
    ap.add_argument("--results", metavar="DIR", help="runs/<model>: the per-family results table of a suite")
    ap.add_argument("--suite", default="default", help="the suite of --results")
    args = ap.parse_args()
    if args.results:
        recs = suite_records(args.results, args.suite)
        if not recs:
            sys.exit(f"kvnotes: error: no records under {args.results}/*/{args.suite}")
        print(results_table(recs), end="")
    if not args.records and not args.results:
        ap.error("give record paths or --results DIR")
    for path in args.records:
        try:
            rec = load_record(path)
        except (OSError, ValueError) as exc:
            sys.exit(f"kvnotes: error: cannot read record {path}: {exc}")
        print(screen_table(rec, args.by) if rec.get("probe") == "screen" else record_table(rec), end="")


if __name__ == "__main__":
    main()
