#!/usr/bin/env python
"""``kvnotes plot``: draw the figures of one or more records: ``kvnotes plot runs/.../record.json [-o DIR]``.

Figures are written next to each record unless ``-o`` is given. Numbers come only from records.
"""

import argparse
import sys
from pathlib import Path


from kvnotes.plots import plot_record
from kvnotes.records.store import load_record


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__)
    ap.add_argument("records", nargs="+", help="record.json files or their directories")
    ap.add_argument("-o", "--out", help="output directory (default: beside each record)")
    args = ap.parse_args()
    for r in args.records:
        p = Path(r)
        try:
            rec = load_record(p)
        except (OSError, ValueError) as exc:
            sys.exit(f"kvnotes: error: cannot read record {p}: {exc}")
        out = Path(args.out) if args.out else (p if p.is_dir() else p.parent)
        out.mkdir(parents=True, exist_ok=True)
        for path in plot_record(rec, out):
            print(path)


if __name__ == "__main__":
    main()
