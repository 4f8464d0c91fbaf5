#!/usr/bin/env python
"""Print the table of an ``agent`` record (numbers from the record only; :func:`kvnotes.tables.agent_table`).

    python -m scripts.agent_table runs/smollm2-135m/agent/default/record.json
"""

from __future__ import annotations

import sys

from kvnotes.records import load_record
from kvnotes.tables import agent_table


def main() -> None:
    """Print the tables of every record path given on the command line."""
    for path in sys.argv[1:]:
        print(agent_table(load_record(path)))


if __name__ == "__main__":
    main()
