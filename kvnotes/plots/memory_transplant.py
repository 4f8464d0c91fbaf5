"""Figure of the ``memory_transplant`` probe (E2): agreement with the full prefill and KL by memory
length, one line per arm (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvnotes.plots import save, title
from kvnotes.plots.memory import mean_line, share_and_kl_axes, share_line


def plot_memory_transplant(record: dict, out_dir: Path) -> list[Path]:
    """Decision agreement on owned queries (Wilson CI) and mean KL(full || arm) (interval over
    persona means) against the memory length, per arm."""
    res = record["result"]
    agg = res["aggregates"]
    lengths = list(agg)
    x = [agg[L]["memory_tokens_mean"] for L in lengths]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in res["arm_names"]:
        share_line(axes[0], x, [agg[L]["arms"][arm]["decision_agreement"] for L in lengths], arm)
        mean_line(axes[1], x, [agg[L]["arms"][arm]["kl"] for L in lengths], arm)
    share_and_kl_axes(axes, "decision agreement with full (owned queries)", "KL(full || arm), nats",
                      "memory length (tokens)")
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout()
    return [save(fig, out_dir, "memory_transplant.png")]
