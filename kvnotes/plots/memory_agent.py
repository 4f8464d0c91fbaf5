"""Figure of the ``memory_agent`` probe (E5): the long horizon's per-turn agreement and KL against the
re-prefill of the rewritten prompt, and the timed sessions' cumulative time to first token (numbers
from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvnotes.plots import save, title


def plot_memory_agent(record: dict, out_dir: Path) -> list[Path]:
    """Left, middle: per turn of the long-horizon run, the share of owned turns whose decision agrees
    with the re-prefill and the mean KL(full || arm) (persona means), one line per arm. Right: the
    cumulative time to first token of each timed session (mean over personas) against re-prefilling
    every turn, one group per memory length."""
    res = record["result"]
    agg, arms = res["aggregates"], res["arm_names"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    long = [c for c in agg if c.startswith("long/")]
    for cell in long:
        for arm in arms:
            d = agg[cell]["arms"][arm]["drift"]
            pts = [(t, a) for t, a in zip(d["turns"], d["agreement"]) if a is not None]
            axes[0].plot([t for t, _ in pts], [a for _, a in pts], marker="o", ms=3, label=f"{arm} ({cell})")
            axes[1].plot(d["turns"], [max(k, 1e-6) for k in d["kl_mean"]], marker="o", ms=3, label=f"{arm} ({cell})")
    axes[0].set_xlabel("turn")
    axes[0].set_ylabel("decision agreement with re-prefill (owned turns)")
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].set_xlabel("turn")
    axes[1].set_ylabel("KL(full || arm), nats")
    axes[1].set_yscale("log")
    sessions = [c for c in agg if c.startswith("session/")]
    names = [*arms, "re-prefill"]
    w = 0.8 / max(len(sessions), 1)
    for k, cell in enumerate(sessions):
        vals = [agg[cell]["arms"][a]["cum_ttft_s"] for a in arms] + [agg[cell]["cum_ttft_full_s"]]
        axes[2].bar([i + k * w for i in range(len(names))], vals, w,
                    label=f"{cell} ({agg[cell]['turns']} turns, {agg[cell]['prompt_tokens_mean']:.0f} tok)")
    axes[2].set_xticks([i + w * (len(sessions) - 1) / 2 for i in range(len(names))], names, rotation=20)
    axes[2].set_ylabel("cumulative time to first token, s")
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout()
    return [save(fig, out_dir, "memory_agent.png")]
