"""Figures drawn from records only (DESIGN.md §8): every number comes from a record's JSON.

One module per probe (``kvnotes/plots/<probe>.py``) registers its drawing function with
:func:`plotter`; :func:`plot_record` imports the module named after the record's probe and
dispatches. ``scripts/plot.py`` is the command-line front end and the notebooks call the same
functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

PLOTTERS: dict[str, Callable[[dict, Path], list[Path]]] = {}


def plotter(name: str):
    """Register ``fn(record, out_dir) -> list of written paths`` as the figures of probe ``name``."""
    def register(fn):
        PLOTTERS[name] = fn
        return fn
    return register


def plot_record(record: dict, out_dir: str | Path) -> list[Path]:
    """Write the figures of a record into ``out_dir``; returns their paths (none for probes
    without figures)."""
    name = record["probe"]
    if name not in PLOTTERS:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    fn = PLOTTERS.get(name)
    return fn(record, Path(out_dir)) if fn else []


def title(record: dict) -> str:
    """Figure title: model, probe, scenario suite."""
    return f"{record['model']['name']} · {record['probe']} · {record['scenario']['name']}"


def save(fig, out_dir: Path, name: str) -> Path:
    """Save a figure as ``out_dir/name`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    path = Path(out_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ci_line(ax, x, points: list[dict], label: str, **style) -> None:
    """Plot a mean curve with its CI band from aggregate dicts (``mean``, ``ci_mean``, ``n``);
    points without data (``n`` 0 or missing) are skipped."""
    import numpy as np

    ok = [i for i, p in enumerate(points) if p.get("n")]
    if not ok:
        return
    xs = np.array([x[i] for i in ok])
    mean = np.array([points[i]["mean"] for i in ok], dtype=float)
    lo = np.array([points[i]["ci_mean"][0] for i in ok], dtype=float)
    hi = np.array([points[i]["ci_mean"][1] for i in ok], dtype=float)
    ax.plot(xs, mean, label=f"{label} (n={points[ok[0]]['n']})" if label else None, **style)
    ax.fill_between(xs, lo, hi, color=style.get("color"), alpha=0.15, lw=0)
