"""A probe's presentation, declared in its own module and found from its records.

A probe module (or any module that writes records) declares ``PRESENTATION``, a :class:`Presentation`:
the report's headline for its records, its figures as figure specs that both the report (plotly) and
``kvnotes plot`` (PNG, :mod:`kvnotes.plots`) draw (:class:`kvnotes.records.figures.Bars`,
:class:`~kvnotes.records.figures.Curves`, :class:`~kvnotes.records.figures.Reshaped`), and its Markdown table (``kvnotes table``, the report's page). Nothing central is keyed by
a probe's name: a record names the module that wrote it (``config.probe._target_``, the probe's run
function; or ``presentation``, a module path, for records written outside a probe such as the
serving benchmark's), and :func:`presentation` imports that module and reads its declaration. A
record whose module cannot be imported, or declares nothing, gets the defaults every page has (the
aggregate bars and the table of every summary).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: A headline: a path under ``result.aggregates`` to a summary, or ``record -> (label, value)`` (None:
#: fall back to the first aggregate with pairs).
Headline = str | Callable[[dict], tuple[str, str] | None]


@dataclass(frozen=True)
class ResultsColumn:
    """A column a probe's record adds to the per-family results table of a model and suite
    (:func:`kvnotes.records.tables.results_table`).

    Attributes:
        rank: where it goes among every record's columns (ascending).
        header: the column's header.
        cell: ``(record, family or "all") -> Markdown cell`` (``-`` for nothing to show).
    """

    rank: int
    header: str
    cell: Callable[[dict, str], str]


@dataclass(frozen=True)
class Presentation:
    """How a probe's records are shown.

    Attributes:
        headline: the report index's headline of a record (:data:`Headline`; None: the first
            aggregate with pairs).
        figures: its figure specs (:class:`kvnotes.records.figures.Bars` / ``Curves`` / ``Reshaped``,
            reading record keys): the report draws them on a record's page besides the figures every
            page gets, ``kvnotes plot`` writes one PNG each.
        table: ``fn(record) -> Markdown`` (None: :func:`kvnotes.records.tables.aggregates_table`);
            keyword options the table accepts (``by`` of the screen table) are passed by ``kvnotes table``.
        plot: records written outside a probe (the serving benchmark's): ``fn(record, out_dir) ->
            written paths`` drawing static figures besides the specs', or ``"module:function"``
            naming it (imported when drawing, so importing its module does not import matplotlib).
        results: the columns its records add to the per-family results table (:class:`ResultsColumn`).
    """

    headline: Headline | None = None
    figures: tuple[Any, ...] = ()
    table: Callable[..., str] | None = None
    plot: str | Callable[[dict, Path], list[Path]] | None = None
    results: tuple[ResultsColumn, ...] = ()


#: What a record whose module declares nothing gets.
DEFAULT = Presentation()


#: Where the modules named by records written before the probes installed inside the package live now
#: (``probes.<name>.run`` -> ``kvnotes.probes.<name>``): such records keep their tables and figures.
MOVED = {"probes": "kvnotes.probes", "circuits": "kvnotes.circuits"}


def source_module(rec: dict) -> str | None:
    """The module that wrote a record: that of ``config.probe._target_``, else the record's
    ``presentation`` key; None when the record names neither. A module of an older record's
    top-level ``probes``/``circuits`` package is named by its place in ``kvnotes`` (:data:`MOVED`)."""
    probe = (rec.get("config") or {}).get("probe")
    target = probe.get("_target_") if isinstance(probe, dict) else None
    named = rec.get("presentation")
    module = (target.rsplit(".", 1)[0] if isinstance(target, str) and "." in target
              else named if isinstance(named, str) and named else None)
    if module is None:
        return None
    top, dot, rest = module.partition(".")
    return f"{MOVED[top]}{dot}{rest}" if top in MOVED else module


@functools.cache
def _declared(module: str) -> Presentation:
    """The module's ``PRESENTATION``; :data:`DEFAULT` when the module is not installed here (a record of
    another project's probe) or declares none. A module that is here but fails to import gets the
    default too, said on stderr in one ``kvnotes: warning:`` line (it used to be silent)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return DEFAULT
        return _broken(module, exc)
    except ImportError as exc:
        return _broken(module, exc)
    got = getattr(mod, "PRESENTATION", DEFAULT)
    return got if isinstance(got, Presentation) else DEFAULT


def _broken(module: str, exc: ImportError) -> Presentation:
    """:data:`DEFAULT`, with one stderr line saying the module that wrote a record fails to import."""
    print(f"kvnotes: warning: {module} (which wrote a record) fails to import ({' '.join(str(exc).split())}); "
          "its records are shown with the default presentation", file=sys.stderr)
    return DEFAULT


def presentation(rec: dict) -> Presentation:
    """The :class:`Presentation` the module that wrote ``rec`` declares (:func:`source_module`;
    :data:`DEFAULT` when none can be found)."""
    module = source_module(rec)
    return DEFAULT if module is None else _declared(module)
