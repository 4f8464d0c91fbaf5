"""Figures of the ``dissociation`` probe: trigger-only vs notes recovery, and the clean 2x2."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title

CELLS = ("A_normal", "A_inverted", "B_normal", "B_inverted")


def _bars(ax, x, stats, width, label, color=None):
    m = np.array([s["mean"] if s["mean"] is not None else np.nan for s in stats], dtype=float)
    lo, hi = ci_bounds(stats)
    ax.bar(x, np.nan_to_num(m), width, label=label, color=color)
    ax.errorbar(x, m, yerr=[m - lo, hi - m], fmt="none", ecolor="k", lw=0.8, capsize=2)


def plot_dissociation(record: dict, out_dir: Path) -> list[Path]:
    """Left: recovery from the trigger's KV, the notes after it, and both, per family over flipping
    polarity pairs (families without flips are marked, not drawn). Middle: mean absolute score shift
    of the same patches over all aligned pairs, next to the clean ``|effect|``. Right: the clean 2x2 — mean
    ``log p(A) - log p(B)`` per (field value outcome, rule polarity). CIs: cluster bootstrap, 95%."""
    res = record["result"]
    agg = res["aggregates"]
    fams = [f for f in agg if f not in ("all", "checks")]
    variants = list(next(iter(agg[f] for f in fams))["recovery"]) if fams else []
    x = np.arange(len(fams))
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * max(len(fams), 1) + 10, 4.8))
    ax = axes[0]
    width = 0.8 / max(len(variants), 1)
    for k, v in enumerate(variants):
        _bars(ax, x + (k - (len(variants) - 1) / 2) * width, [agg[f]["recovery"][v] for f in fams], width, v)
    for i, f in enumerate(fams):
        if agg[f]["n_flip"] == 0:
            ax.text(i, 0.5, f"no flipping\npolarity pairs\n(0/{agg[f]['n_pairs']})", ha="center", va="center",
                    fontsize=8, color="crimson")
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(1, color="gray", lw=0.6, ls="--")
    ax.set_xticks(x, [f"{f}\n(flip {agg[f]['n_flip']}/{agg[f]['n_pairs']})" for f in fams])
    ax.set_ylabel("recovery (s_patched - s_normal) / (s_inverted - s_normal)")
    ax.set_title("normal-rule run patched towards the inverted rule (flipping pairs, 95% CI)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    shifted = [v for v in variants] + ["abs_effect"]
    width = 0.8 / len(shifted)
    for k, v in enumerate(shifted):
        stats = [agg[f]["abs_effect_all"] if v == "abs_effect" else agg[f]["abs_shift_all"][v] for f in fams]
        _bars(ax, x + (k - (len(shifted) - 1) / 2) * width, stats, width,
              "clean |s_inverted - s_normal|" if v == "abs_effect" else f"patch {v}: |s_patched - s_normal|")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, [f"{f}\n(n={agg[f]['n_pairs']})" for f in fams])
    ax.set_ylabel("|score shift| (nats)")
    ax.set_title("size of score shifts, all aligned polarity pairs (95% CI)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    width = 0.8 / len(CELLS)
    colors = plt.cm.Paired(np.arange(len(CELLS)))
    for k, cell in enumerate(CELLS):
        _bars(ax, x + (k - (len(CELLS) - 1) / 2) * width, [agg[f]["two_by_two"]["cells"][cell] for f in fams],
              width, cell.replace("_", " value, ") + " rule", colors[k])
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x, fams)
    ax.set_ylabel("clean log p(A) - log p(B) (nats)")
    ax.set_title("clean 2x2: field value (implies A/B under the normal rule)\nx rule polarity", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    skipped = res.get("skipped_scenarios") or {}
    if skipped:
        fig.text(0.01, 0.01, "scenarios skipped: " + ", ".join(f"{k}: {v}" for k, v in skipped.items()), fontsize=7)
    fig.suptitle(f"{title(record)} · polarity dissociation", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return [save(fig, out_dir, "dissociation.png")]
