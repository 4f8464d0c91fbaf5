"""Figures drawn from records only: every number comes from a record's JSON.

One module per probe (``kvnotes/plots/<probe>.py``) holds its drawing function, which the probe's
presentation names (``PRESENTATION.plot``, :mod:`kvnotes.records.presentation`); :func:`plot_record`
finds it through the module the record names. ``kvnotes plot`` is the command-line front end and
the notebooks call the same functions.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from kvnotes.records.presentation import presentation  # noqa: E402  (after the backend is chosen)

def plot_record(record: dict, out_dir: str | Path) -> list[Path]:
    """Write the figures of a record into ``out_dir`` with the drawing function its probe's
    presentation names (:func:`kvnotes.records.presentation.presentation`); returns their paths
    (none for probes without figures)."""
    fn = presentation(record).plot
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        fn = getattr(importlib.import_module(module), name)
    return fn(record, Path(out_dir)) if fn else []


#: How each ``ci_method`` of :func:`kvnotes.harness.stats.summarize` is named in figure titles.
CI_METHOD_NAMES = {"cluster_bootstrap": "cluster bootstrap (>= 5 scenarios)",
                   "t_over_scenario_means": "t over scenario means (2-4 scenarios)",
                   "t_over_instance_means": "t over instance means (1 scenario)",
                   "none_single_cluster": "none (1 cluster)"}


def ci_methods(obj) -> list[str]:
    """Every distinct ``ci_method`` found in a (nested) record fragment, sorted."""
    found: set[str] = set()

    def walk(o):
        if isinstance(o, dict):
            if o.get("ci_method"):
                found.add(o["ci_method"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return sorted(found)


def title(record: dict) -> str:
    """Figure title: model, probe, scenario suite, the flip rule, and the interval methods used by
    the record's aggregates (shares use Wilson intervals)."""
    rule = record.get("config", {}).get("flip_rule", "relative")
    methods = [CI_METHOD_NAMES.get(m, m) for m in ci_methods(record.get("result", {}).get("aggregates", {}))]
    head = f"{record['model']['name']} · {record['probe']} · {record['scenario']['name']} · flip rule {rule}"
    return head + (f"\nmean CIs (95%): {'; '.join(methods)}" if methods else "")


def ci_bounds(points: list[dict], key: str = "ci_mean"):
    """``(lo, hi)`` float arrays of the intervals ``point[key]``; NaN where a point has none
    (no data, or a single cluster)."""
    import numpy as np

    lo = np.array([p[key][0] if p and p.get(key) else np.nan for p in points], dtype=float)
    hi = np.array([p[key][1] if p and p.get(key) else np.nan for p in points], dtype=float)
    return lo, hi


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
    lo, hi = ci_bounds([points[i] for i in ok])
    ax.plot(xs, mean, label=f"{label} (n={points[ok[0]]['n']})" if label else None, **style)
    ax.fill_between(xs, lo, hi, color=style.get("color"), alpha=0.15, lw=0)
