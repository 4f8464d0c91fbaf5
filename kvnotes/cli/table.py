"""``kvnotes table``: Markdown tables from records (:mod:`kvnotes.records.tables`).

    kvnotes table runs/smollm2-135m/screen/default/record.json [--by scenario]
    kvnotes table runs/smollm2-135m/edit/small/record.json runs/smollm2-135m/agent/default/record.json
    kvnotes table --results runs/smollm2-135m --suite small

Each record gets its probe's table (probes without one: their aggregates), then its verdicts;
``--results`` joins, per family, the records of one model and suite whose probes declare results
columns (``PRESENTATION.results``).
Every number is read from a record. Every record is read and checked (its envelope, a ``result``)
and every table made before anything is printed: a bad record is one ``kvnotes: error:`` line
naming the file and the key, exit status 2, and no table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from kvnotes.cli.helptext import PlainHelpFormatter


def main() -> None:
    """Print the tables (see the module docstring).

    Raises:
        KvnotesError: an unreadable or invalid record (naming the file and the key), no record under
            ``--results``.
        SystemExit: 2 on a flag error (argparse).
    """
    from kvnotes.errors import KvnotesError
    from kvnotes.records.envelope import read_record, reading
    from kvnotes.records.tables import record_table, results_table, suite_records

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    ap.add_argument("records", nargs="*", help="record.json files or their directories")
    ap.add_argument("--by", choices=("family", "scenario"), default="family", help="rows of a screen table")
    ap.add_argument("--results", metavar="DIR", help="runs/<model>: the per-family results table of a suite")
    ap.add_argument("--suite", default="default", help="the suite of --results")
    args = ap.parse_args()
    if not args.records and not args.results:
        ap.error("give record paths or --results DIR")
    out = []
    if args.results:
        if not Path(args.results).is_dir():
            raise KvnotesError(f"--results: {args.results}: no such directory")
        recs = suite_records(args.results, args.suite, read_record)
        if not recs:
            raise KvnotesError(f"no record with results columns under {args.results}/*/{args.suite}")
        with reading(f"{args.results}/*/{args.suite}", "results table"):
            out.append(results_table(recs))
    records = [(path, read_record(path)) for path in args.records]        # every record checked first
    for path, rec in records:
        with reading(path, "table"):
            out.append(record_table(rec, by=args.by))
    print("".join(out), end="")


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
