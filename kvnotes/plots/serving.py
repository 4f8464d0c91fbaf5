"""Figures of the serving experiment (``kvnotes serve-bench`` (:mod:`kvnotes.cli.serve_bench`)): TTFT distribution per arm and
prefix-cache hit rate per arm and field position, read from the record only."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title

ARM_ORDER = ("in_place", "erratum", "hoist", "cold")
POS_ORDER = ("early", "middle", "late")


def _present(values, order):
    return [v for v in order if v in values] + sorted(v for v in values if v not in order)


def plot_serving(record: dict, out_dir: Path) -> list[Path]:
    """``serving_ttft.png``: TTFT of the update turns (turn >= 1) per arm, one panel per arrival
    rate, one box per field position (log scale); ``serving_hit_rate.png``: prefix-cache hit rate of
    the update turns per arm and field position (vLLM ``num_cached_tokens``), one panel per rate."""
    rows = [r for r in record["result"]["rows"] if r.get("sent") and r["turn"] > 0]
    rates = sorted({r["rate"] for r in rows})
    arms = _present({r["arm"] for r in rows}, ARM_ORDER)
    positions = _present({r["position"] for r in rows}, POS_ORDER)
    colors = dict(zip(POS_ORDER, ("tab:red", "tab:orange", "tab:green")))
    width = 0.8 / max(1, len(positions))
    paths = []

    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates):
        for j, pos in enumerate(positions):
            data = [[r["ttft_s"] for r in rows if r["rate"] == rate and r["arm"] == a and r["position"] == pos]
                    for a in arms]
            xs = np.arange(len(arms)) + (j - (len(positions) - 1) / 2) * width
            keep = [i for i, d in enumerate(data) if d]
            if keep:
                bp = ax.boxplot([data[i] for i in keep], positions=xs[keep], widths=width * 0.9, patch_artist=True,
                                showfliers=True, manage_ticks=False)
                for patch in bp["boxes"]:
                    patch.set_facecolor(colors.get(pos, "tab:gray"))
                    patch.set_alpha(0.6)
            ax.plot([], [], color=colors.get(pos, "tab:gray"), lw=6, alpha=0.6, label=f"field {pos}")
        ax.set_xticks(np.arange(len(arms)), arms)
        ax.set_yscale("log")
        ax.set_title(f"Poisson rate {rate:g} req/s")
        ax.set_ylabel("TTFT of update turns (s)")
        ax.legend(fontsize=8)
    fig.suptitle(title(record))
    fig.tight_layout()
    paths.append(save(fig, out_dir, "serving_ttft.png"))

    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates):
        for j, pos in enumerate(positions):
            hits = []
            for a in arms:
                rs = [r for r in rows if r["rate"] == rate and r["arm"] == a and r["position"] == pos]
                n = sum(r["n_prompt"] for r in rs)
                hits.append(sum(r["n_cached"] for r in rs) / n if n else np.nan)
            xs = np.arange(len(arms)) + (j - (len(positions) - 1) / 2) * width
            ax.bar(xs, hits, width, color=colors.get(pos, "tab:gray"), label=f"field {pos}")
        ax.set_xticks(np.arange(len(arms)), arms)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("prefix-cache hit rate, update turns")
        ax.set_title(f"Poisson rate {rate:g} req/s")
        ax.legend(fontsize=8)
    fig.suptitle(title(record))
    fig.tight_layout()
    paths.append(save(fig, out_dir, "serving_hit_rate.png"))
    return paths
