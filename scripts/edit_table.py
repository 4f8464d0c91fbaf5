#!/usr/bin/env python
"""Print the tables of an ``edit`` record (numbers from the record only; :func:`kvnotes.tables.edit_table`).

    python scripts/edit_table.py runs/smollm2-135m/edit/small/record.json [...cot record]
"""

from __future__ import annotations

import sys

from kvnotes.records import load_record
from kvnotes.tables import edit_table


def main() -> None:
    """Print the tables of every record path given on the command line."""
    for path in sys.argv[1:]:
        print(edit_table(load_record(path)))


if __name__ == "__main__":
    main()
