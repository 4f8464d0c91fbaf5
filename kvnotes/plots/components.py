"""Figures of the ``components`` circuit probe: per-layer attention vs MLP direct logit
attribution (held-out means with 95% CIs, method in the title) to the candidates' logit
difference, at the top note position and at the decision position, as stacked bars per family.
Numbers come from the record only."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from kvnotes.plots import ci_bounds, save, title


def _vals(summaries: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    mean = np.array([s["mean"] if s.get("n") else np.nan for s in summaries], dtype=float)
    lo, hi = ci_bounds(summaries)
    return mean, np.stack([mean - lo, hi - mean])


def plot_components(record: dict, out_dir: Path) -> list[Path]:
    """One row per family with held-out pairs; columns: at the note position, at the decision."""
    agg = record["result"]["aggregates"]
    contrib = agg["contributions"]
    fams = [f for f in agg["families"] + ["all"] if contrib["at_decision"].get(f, {}).get("final", {}).get("n")]
    if not fams:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no held-out flipping pairs: no circuit to find", ha="center", transform=ax.transAxes)
        return [save(fig, out_dir, "components.png")]
    fig, axes = plt.subplots(len(fams), 2, figsize=(14, 3.2 * len(fams)), squeeze=False)
    x = np.arange(agg["n_layers"])
    for row, f in enumerate(fams):
        for col, where in enumerate(("at_note", "at_decision")):
            ax = axes[row][col]
            c = contrib[where].get(f, {})
            if not c.get("final", {}).get("n"):
                ax.text(0.5, 0.5, "no note position", ha="center", transform=ax.transAxes)
                continue
            a, ea = _vals(c["attn"])
            m, em = _vals(c["mlp"])
            ax.bar(x, a, 0.8, yerr=ea, color="tab:blue", label="attention", capsize=1.5, error_kw={"lw": 0.6})
            # stacked: MLP on top of attention where both push the same way
            bottom = np.where(np.sign(a) == np.sign(m), a, 0.0)
            ax.bar(x, m, 0.8, bottom=bottom, yerr=em, color="tab:orange", label="MLP", capsize=1.5,
                   error_kw={"lw": 0.6})
            ax.axhline(0, color="grey", lw=0.6)
            n = c["final"]["n"]
            pos = "top note position" if where == "at_note" else "decision position"
            ax.set_title(f"{f}: {pos}; total Δ logit diff = {c['final']['mean']:.3g}, embed {c['embed']['mean']:.3g} (n={n})",
                         fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel("Δ direct logit attribution (nats)")
            ax.legend(fontsize=7)
    fig.suptitle(title(record) + " · new − old direct logit attribution to the candidates' logit difference")
    fig.tight_layout()
    return [save(fig, out_dir, "components.png")]
