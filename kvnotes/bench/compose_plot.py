#!/usr/bin/env python
"""TTFT figure from ``bench_compose.py --json`` outputs (numbers from the JSON files only).

    kvnotes bench compose-plot docs/bench/bench_compose_gpu.json [more.json ...] --out docs/bench/bench_compose_ttft.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
from kvnotes.cli.helptext import PlainHelpFormatter

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_input(path: str) -> tuple[str, list[tuple[int, float, float, float]]]:
    """The label (model, seam) and the points ``(length, full ms, composed ms, full / composed)`` of
    one ``kvnotes bench compose --json`` output.

    Raises:
        KvnotesError: the file cannot be read, is not JSON, or lacks a key the figure reads.
    """
    from kvnotes.errors import KvnotesError

    try:
        rec = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KvnotesError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise KvnotesError(f"{path}: not JSON ({exc})") from None
    try:
        label = rec["header"].splitlines()[1].split(";")[0].replace("# model: ", "")
        label += f", seam {rec['args']['seam']}"
        points = [(r["length"], r["full"]["median_ms"], r["composed"]["median_ms"], r["ratio_full_over_composed"])
                  for r in rec["rows"]]
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise KvnotesError(f"{path}: not a kvnotes bench compose --json output ({type(exc).__name__}: {exc})") from None
    return label, points


def main() -> None:
    """Draw the figure (see the module docstring).

    Raises:
        KvnotesError: an input that is not a ``bench compose --json`` output, an ``--out`` that
            cannot be written; both before anything is drawn.
    """
    from kvnotes.cli.errors import output_file

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True, type=output_file("--out"), help='the PNG to write')
    args = ap.parse_args()
    inputs = [read_input(path) for path in args.inputs]          # every input checked before drawing
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, points in inputs:
        L = [p[0] for p in points]
        ax.plot(L, [p[1] for p in points], "o-", label=f"full prefill ({label})")
        ax.plot(L, [p[2] for p in points], "s--", label=f"composed ({label})")
        ax2.plot(L, [p[3] for p in points], "o-", label=label)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, median ms")
    ax2.set_ylabel("full / composed")
    ax2.axhline(1, color="k", lw=0.6)
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle("TTFT: composed (prefix + rotate + splice + seam + suffix) vs full prefill", fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
