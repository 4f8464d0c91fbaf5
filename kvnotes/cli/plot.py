#!/usr/bin/env python
"""``kvnotes plot``: draw the figures of one or more records: ``kvnotes plot runs/.../record.json [-o DIR]``.

Figures are written next to each record unless ``-o`` is given. Numbers come only from records.
Every record is read and checked (its envelope, a ``result``) and every figure drawn into a
temporary directory before any is moved into place: a bad record is one ``kvnotes: error:`` line
naming the file and the key, exit status 2, and no figure written.
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from kvnotes.cli.helptext import PlainHelpFormatter


def main() -> None:
    """Draw the figures (see the module docstring).

    Raises:
        KvnotesError: an unreadable or invalid record (naming the file and the key), an ``-o`` that
            is not a writable directory.
        SystemExit: 2 on a flag error (argparse).
    """
    from kvnotes import existing_ancestor
    from kvnotes.cli.errors import check_writable
    from kvnotes.errors import KvnotesError
    from kvnotes.records.envelope import read_record, reading

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    ap.add_argument("records", nargs="+", help="record.json files or their directories")
    ap.add_argument("-o", "--out", help="output directory (default: beside each record)")
    args = ap.parse_args()
    if args.out:
        check_writable(args.out, "-o/--out", directory=True)
    jobs = []
    for r in args.records:                                     # every record checked before any figure
        p = Path(r)
        rec = read_record(p)
        out = Path(args.out) if args.out else (p if p.is_dir() else p.parent)
        jobs.append((p, rec, out))
    from kvnotes.plots import plot_record

    staged: list[tuple[Path, Path]] = []          # (drawn file in a temporary directory, its place)
    tmps = []
    try:
        for p, rec, out in jobs:
            tmp = Path(tempfile.mkdtemp(prefix=".kvnotes-plot-", dir=existing_ancestor(out)))
            tmps.append(tmp)
            with reading(p, "figures"):
                drawn = plot_record(rec, tmp)
            staged += [(Path(f), out / Path(f).relative_to(tmp)) for f in drawn]
        for src, dst in staged:                                # all drawn: move them into place
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            print(dst)
    except OSError as exc:
        raise KvnotesError(f"cannot write the figures: {exc}") from exc
    finally:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
