"""Figures of the ``screen`` probe."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title


def plot_screen(record: dict, out_dir: Path) -> list[Path]:
    """Pairs, flipping pairs and excluded pairs per family."""
    table = record["result"]["aggregates"]["by_family"]
    fams = list(table)
    x = np.arange(len(fams))
    fig, ax = plt.subplots(figsize=(1.4 * len(fams) + 3, 4))
    n = [table[f]["n_pairs"] for f in fams]
    k = [table[f]["n_flip"] for f in fams]
    e = [sum(table[f]["excluded"].values()) for f in fams]
    ax.bar(x - 0.27, n, 0.27, label="aligned pairs")
    ax.bar(x, k, 0.27, label="flipping pairs")
    ax.bar(x + 0.27, e, 0.27, label="excluded at tokenisation")
    ax.set_xticks(x, fams)
    ax.set_ylabel("pairs")
    ax.legend()
    ax.set_title(title(record))
    fig.tight_layout()
    return [save(fig, out_dir, "screen.png")]
