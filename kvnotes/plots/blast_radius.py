"""Figures of the ``blast_radius`` probe."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from kvnotes.plots import ci_bounds, save, title


def _heatmap(ax, example: dict, metric: str, label: str) -> None:
    data = np.asarray(example["maps"][metric], dtype=float)
    floor = 1e-4
    im = ax.imshow(np.clip(data, floor, None), aspect="auto", origin="lower", cmap="magma",
                   norm=LogNorm(vmin=floor, vmax=max(float(data.max()), floor * 10)), interpolation="nearest")
    a, b = example["field"]
    d = example["decision"]
    ax.axvspan(a - 0.5, b - 0.5, color="cyan", alpha=0.25, lw=0)
    ax.axvline(a - 0.5, color="cyan", lw=0.8)
    ax.axvline(b - 0.5, color="cyan", lw=0.8, label="field span")
    ax.axvline(d, color="lime", lw=1.2, ls="--", label="decision position")
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title(label, fontsize=9)
    ax.legend(loc="upper left", fontsize=7, framealpha=0.6)
    plt.colorbar(im, ax=ax, fraction=0.046, pad=0.02)


def plot_blast_radius(record: dict, out_dir: Path) -> list[Path]:
    """Layer x position deviation heatmaps for one example pair (field span and decision position
    marked) and the share-above-threshold curves per family with CI bands."""
    res = record["result"]
    examples = res["examples"]
    fam = next((f for f in sorted(examples) if examples[f]["flips"]), sorted(examples)[0])
    ex = examples[fam]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _heatmap(axes[0], ex, "k_rel", f"key deviation (rel. L2), {ex['pair']}" + ("" if ex["flips"] else " [no flip]"))
    _heatmap(axes[1], ex, "attn_rel", "attention-output deviation, field-only refresh")
    ax = axes[2]
    thresholds = np.asarray(res["thresholds"])
    shares = res["aggregates"]["share_all"]
    families = sorted(k for k in shares["k_rel"][0] if k != "all")
    colors = plt.cm.tab10(np.linspace(0, 1, 10))
    for i, f in enumerate(families):
        for metric, ls in (("k_rel", "-"), ("attn_rel", "--")):
            pts = [s[f] for s in shares[metric]]
            mean = np.array([p["mean"] for p in pts], dtype=float)
            lo, hi = ci_bounds(pts)
            n = pts[0]["n"]
            ax.plot(thresholds, mean, ls=ls, color=colors[i % 10],
                    label=f"{f} (n={n})" if metric == "k_rel" else None)
            ax.fill_between(thresholds, lo, hi, color=colors[i % 10], alpha=0.12, lw=0)
    ax.plot([], [], "k-", label="keys")
    ax.plot([], [], "k--", label="attn output (field-only refresh)")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("threshold on layer-mean relative L2")
    ax.set_ylabel("share of downstream positions above")
    ax.set_title("share of downstream positions that moved (95% CI)", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(title(record))
    fig.tight_layout()
    return [save(fig, out_dir, "blast_radius.png")]
