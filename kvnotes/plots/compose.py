"""Figures of the ``compose`` probe (numbers from the record only)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import save, title


def _share_line(ax, seams, shares: list[dict], label: str, **style) -> None:
    """Share vs seam with Wilson CI band; points with n = 0 are skipped."""
    ok = [i for i, p in enumerate(shares) if p.get("n")]
    if not ok:
        return
    xs = np.array([seams[i] for i in ok])
    p = np.array([shares[i]["p"] for i in ok], dtype=float)
    lo = np.array([shares[i]["ci"][0] for i in ok], dtype=float)
    hi = np.array([shares[i]["ci"][1] for i in ok], dtype=float)
    ax.plot(xs, p, marker="o", label=f"{label} (n={shares[ok[0]]['n']})", **style)
    ax.fill_between(xs, lo, hi, color=style.get("color"), alpha=0.12, lw=0)


def plot_compose(record: dict, out_dir: Path) -> list[Path]:
    """Per group (``all`` and each family): decision agreement with the full prefill on prompts
    whose full prefill owns its decision (Wilson CI) and mean KL(full || composed) (cluster-bootstrap
    CI) against the seam, for rotated vs no-rotate keys and each sink."""
    agg = record["result"]["aggregates"]
    seams, sinks, var = agg["seams"], agg["sinks"], agg["variants"]
    groups = ["all", *agg["families"]]
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups) + 1, 7), squeeze=False)
    colors = plt.cm.tab10(np.arange(len(sinks)))
    x = np.array(seams, dtype=float)
    xplot = np.where(x == 0, 0.5, x)                       # seam 0 drawn at 0.5 on the log2 axis
    for j, g in enumerate(groups):
        for k, sink in enumerate(sinks):
            for rot, ls in (("rotate", "-"), ("no_rotate", "--")):
                names = [f"{rot}/sink={sink}/seam={s}" for s in seams]
                _share_line(axes[0, j], xplot, [var[n]["decision_agreement"][g] for n in names],
                            f"{rot}, sink={sink}", color=colors[k], ls=ls)
                kl = [var[n]["kl"][g] for n in names]
                ok = [i for i, p in enumerate(kl) if p.get("n")]
                if ok:
                    mean = np.array([kl[i]["mean"] for i in ok], dtype=float)
                    lo = np.array([kl[i]["ci_mean"][0] if kl[i].get("ci_mean") else kl[i]["mean"] for i in ok])
                    hi = np.array([kl[i]["ci_mean"][1] if kl[i].get("ci_mean") else kl[i]["mean"] for i in ok])
                    axes[1, j].plot(xplot[ok], np.maximum(mean, 1e-6), marker="o", color=colors[k], ls=ls)
                    axes[1, j].fill_between(xplot[ok], np.maximum(lo, 1e-6), np.maximum(hi, 1e-6),
                                            color=colors[k], alpha=0.12, lw=0)
        axes[0, j].set_title(g, fontsize=10)
        axes[0, j].set_ylim(-0.05, 1.05)
        axes[1, j].set_yscale("log")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xplot, [str(s) for s in seams])
            ax.set_xlabel("seam s (chunk tokens recomputed)")
    axes[0, 0].set_ylabel("decision agreement (owned prompts)")
    axes[1, 0].set_ylabel("KL(full || composed), nats")
    axes[0, 0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title(record) + "\nsolid: keys rotated; dashed: no-rotate control", fontsize=10)
    fig.tight_layout()
    return [save(fig, out_dir, "compose_seam.png")]
