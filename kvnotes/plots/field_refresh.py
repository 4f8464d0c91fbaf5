"""Figures of the ``field_refresh`` probe (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title

#: Bars drawn per family: (variant key in the record, label, is it a check by construction).
BARS = (("field", "field only (copied KV)", False), ("field_exact", "field only (recomputed)", False),
        ("downstream", "downstream only", False), ("field_downstream", "field + downstream (check: = 1)", True))


def bar_with_ci(ax, x: float, summary: dict, key: str, width: float, color, hatch: str | None = None,
                label: str | None = None) -> None:
    """One bar of ``summary[key]`` with its ``ci_<key>`` as an error bar (nothing when n = 0).

    For ``key="mean"`` the CI is ``ci_mean``; for a share (``decision_flipped``) pass the
    proportion dict itself with ``key="p"`` (its CI is ``ci``).
    """
    val = summary.get(key)
    if val is None:
        ax.bar(x, 0, width, color=color, hatch=hatch, label=label)
        return
    ci = summary.get(f"ci_{key}") if key != "p" else summary.get("ci")
    yerr = None if ci is None else np.array([[val - ci[0]], [ci[1] - val]]).clip(min=0)
    ax.bar(x, val, width, color=color, hatch=hatch, edgecolor="k" if hatch else None, lw=0.5, label=label,
           yerr=yerr, capsize=2, error_kw={"lw": 0.8})


def plot_field_refresh(record: dict, out_dir: Path) -> list[Path]:
    """Bars per family: mean recovery of field-only vs field+downstream refresh (and downstream
    only, and the recomputed field) with 95% cluster-bootstrap CIs; right: share of pairs whose
    decision each patch flipped (Wilson CIs)."""
    agg = record["result"]["aggregates"]
    rec = agg["recovery"]
    bars = [b for b in BARS if b[0] in rec]
    groups = ["all", *agg["families"]]
    x = np.arange(len(groups))
    w = 0.8 / len(bars)
    colors = plt.cm.tab10(np.arange(len(bars)))
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(groups) + 4), 4.5))
    for j, (key, label, check) in enumerate(bars):
        for i, g in enumerate(groups):
            s = rec[key][g]
            bar_with_ci(axes[0], x[i] + (j - (len(bars) - 1) / 2) * w, s, "mean", w, colors[j],
                        "//" if check else None, label if i == 0 else None)
            bar_with_ci(axes[1], x[i] + (j - (len(bars) - 1) / 2) * w, s["decision_flipped"], "p", w, colors[j],
                        "//" if check else None)
    labels = [f"{g}\nn={rec['field'][g]['n']}" for g in groups]
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.axhline(0, color="k", lw=0.6)
        ax.axhline(1, color="gray", lw=0.6, ls=":")
    axes[0].set_ylabel("recovery (s_patched - s_old) / (s_new - s_old)")
    axes[0].set_title("mean recovery, 95% CI", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].set_ylabel("share of pairs whose decision the patch flipped")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("decision flipped by the patch, Wilson 95% CI", fontsize=9)
    fig.suptitle(title(record))
    fig.tight_layout()
    return [save(fig, out_dir, "field_refresh.png")]
