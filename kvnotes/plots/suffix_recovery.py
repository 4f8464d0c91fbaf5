"""Figures of the ``suffix_recovery`` probe (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title
from kvnotes.plots.field_refresh import bar_with_ci

COLORS = {"suffix": "tab:blue", "prefix": "tab:orange", "topk": "tab:green", "random": "tab:gray"}


def _curve(ax, xs, cells: list[dict], group: str, color, label: str, ls: str = "-") -> None:
    """Mean over grid points with its CI band; grid points without pairs are gaps."""
    mean = np.array([c[group]["mean"] if c[group]["mean"] is not None else np.nan for c in cells], dtype=float)
    lo, hi = ci_bounds([c[group] for c in cells])
    ax.plot(xs, mean, ls=ls, marker=".", color=color, label=label)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)


def _curves_figure(record: dict, out_dir: Path) -> Path:
    res = record["result"]
    agg = res["aggregates"]
    scope = "heldout" if agg["curves"].get("heldout") else "all"
    curves = agg["curves"][scope]
    grid = res["grid"]
    groups = [g for g in ["all", *agg["families"]]
              if any(curves[f][0][g]["n"] for f in curves)]
    kinds = [k for k in ("fraction", "count") if any(p["kind"] == k for p in grid)]
    panels = [(k, False) for k in kinds]
    if any(f.startswith("field+") for f in curves):
        panels += [(k, True) for k in kinds]
    fig, axes = plt.subplots(len(groups), len(panels), figsize=(4.2 * len(panels), 3.2 * len(groups)), squeeze=False)
    for gi, g in enumerate(groups):
        ref = agg["references"]["downstream"][g]["mean"]
        for pi, (kind, with_field) in enumerate(panels):
            ax = axes[gi, pi]
            idx = [i for i, p in enumerate(grid) if p["kind"] == kind]
            xs = [grid[i]["value"] for i in idx]
            for fam, color in COLORS.items():
                name = f"field+{fam}" if with_field else fam
                if name in curves:
                    n = max(curves[name][i][g]["n"] for i in idx)
                    _curve(ax, xs, [curves[name][i] for i in idx], g, color, f"{name} (n={n})")
            if ref is not None and not with_field:
                ax.axhline(ref, color="k", ls=":", lw=0.8, label="all downstream")
            ax.axhline(0, color="k", lw=0.5)
            ax.axhline(1, color="gray", lw=0.5, ls="--")
            if kind == "count":
                ax.set_xscale("log", base=2)
            ax.set_xlabel("k / downstream length" if kind == "fraction" else "k (positions)")
            ax.set_ylabel(f"{g}: recovery")
            ax.set_title(("field + set" if with_field else "downstream set only") + f", {scope}", fontsize=8)
            ax.legend(fontsize=6)
    readout = " · decision read after generated reasoning" if agg.get("readout") == "generated" else ""
    fig.suptitle(f"{title(record)} · mean recovery, 95% CI{readout}")
    fig.tight_layout()
    return save(fig, out_dir, "suffix_recovery_curves.png")


def _label(tok: str) -> str:
    return tok.replace("\n", "\\n").replace("\t", "\\t") or "∅"


def _map_figure(record: dict, out_dir: Path) -> Path:
    examples = record["result"]["examples"]
    fams = sorted(examples)
    n_tok = max(len(examples[f]["tokens"]) for f in fams)
    fig, axes = plt.subplots(len(fams), 1, figsize=(max(12, 0.12 * n_tok), 3.4 * len(fams)), squeeze=False)
    for ax, f in zip(axes[:, 0], fams):
        ex = examples[f]
        a, b = ex["field"]
        d = ex["decision"]
        pos = np.arange(ex["downstream"][0], ex["downstream"][1])
        vals = np.asarray(ex["single"], dtype=float)
        ax.bar(pos, vals, 0.85, color=np.where(vals >= 0, "tab:blue", "tab:red"))
        ax.axvspan(a - 0.5, b - 0.5, color="gold", alpha=0.4, lw=0, label="field")
        ax.axvline(d, color="tab:green", lw=1.2, ls="--", label="decision position")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(np.arange(len(ex["tokens"])), [_label(t) for t in ex["tokens"]], rotation=90, fontsize=5)
        ax.set_xlim(-0.5, len(ex["tokens"]) - 0.5)
        ax.set_ylabel("single-position recovery")
        ax.set_title(f"{f}: {ex['pair']} ({ex['split']}), each downstream position alone, all layers", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title(record))
    fig.tight_layout()
    return save(fig, out_dir, "suffix_recovery_map.png")


def _bands_figure(record: dict, out_dir: Path) -> Path:
    res = record["result"]
    agg = res["aggregates"]
    bands = res["layer_bands"]
    groups = [g for g in ["all", *agg["families"]] if agg["bands"] and agg["bands"][0][g]["n"]]
    x = np.arange(len(bands))
    w = 0.8 / max(1, len(groups))
    single = agg.get("single")                      # absent under cot: the map is direct-readout only
    fig, axes = plt.subplots(1, 2 if single else 1, figsize=(max(10, 1.6 * len(bands) + 6), 4.2), squeeze=False)
    axes = axes[0]
    for j, g in enumerate(groups):
        color = plt.cm.tab10(j % 10)
        for i in range(len(bands)):
            bar_with_ci(axes[0], x[i] + (j - (len(groups) - 1) / 2) * w, agg["bands"][i][g], "mean", w, color,
                        label=f"{g} (n={agg['bands'][i][g]['n']})" if i == 0 else None)
    axes[0].set_xticks(x, [b["name"] if isinstance(b, dict) else f"L{b[0]}-{b[-1]}" for b in bands])
    axes[0].axhline(0, color="k", lw=0.5)
    axes[0].set_ylabel("recovery (all downstream positions, one layer band)")
    axes[0].set_title("per-layer-band recovery, 95% CI", fontsize=9)
    axes[0].legend(fontsize=7)
    if not single:
        fig.suptitle(title(record))
        fig.tight_layout()
        return save(fig, out_dir, "suffix_recovery_bands.png")
    by = single["by_offset"]["decision"]
    for j, g in enumerate(groups):
        prof = by[g]
        axes[1].plot(prof["offset"], prof["mean"], marker=".", color=plt.cm.tab10(j % 10), label=g)
    axes[1].axhline(0, color="k", lw=0.5)
    axes[1].invert_xaxis()
    axes[1].set_xlabel("offset from the decision position (d - p)")
    axes[1].set_ylabel("mean single-position recovery")
    axes[1].set_title("single-position map averaged by offset from d (all flipping pairs)", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.suptitle(title(record))
    fig.tight_layout()
    return save(fig, out_dir, "suffix_recovery_bands.png")


def plot_suffix_recovery(record: dict, out_dir: Path) -> list[Path]:
    """Recovery curves with CI bands per family (suffix / prefix / top-k / random, held-out
    pairs), the single-position map of one example pair per family over its tokens (field and
    decision marked), and layer-band bars with the offset-averaged single-position profile."""
    res = record["result"]
    if not res["rows"]:
        return []
    maps = [_map_figure(record, out_dir)] if res["examples"] else []       # none under cot
    return [_curves_figure(record, out_dir), *maps, _bands_figure(record, out_dir)]
