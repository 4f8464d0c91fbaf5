"""Figures of the ``injection`` probe: how often the decision follows injected notes, per family."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title


def plot_injection(record: dict, out_dir: Path) -> list[Path]:
    """Follow-the-notes rate (Wilson 95% CI) and notes recovery ``r_notes`` (cluster-bootstrap CI)
    per family and direction, over flipping pairs."""
    res = record["result"]
    agg = res["aggregates"]["flipping"]
    dirs = list(res["directions"])
    fams = list(agg)
    n_by_fam = res["aggregates"]["n_pairs_by_family"]
    no_flip = sorted(f for f in n_by_fam if f not in agg)
    x = np.arange(len(fams))
    width = 0.8 / len(dirs)
    fig, axes = plt.subplots(1, 2, figsize=(1.6 * max(len(fams), 2) * 2 + 3, 4.5))
    for k, d in enumerate(dirs):
        off = (k - (len(dirs) - 1) / 2) * width
        spec = res["directions"][d]
        lab = f"{spec['notes_from']} notes into {spec['base']} cache"
        p = np.array([agg[f][d]["follow_notes"]["p"] for f in fams], dtype=float)
        lo, hi = ci_bounds([agg[f][d]["follow_notes"] for f in fams], "ci")
        axes[0].bar(x + off, p, width, label=lab)
        axes[0].errorbar(x + off, p, yerr=[p - lo, hi - p], fmt="none", ecolor="k", lw=0.8, capsize=2)
        r = [agg[f][d]["r_notes"] for f in fams]
        m = np.array([s["mean"] for s in r], dtype=float)
        rlo, rhi = ci_bounds(r)
        axes[1].bar(x + off, m, width, label=lab)
        axes[1].errorbar(x + off, m, yerr=[m - rlo, rhi - m], fmt="none", ecolor="k", lw=0.8, capsize=2)
    labels = [f"{f}\n(n={agg[f][dirs[0]]['follow_notes']['n']})" for f in fams]
    axes[0].set_ylim(0, 1.05)
    axes[0].set_ylabel("share of flipping pairs whose decision follows the notes")
    axes[0].set_title("decision follows injected notes (Wilson 95% CI)", fontsize=9)
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].axhline(1, color="gray", lw=0.6, ls="--")
    axes[1].set_ylabel("r_notes = (s_inj - s_base) / (s_source - s_base)")
    axes[1].set_title("score moved towards the notes' run (1 = notes decide, 0 = field decides)", fontsize=9)
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.legend(fontsize=7)
    if no_flip:
        fig.text(0.01, 0.01, "no flipping pairs (not shown): " + ", ".join(f"{f} (0/{n_by_fam[f]})" for f in no_flip),
                 fontsize=7)
    fig.suptitle(f"{title(record)} · notes injection", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return [save(fig, out_dir, "injection.png")]
