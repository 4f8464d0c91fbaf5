"""Frontier figure of the ``edit`` probe: quality against cost, one point per method and K (numbers
from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvnotes.plots import save, title

MARKERS = {"stale": "x", "refresh_field": "s", "erratum": "^", "field_plus_erratum": "v", "hoist": "D",
           "full": "*", "wrong_erratum": "1", "irrelevant_notice": "2"}
#: smallest plotted cost fraction (stale has 0; the x axis is logarithmic)
FLOOR = 1e-3


def _agreement(summary: dict, variant: str) -> tuple[float | None, list | None, int]:
    if variant == "cot":                   # every pair: a chain that missed its marker does not agree
        p = summary["agreement"]["all"]
    else:
        p = summary["recovery"]["all"].get("decision_flipped") or {}
    return p.get("p"), p.get("ci"), p.get("n", 0)


def _point(ax, x, p, ci, **style):
    yerr = None if ci is None else [[max(p - ci[0], 0)], [max(ci[1] - p, 0)]]
    ax.errorbar([max(x, FLOOR)], [p], yerr=yerr, capsize=2, lw=0.8, **style)


def plot_edit(record: dict, out_dir: Path) -> list[Path]:
    """Share of pairs whose decision agrees with the full re-prefill (Wilson 95% CI) against the
    share of prompt tokens recomputed, for every named method and each selective ranking's K sweep
    (``oracle_copy`` dashed: an upper bound that reads the full re-prefill)."""
    agg = record["result"]["aggregates"]
    variant = agg.get("variant", "direct")
    fig, ax = plt.subplots(figsize=(8, 5))
    methods = agg["methods"]
    for name, summary in methods.items():
        p, ci, n = _agreement(summary, variant)
        x = summary["frac"]["all"]["mean"]
        if p is None or x is None:
            continue
        _point(ax, x, p, ci, marker=MARKERS.get(name, "o"), ms=9, ls="none", label=f"{name} (n={n})")
    sweep = agg["sweep"]
    lines: dict[str, list] = {}
    for name, summary in sweep.items():
        ranking = name.split("@")[0].removeprefix("selective_")
        p, ci, n = _agreement(summary, variant)
        x = summary["frac"]["all"]["mean"]
        if p is not None and x is not None:
            lines.setdefault(ranking, []).append((max(x, FLOOR), p, n))
    for ranking, pts in sorted(lines.items()):
        pts.sort()
        style = {"ls": "--", "color": "0.4"} if ranking == "oracle_copy" else {"ls": "-"}
        n = max(q[2] for q in pts)
        label = (f"{ranking} (upper bound)" if ranking == "oracle_copy" else f"selective · {ranking}") + f" (n≤{n})"
        ax.plot([q[0] for q in pts], [q[1] for q in pts], marker=".", label=label, **style)
    ax.set_xscale("log")
    ax.set_xlabel(f"tokens recomputed / prompt tokens (mean; {FLOOR:g} = none)")
    ax.set_ylabel("decision agrees with full re-prefill (share)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{title(record)} · {variant} · n_flip={agg.get('n_flip')}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return [save(fig, out_dir, f"edit_frontier_{variant}.png")]
