"""Figure of the ``memory_placement`` probe (E1): accuracy with the memory early vs late in the
prompt and KL(early || late), by memory length and integration depth (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvnotes.plots import save, title
from kvnotes.plots.memory import mean_line, share_and_kl_axes, share_line


def plot_memory_placement(record: dict, out_dir: Path) -> list[Path]:
    """Accuracy (Wilson CI) per placement and depth, and mean KL(early || late) (interval over
    persona means) per depth, against the memory length."""
    agg = record["result"]["aggregates"]
    lengths = list(agg)
    x = [agg[L]["memory_tokens_mean"] for L in lengths]
    depths = sorted({d for L in lengths for d in agg[L]["by_depth"]}, key=int)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for d in depths:
        cells = [agg[L]["by_depth"].get(d, {}) for L in lengths]
        label = f"{d} fact" + ("s" if d != "1" else "")
        for placement, ls in (("early", "-"), ("late", "--")):
            share_line(axes[0], x, [c.get(f"accuracy_{placement}", {}) for c in cells], f"{placement}, {label}",
                       linestyle=ls)
        mean_line(axes[1], x, [c.get("kl", {}) for c in cells], label)
    share_and_kl_axes(axes, "accuracy (top-1 = expected answer)", "KL(early || late), nats",
                      "memory length (tokens; the document is as long)")
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout()
    return [save(fig, out_dir, "memory_placement.png")]
