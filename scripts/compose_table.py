#!/usr/bin/env python
"""Markdown tables of a ``compose`` record (numbers from the record only; :func:`kvnotes.tables.compose_table`).

    python scripts/compose_table.py runs/smollm2-135m/compose/small/record.json
"""

from __future__ import annotations

import sys

from kvnotes.records import load_record
from kvnotes.tables import compose_table


def main() -> None:
    """Print the tables of every record path given on the command line."""
    for path in sys.argv[1:]:
        print(compose_table(load_record(path)), end="")


if __name__ == "__main__":
    main()
