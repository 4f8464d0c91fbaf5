#!/usr/bin/env python
"""TTFT figure from ``bench_compose.py --json`` outputs (numbers from the JSON files only).

    kvnotes bench compose-plot docs/bench/bench_compose_gpu.json [more.json ...] --out docs/bench/bench_compose_ttft.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for path in args.inputs:
        rec = json.loads(Path(path).read_text())
        rows = rec["rows"]
        label = rec["header"].splitlines()[1].split(";")[0].replace("# model: ", "")
        label += f", seam {rec['args']['seam']}"
        L = [r["length"] for r in rows]
        ax.plot(L, [r["full"]["median_ms"] for r in rows], "o-", label=f"full prefill ({label})")
        ax.plot(L, [r["composed"]["median_ms"] for r in rows], "s--", label=f"composed ({label})")
        ax2.plot(L, [r["ratio_full_over_composed"] for r in rows], "o-", label=label)
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
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
