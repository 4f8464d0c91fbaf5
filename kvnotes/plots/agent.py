"""Figures of the ``agent`` probe (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title

#: Bars per turn scope: (aggregate key, label).
BARS = (("agent_accuracy", "agent (composed + update)"), ("transcript_accuracy", "full prefill of the conversation"),
        ("oracle_accuracy", "oracle: full prefill, field rewritten"), ("agreement_oracle_owned", "agent = oracle (owned)"))


def plot_agent(record: dict, out_dir: Path) -> list[Path]:
    """Per group (``all`` and each family) and turn scope (turn 1, turns 2+): accuracy of the agent,
    the transcript and the oracle, and the agent's agreement with the oracle where the oracle owns
    its decision; means of the indicators with their intervals (the method in the title)."""
    agg = record["result"]["aggregates"]
    groups = ["all", *agg["families"]]
    scopes = ("turn1", "turn2+")
    fig, axes = plt.subplots(1, len(groups), figsize=(3.4 * len(groups) + 1.5, 4.2), squeeze=False, sharey=True)
    width = 0.8 / len(BARS)
    colors = plt.cm.tab10(np.arange(len(BARS)))
    for j, g in enumerate(groups):
        ax = axes[0, j]
        for k, (key, label) in enumerate(BARS):
            pts = [agg["by_family"][g][s][key] for s in scopes]
            mean = np.array([p["mean"] if p.get("n") else np.nan for p in pts], dtype=float)
            lo, hi = ci_bounds(pts)
            x = np.arange(len(scopes)) + (k - (len(BARS) - 1) / 2) * width
            ax.bar(x, mean, width, color=colors[k], label=label if j == 0 else None)
            ax.errorbar(x, mean, yerr=[np.clip(mean - lo, 0, None), np.clip(hi - mean, 0, None)], fmt="none",
                        ecolor="k", lw=0.8, capsize=2)
        n = [agg["by_family"][g][s]["n_turns"] for s in scopes]
        ax.set_xticks(np.arange(len(scopes)), [f"turn 1 (n={n[0]})", f"turns 2+ (n={n[1]})"])
        ax.set_title(g, fontsize=10)
        ax.set_ylim(0, 1.05)
    axes[0, 0].set_ylabel("share of decisions")
    fig.legend(loc="lower center", ncol=len(BARS), fontsize=8, frameon=False)
    fig.suptitle(title(record) + f"\n{agg['turns']} turns, seam {agg['seam']}, sink {agg['sink']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return [save(fig, out_dir, "agent_accuracy.png")]
