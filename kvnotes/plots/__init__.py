"""Static figures (PNG) drawn from records only: every number comes from a record's JSON.

A probe declares its figures once, as figure specs in its presentation (``PRESENTATION.figures``:
:class:`kvnotes.records.figures.Bars`, :class:`~kvnotes.records.figures.Curves`,
:class:`~kvnotes.records.figures.Reshaped`; :mod:`kvnotes.records.presentation`). Both renderers read
the same specs: the report draws them with plotly (:mod:`kvnotes.records.figures`), and
:func:`plot_record` here draws them with matplotlib, one ``<probe>-<figure id>.png`` per figure (per grid kind
of a curve). No module here is a probe's. ``kvnotes plot`` is the command-line front end and the
notebooks call the same function. Records written outside a probe (the serving benchmark's) may name
a drawing function of their own instead (``Presentation.plot``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from kvnotes.records.figures import BarData, CurveData  # noqa: E402  (after the backend is chosen)
from kvnotes.records.presentation import presentation  # noqa: E402


def plot_record(record: dict, out_dir: str | Path) -> list[Path]:
    """Write the figures of a record into ``out_dir``: each figure spec its probe's presentation
    declares (:func:`kvnotes.records.presentation.presentation`), drawn by :func:`png`, then the
    drawing function a non-probe record's presentation names; returns their paths (none for a record
    whose probe declares no figure, or whose figures find no values)."""
    pres = presentation(record)
    out: list[Path] = []
    for spec in pres.figures:
        out += [png(d, record, Path(out_dir)) for d in spec.data(record)]
    fn = pres.plot
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        fn = getattr(importlib.import_module(module), name)
    return out + (fn(record, Path(out_dir)) if fn else [])


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


def save(fig, out_dir: Path, name: str) -> Path:
    """Save a figure as ``out_dir/name`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    path = Path(out_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _errors(points) -> list[list[float]]:
    """Matplotlib ``yerr`` (below, above) of drawn points; 0 where a point has no interval."""
    return [[p.y - p.lo if p is not None and p.lo is not None else 0.0 for p in points],
            [p.hi - p.y if p is not None and p.hi is not None else 0.0 for p in points]]


def png(d: BarData | CurveData, record: dict, out_dir: Path) -> Path:
    """One figure spec's data (:meth:`kvnotes.records.figures.Bars.data`, ``Curves.data``) drawn
    with matplotlib as ``out_dir/<probe>-<id>.png``: grouped bars with their 95% intervals, or curves with
    theirs, one panel per family (``all`` first), the reference value dotted."""
    import matplotlib.pyplot as plt
    import numpy as np

    if isinstance(d, BarData):
        n, k = len(d.categories), max(1, len(d.traces))
        fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * n * k + 3), 4.5))
        w = 0.8 / k
        for j, (name, pts) in enumerate(d.traces.items()):
            xs = np.arange(n) + (j - (k - 1) / 2) * w
            ax.bar(xs, [p.y if p is not None else 0.0 for p in pts], w, label=name or None,
                   yerr=np.clip(np.array(_errors(pts)), 0, None), capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks(range(n), d.categories, rotation=20 if n > 4 else 0, fontsize=8)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylabel(d.ylabel, fontsize=8)
        if d.ylog:
            ax.set_yscale("log")
        if any(d.traces):
            ax.legend(fontsize=7)
        ax.set_title(d.title, fontsize=9)
    else:
        spec, names = d.spec, d.panels
        cols = min(3, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1, 3.4 * rows + 1), squeeze=False, sharey=True)
        for i, name in enumerate(names):
            ax = axes[i // cols, i % cols]
            for c, t in enumerate(d.traces):
                pts = d.points[name].get(t, [])
                if not pts:
                    continue
                ys = [p for _, p in pts]
                ax.errorbar([x for x, _ in pts], [p.y for p in ys], yerr=np.clip(np.array(_errors(ys)), 0, None),
                            fmt="o", ms=3, lw=1, capsize=2, color=f"C{c % 10}",
                            ls="none" if spec.markers else "--" if t.startswith(spec.dashed) else "-",
                            label=(t or spec.ylabel) if i == 0 else None)
            ref = d.refs.get(name)
            if ref is not None:
                ax.axhline(ref.y, color="k", ls=":", lw=0.8)
            if spec.xlog_for(d.kind):
                ax.set_xscale("log")
            if spec.ylog:
                ax.set_yscale("log")
            if spec.xreverse:
                ax.invert_xaxis()
            ax.set_title(d.titles[i], fontsize=8)
            ax.set_xlabel(f"{spec.xlabel} ({d.kind})" if d.kind else spec.xlabel, fontsize=8)
        for j in range(len(names), rows * cols):
            axes[j // cols, j % cols].set_visible(False)
        axes[0, 0].set_ylabel(spec.ylabel, fontsize=8)
        if any(d.traces):
            fig.legend(fontsize=7, loc="lower right")
        fig.text(0.5, 0.005, d.title, ha="center", va="bottom", fontsize=9)
    fig.suptitle(title(record), fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save(fig, out_dir, f"{record.get('probe', 'record')}-{d.id}.png")
