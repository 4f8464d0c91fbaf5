"""Figures of the ``read_location`` probe: decision-row attention mass per layer x key group, and
knockout score changes per layer band with CIs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title


def _subset(agg: dict, family: str) -> tuple[str, dict]:
    """The flipping-pair aggregate of a family when it has pairs, else all aligned pairs."""
    flip = agg["flipping"].get(family)
    if flip is not None:
        return "flipping pairs", flip
    return "all aligned pairs (none flip)", agg["all"][family]


def _families(agg: dict) -> list[str]:
    return [f for f in agg["all"] if f != "all"]


def attention_figure(record: dict) -> plt.Figure:
    """One heatmap per family and run: mean mass (layers x key groups), flipping pairs when any."""
    res = record["result"]
    agg = res["aggregates"]["attention"]
    groups = res["groups"]
    fams = _families(agg)
    fig, axes = plt.subplots(2, len(fams), figsize=(2.8 * len(fams) + 1.5, 9.5), squeeze=False, layout="constrained")
    for j, fam in enumerate(fams):
        label, entry = _subset(agg, fam)
        for i, run in enumerate(("old", "new")):
            ax = axes[i, j]
            mat = entry[run]["layers"]
            data = np.asarray(mat["mean"], dtype=float)
            im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                           interpolation="nearest")
            ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel("layer" if j == 0 else "")
            ax.set_title(f"{fam} · {run} run\n{label}, n={mat['n']} ({mat['n_scenarios']} scen.)", fontsize=8)
    fig.colorbar(im, ax=axes, fraction=0.02, pad=0.02, label="decision-row attention mass (mean over heads)")
    fig.suptitle(f"{title(record)}\nattention of the decision query by key group (sinks = first "
                 f"{res['n_sinks']} position(s))", fontsize=10)
    return fig


def knockout_figure(record: dict) -> plt.Figure:
    """Per family (rows) and run (columns): mean score change per band for each knocked group,
    95% cluster-bootstrap CI; the number of collapsed readouts is written above a bar when > 0."""
    res = record["result"]
    agg = res["aggregates"]["knockout"]
    fams = _families(agg)
    bands = [b["name"] for b in res["bands"]]
    groups = list(dict.fromkeys(v["group"] for v in res["variants"]))
    width = 0.8 / len(groups)
    colors = plt.cm.tab10(np.arange(len(groups)) % 10)
    fig, axes = plt.subplots(len(fams), 2, figsize=(13, 3.2 * len(fams) + 1), squeeze=False)
    for i, fam in enumerate(fams):
        label, entry = _subset(agg, fam)
        for j, run in enumerate(("old", "new")):
            ax = axes[i, j]
            cells = entry[run]
            for g, group in enumerate(groups):
                xs, ys, lo, hi, coll = [], [], [], [], []
                for b, band in enumerate(bands):
                    c = cells[f"{group}@{band}"]
                    if c["delta"]["mean"] is None:
                        continue
                    xs.append(b + (g - (len(groups) - 1) / 2) * width)
                    ys.append(c["delta"]["mean"])
                    (c_lo,), (c_hi,) = ci_bounds([c["delta"]])
                    lo.append(c_lo)
                    hi.append(c_hi)
                    coll.append((c["n_collapsed"], c["n"], c["flip_intact"]["k"]))
                y, y_lo, y_hi = np.asarray(ys), np.asarray(lo), np.asarray(hi)
                ax.bar(xs, y, width, color=colors[g], label=group if i == 0 and j == 0 else None)
                ax.errorbar(xs, y, yerr=[y - y_lo, y_hi - y], fmt="none", ecolor="k", lw=0.8, capsize=2)
                for x, y, (nc, n, nf) in zip(xs, hi, coll):
                    if nc:
                        ax.text(x, y, f"{nc}/{n}", ha="center", va="bottom", fontsize=6, color="crimson")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xticks(range(len(bands)), bands)
            ax.set_ylabel("score change (nats)\nknocked - clean")
            n = next(iter(cells.values()))["n"]
            ax.set_title(f"{fam} · {run} run · {label}, n={n}", fontsize=9)
    fig.legend(loc="center right", fontsize=8, title="knocked keys")
    fig.suptitle(f"{title(record)}\ndecision-row knockout per layer band (95% CI; "
                 f"k/n collapsed = readout destroyed, not a flip)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 0.95))
    return fig


def plot_read_location(record: dict, out_dir: Path) -> list[Path]:
    """``read_location_attention.png`` and ``read_location_knockout.png``."""
    return [save(attention_figure(record), out_dir, "read_location_attention.png"),
            save(knockout_figure(record), out_dir, "read_location_knockout.png")]
