"""Figures of the ``heads`` circuit probe: cumulative top-k recovery on held-out pairs vs k-matched
random head sets (95% cluster-bootstrap CIs), and per-layer x head single-head maps (selection
pairs). Every number comes from the record."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_line, save, title


def _curve(ax, curve: dict, ks: list, fam: str, color, label: str, ls: str) -> None:
    pts = [curve[str(k)].get(fam, {}) for k in ks]
    ci_line(ax, ks, pts, label, ls=ls, marker="o", ms=3, color=color)


def plot_heads(record: dict, out_dir: Path) -> list[Path]:
    """Top-k curves per mode and family; single-head recovery heatmaps per mode (all families)."""
    agg = record["result"]["aggregates"]
    ks = agg["ks"]
    fams = [f for f in agg["families"] if agg["curves"][agg.get("modes", ["read"])[0]]["topk"].get(str(ks[0]), {}).get(f, {}).get("n")] if ks else []
    colors = plt.cm.tab10(np.linspace(0, 1, 10))
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), squeeze=False)
    for ax, mode in zip(axes[0], agg.get("modes", ["read", "write"])):
        for i, f in enumerate(fams):
            _curve(ax, agg["curves"][mode]["topk"], ks, f, colors[i % 10], f"{f} top-k", "-")
            _curve(ax, agg["curves"][mode]["random"], ks, f, colors[i % 10], f"{f} random", ":")
        ax.axhline(0, color="grey", lw=0.6)
        ax.axhline(1, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k heads patched jointly")
        ax.set_ylabel("recovery (held-out pairs)")
        where = "decision position d" if mode == "read" else "note positions [b, d)"
        ax.set_title(f"{mode} heads at {where}: top-k (selection-ranked) vs random", fontsize=9)
        ax.legend(fontsize=7)
    if not fams:
        axes[0][0].text(0.5, 0.5, "no held-out flipping pairs: no circuit to find", ha="center",
                        transform=axes[0][0].transAxes)
    fig.suptitle(title(record))
    fig.tight_layout()
    paths.append(save(fig, out_dir, "heads_topk.png"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), squeeze=False)
    for ax, mode in zip(axes[0], agg.get("modes", ["read", "write"])):
        m = agg["selection_maps"][mode].get("all", {})
        if not m.get("n"):
            ax.text(0.5, 0.5, "no selection maps", ha="center", transform=ax.transAxes)
            continue
        data = np.asarray(m["mean"], dtype=float)
        lim = max(float(np.abs(data).max()), 1e-6)
        im = ax.imshow(data, aspect="auto", origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim,
                       interpolation="nearest")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{mode}: single-head recovery, mean over {m['n']} selection pairs", fontsize=9)
        plt.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.suptitle(title(record))
    fig.tight_layout()
    paths.append(save(fig, out_dir, "heads_maps.png"))
    return paths
