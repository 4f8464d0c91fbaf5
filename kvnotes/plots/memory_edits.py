"""Figure of the ``memory_edits`` probe (E3): per arm, agreement with the re-prefill, KL and cost
(numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title


def plot_memory_edits(record: dict, out_dir: Path) -> list[Path]:
    """Per memory length: top-1 agreement with ``full`` (Wilson CI), mean KL(full || arm) and the
    mean share of ``full``'s tokens each arm forwarded, one bar per arm."""
    res = record["result"]
    agg, names = res["aggregates"], res["arm_names"]
    lengths = list(agg)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    w = 0.8 / max(len(lengths), 1)
    xs = np.arange(len(names))
    for k, L in enumerate(lengths):
        arms = agg[L]["arms"]
        p = np.array([arms[a]["top1_agreement"]["p"] for a in names], dtype=float)
        lo = np.array([arms[a]["top1_agreement"]["ci"][0] for a in names], dtype=float)
        hi = np.array([arms[a]["top1_agreement"]["ci"][1] for a in names], dtype=float)
        label = f"memory {L} tok (n={agg[L]['n']})"
        axes[0].bar(xs + k * w, p, w, yerr=[p - lo, hi - p], capsize=2, label=label)
        axes[1].bar(xs + k * w, [max(arms[a]["kl"]["mean"], 1e-6) for a in names], w, label=label)
        axes[2].bar(xs + k * w, [max(arms[a]["token_ratio_mean"], 1e-6) for a in names], w, label=label)
    axes[0].set_ylabel("top-1 agreement with full re-prefill")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("KL(full || arm), nats")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("tokens forwarded / full's")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xticks(xs + w * (len(lengths) - 1) / 2, names, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout()
    return [save(fig, out_dir, "memory_edits.png")]
