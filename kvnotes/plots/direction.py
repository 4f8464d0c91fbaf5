"""Figures of the ``direction`` circuit probe: per scanned layer, held-out sufficiency recovery of
the difference-of-means direction vs its controls (norm-matched random directions, the orthogonal
complement, the full residual difference) and held-out necessity (mean-ablation drop fraction) vs
random-direction ablation, means with 95% cluster-bootstrap CIs; the layer chosen on the
selection split is marked, with the selection curve it came from. Numbers come from the record
only."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from kvnotes.plots import ci_line, save, title

_STYLE = {"direction": ("tab:red", "-", "direction"), "orthogonal": ("tab:blue", "--", "orthogonal complement"),
          "full": ("grey", ":", "full difference"), "random": ("tab:green", "-.", "random, norm-matched"),
          "random_subspace": ("tab:olive", (0, (3, 1, 1, 1)), "random 1-d subspace of the difference")}
#: A control the style table does not know yet is drawn, not dropped.
_OTHER = ("tab:purple", (0, (1, 1)))


def _style(variant: str) -> tuple:
    return _STYLE.get(variant, (*_OTHER, variant))


def _line(ax, curve: dict, layers: list, fam: str, variant: str) -> None:
    color, ls, label = _style(variant)
    pts = [curve.get(str(l), {}).get(fam, {}) for l in layers]
    ci_line(ax, layers, pts, label, ls=ls, marker="o", ms=3, color=color)


def plot_direction(record: dict, out_dir: Path) -> list[Path]:
    """One row per family with held-out pairs (and ``all``); columns: sufficiency, necessity."""
    agg = record["result"]["aggregates"]
    layers = agg["layers"]
    curves = agg["curves"]
    first = curves["suff"]["direction"].get(str(layers[0]), {}) if layers else {}
    fams = [f for f in agg["families"] + ["all"] if first.get(f, {}).get("n")]
    if not fams:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no held-out flipping pairs: no circuit to find", ha="center", transform=ax.transAxes)
        return [save(fig, out_dir, "direction.png")]
    fig, axes = plt.subplots(len(fams), 2, figsize=(13, 3.3 * len(fams)), squeeze=False)
    for row, f in enumerate(fams):
        ch = agg["chosen_layers"].get(f)
        for col, kind in enumerate(("suff", "nec")):
            ax = axes[row][col]
            for v in curves[kind]:
                _line(ax, curves[kind][v], layers, f, v)
            if kind == "suff" and ch:
                ax.plot(layers, ch["curve"], color="black", lw=0.8, ls=(0, (1, 2)),
                        label=f"selection mean (n={len(ch['pairs'])}, {ch['source']})")
            if ch:
                ax.axvline(ch["layer"], color="black", lw=0.6, alpha=0.5)
            ax.axhline(0, color="grey", lw=0.6)
            ax.axhline(1, color="grey", lw=0.6, ls="--")
            ax.set_xlabel("layer (residual after it)")
            if kind == "suff":
                ax.set_ylabel("recovery (held-out)")
                ax.set_title(f"{f}: sufficiency, add along direction in old prefill"
                             + (f"; chosen layer {ch['layer']}" if ch else ""), fontsize=9)
            else:
                ax.set_ylabel("drop / (s_new − s_old) (held-out)")
                ax.set_title(f"{f}: necessity, mean-ablate projection ({agg['ablate_to']}) in new prefill",
                             fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(title(record) + f" · LOSO diff-of-means at note positions [b, d) · fit scope {agg['fit_scope']}")
    fig.tight_layout()
    return [save(fig, out_dir, "direction.png")]
