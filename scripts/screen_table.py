#!/usr/bin/env python
"""Print the per-family (or per-scenario) screen table of a ``screen`` record as Markdown
(:func:`kvnotes.tables.screen_table`).

    python -m scripts.screen_table runs/smollm2-135m/screen/default/record.json
    python -m scripts.screen_table runs/smollm2-135m/screen/default/record.json --by scenario
"""

import argparse
import sys

from kvnotes.records import load_record
from kvnotes.tables import screen_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("record")
    ap.add_argument("--by", choices=("family", "scenario"), default="family", help="rows of the table")
    args = ap.parse_args()
    rec = load_record(args.record)
    if rec["probe"] != "screen":
        sys.exit(f"kvnotes: error: {args.record} is a '{rec['probe']}' record, not 'screen'")
    print(screen_table(rec, args.by), end="")


if __name__ == "__main__":
    main()
