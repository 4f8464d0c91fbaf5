"""Figure of the ``memory_granularity`` probe (E4): agreement, KL and the cost of a localized edit
against the number of blocks ``S``, and the cross-referential split (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title
from kvnotes.plots.memory import mean_line, share_line


def plot_memory_granularity(record: dict, out_dir: Path) -> list[Path]:
    """Per memory length, against ``S``: top-1 agreement with full (composed, and after the
    localized edit), mean KL(full || composed), the edit's tokens as a share of the full
    re-prefill's; and the cross-referential queries' agreement with the facts together vs split."""
    res = record["result"]
    agg = res["aggregates"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for L, a in agg.items():
        Ss = [int(s) for s in a["by_S"]]
        by = [a["by_S"][str(s)] for s in Ss]
        share_line(axes[0], Ss, [b["top1_agreement"] for b in by], f"{L} tok composed")
        mean_line(axes[1], Ss, [b["kl"] for b in by], f"{L} tok")
        if a["edit_by_S"]:
            ed = [a["edit_by_S"][str(s)] for s in Ss]
            share_line(axes[0], Ss, [e["top1_agreement"] for e in ed], f"{L} tok after edit", ls="--")
            axes[2].plot(Ss, [e["token_ratio_mean"] for e in ed], marker="o", label=f"{L} tok")
        cross = {k: v for k, v in a["cross"].items() if k != "pooled"}
        xs = np.arange(len(cross))
        for k, v in enumerate(("together", "split")):
            p = [cross[s][v]["top1_agreement"]["p"] if cross[s][v]["top1_agreement"]["n"] else np.nan for s in cross]
            axes[3].bar(xs + 0.4 * k, p, 0.4, label=f"{L} tok {v}")
        axes[3].set_xticks(xs + 0.2, list(cross))
    axes[0].set_ylabel("top-1 agreement with full")
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].set_ylabel("KL(full || composed), nats")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("edit tokens / full re-prefill tokens")
    axes[2].set_yscale("log")
    axes[3].set_ylabel("cross-referential: top-1 agreement")
    axes[3].set_ylim(0, 1.05)
    for ax in axes[:3]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks S")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout()
    return [save(fig, out_dir, "memory_granularity.png")]
