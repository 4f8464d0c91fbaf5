"""The figures of a report page, drawn from a record's numbers only: token strips, layer x position
and single-head maps where the data holds them, and per probe the per-family figures and curves that
``kvnotes plot`` draws, read from the record keys its presentation names (``PRESENTATION`` in the probe's
module, :mod:`kvnotes.records.presentation`; :mod:`kvnotes.records.report`)."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvnotes.records.tables import summaries
from kvnotes.records.pages import _Page
from kvnotes.records.presentation import presentation

#: Pairs drawn as token strips per record page.
MAX_STRIPS = 4

def token_strip(tokens: list[str], values: dict[int, float], title: str, label: str, field: tuple[int, int],
                decision: int):
    """A one-row heatmap over the prompt's tokens: colour and hover = ``values`` (position -> value),
    blank where there is none; the field span and the decision position are marked."""
    import plotly.graph_objects as go

    z = [[values.get(i) for i in range(len(tokens))]]
    text = [[f"{i}: {tok!r}" for i, tok in enumerate(tokens)]]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(tokens))), text=text, colorscale="Viridis",
                               hovertemplate="%{text}<br>" + label + " %{z:.4f}<extra></extra>",
                               colorbar={"title": label}))
    a, b = field
    fig.add_vrect(x0=a - 0.5, x1=b - 0.5, line_color="cyan", line_width=2)
    fig.add_vline(x=decision, line_dash="dash", line_color="red")
    labels = [tok.replace("\n", "⏎")[:12] for tok in tokens]
    fig.update_layout(title=title, height=300, margin={"t": 40, "b": 110}, yaxis={"visible": False},
                      xaxis={"tickvals": list(range(len(tokens))), "ticktext": labels, "tickangle": -90,
                             "tickfont": {"size": 8}})
    return fig


def _strip_meta(pair: str, tokens: list, vals: dict[int, float], position: int, **extra) -> dict:
    return {"kind": "token_strip", "pair": pair, "n_tokens": len(tokens), "position": position,
            "value": vals.get(position), **extra}


def _single_strips(page: _Page, rec: dict) -> None:
    """Token strips of single-position recovery (rows with ``single`` over their ``downstream``): the
    pairs whose notes carry the most first, then each family's example pair (``result.examples``,
    the pairs ``kvnotes plot`` maps) not drawn yet."""
    prompts = rec.get("prompts") or {}
    res = rec["result"]
    rows = [r for r in res.get("rows", []) if r.get("single") and r.get("downstream") and r.get("pair") in prompts]
    rows = sorted(rows, key=lambda r: -max((v for v in r["single"] if v is not None), default=0.0))[:MAX_STRIPS]
    drawn = {r["pair"] for r in rows}
    strips = [(r["pair"], r["downstream"][0], r["single"], f"{r['pair']}: single-position recovery", {}) for r in rows]
    for fam, ex in sorted((res.get("examples") or {}).items()):
        if isinstance(ex, dict) and ex.get("single") and ex.get("downstream") and ex.get("pair") in prompts \
                and ex["pair"] not in drawn:
            drawn.add(ex["pair"])
            strips.append((ex["pair"], ex["downstream"][0], ex["single"],
                           f"{fam}: {ex['pair']} ({ex.get('split', '-')}), the family's example: single-position "
                           "recovery", {"family": fam}))
    for pair, b, single, title, extra in strips:
        j = sum(f["kind"] == "token_strip" for f in page.figures)
        vals = {b + k: v for k, v in enumerate(single) if v is not None}
        p = prompts[pair]
        page.figure(token_strip(p["tokens"], vals, title, "recovery", p["field"], p["decision"]), f"strip-{j}",
                    _strip_meta(pair, p["tokens"], vals, b, **extra))


def _example_maps(page: _Page, rec: dict) -> None:
    """Per family's example pair with layer x position maps (``result.examples[f].maps``): a token
    strip of the layer-mean key deviation and the maps of the keys and of the attention output."""
    import plotly.graph_objects as go

    examples = [(f, ex) for f, ex in (rec["result"].get("examples") or {}).items()
                if isinstance(ex, dict) and isinstance(ex.get("maps"), dict) and ex["maps"].get("k_rel")
                and ex.get("tokens")][:MAX_STRIPS]
    for j, (fam, ex) in enumerate(examples):
        maps = ex["maps"]["k_rel"]
        n = len(maps[0])
        mean = {i: sum(row[i] for row in maps) / len(maps) for i in range(n)}
        f = ex.get("field")
        field = tuple(f) if isinstance(f, (list, tuple)) else ((f, f + 1) if isinstance(f, int) else (0, 0))
        k = sum(x["kind"] == "token_strip" for x in page.figures)
        page.figure(token_strip(ex["tokens"][:n], mean, f"{fam}: {ex.get('pair', '')} key deviation, layer mean",
                                "rel. L2", field, ex.get("decision", n - 1)), f"strip-{k}",
                    {"kind": "token_strip", "pair": ex.get("pair"), "n_tokens": n, "family": fam})
        for metric, what, fig_id in (("k_rel", "relative L2 change of the keys", f"map-{j}"),
                                     ("attn_rel", "relative change of the attention output (field-only refresh)",
                                      f"map-attn-{j}")):
            grid = ex["maps"].get(metric)
            if not grid:
                continue
            fig = go.Figure(go.Heatmap(z=grid, colorscale="Magma", hovertemplate="layer %{y}, position %{x}: "
                                       "%{z:.4f}<extra></extra>"))
            fig.add_vrect(x0=field[0] - 0.5, x1=field[1] - 0.5, line_color="cyan", line_width=2)
            fig.update_layout(title=f"{fam}: {what} (layer x position)", height=380, xaxis_title="position",
                              yaxis_title="layer")
            page.figure(fig, fig_id, {"kind": "layer_position_map", "family": fam})


def _row_maps(page: _Page, rec: dict) -> None:
    """Single-head maps (layer x head) of the first two rows that carry ``maps``."""
    import plotly.graph_objects as go

    mapped = [r for r in rec["result"].get("rows", []) if isinstance(r.get("maps"), dict) and r["maps"]][:2]
    for j, r in enumerate(mapped):
        for mode, grid in r["maps"].items():
            fig = go.Figure(go.Heatmap(z=grid, colorscale="RdBu", zmid=0,
                                       hovertemplate="layer %{y}, head %{x}: recovery %{z:.4f}<extra></extra>"))
            fig.update_layout(title=f"{r['pair']} ({r.get('split', '-')}): single-head {mode} map (recovery)",
                              xaxis_title="head", yaxis_title="layer", height=420)
            page.figure(fig, f"headmap-{mode}-{j}", {"kind": "head_map", "pair": r["pair"]})


# --------------------------------------------------------------------- figures from the figure table
#
# A probe's presentation says which record keys hold per-family summaries and curves over k (or a
# threshold, a layer, a seam); the drawing below is the same for every probe. A path is read under
# ``result.aggregates``, segment by segment: a key; ``@`` every key (or list index) of that level, the
# x categories of bars or the panels of curves (families, ``all`` first; memory lengths); ``*`` every
# key, one trace each; ``[a,b]`` the keys a and b, one trace each; ``#`` every key or list index,
# the x values of curves; ``?a,b`` the first of a, b that is present and not empty. The leaf is a
# summary (``mean``, ``ci_mean``, ``n``), a share (``p``, ``ci``, ``n``) or a number named by a key
# or ``[a,b]`` (wildcards pass over numbers: a count beside the families is no family); a path that
# is not in a record (older versions) draws nothing.

class _P(NamedTuple):
    """One drawn value: y, its interval (None without one), n and the hover line."""

    y: float
    lo: float | None
    hi: float | None
    n: int | None
    hover: str


def _point(leaf) -> _P | None:
    """The value a leaf draws (a summary's mean, a share's p, a number); None when it has no pairs."""
    if isinstance(leaf, bool) or leaf is None:
        return None
    if isinstance(leaf, (int, float)):
        return _P(float(leaf), None, None, None, f"{leaf:g}")
    if not isinstance(leaf, dict) or not leaf.get("n"):
        return None
    if isinstance(leaf.get("mean"), (int, float)):
        y, ci_, how = leaf["mean"], leaf.get("ci_mean"), leaf.get("ci_method") or "no interval"
    elif isinstance(leaf.get("p"), (int, float)):
        y, ci_, how = leaf["p"], leaf.get("ci"), "Wilson"
    else:
        return None
    lo, hi = (ci_ if isinstance(ci_, (list, tuple)) and len(ci_) == 2 and None not in ci_ else (None, None))
    interval = f" [{lo:.4f}, {hi:.4f}] {how}" if lo is not None else f" ({how})"
    return _P(float(y), lo, hi, leaf["n"], f"{y:.4f}{interval}, n={leaf['n']}")


def _walk(node, segs: list[str], keys: tuple = ()):
    """Yield ``(keys, leaf)`` for every leaf ``segs`` reaches from ``node``; ``keys`` holds
    ``(mark, key)`` for every wildcard segment passed (``@``, ``*``, ``#``; ``[a,b]`` gives ``*``, and
    ``?a,b`` gives ``?``)."""
    if not segs:
        yield keys, node
        return
    seg, rest = segs[0], segs[1:]
    if seg in ("@", "*", "#") or seg.startswith("["):
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
        if seg.startswith("["):
            wanted = seg[1:-1].split(",")
            items = sorted((kv for kv in items if kv[0] in wanted), key=lambda kv: wanted.index(kv[0]))
        for k, v in items:
            if seg.startswith("[") or isinstance(v, (dict, list)):     # a count beside the families is no family
                yield from _walk(v, rest, keys + (("*" if seg.startswith("[") else seg, k),))
    elif seg.startswith("?"):
        alt = next((a for a in seg[1:].split(",") if isinstance(node, dict) and node.get(a)), None)
        if alt is not None:
            yield from _walk(node[alt], rest, keys + (("?", alt),))
    elif isinstance(node, dict) and seg in node:
        yield from _walk(node[seg], rest, keys)


def _key(keys: tuple, mark: str):
    return next((k for m, k in keys if m == mark), None)


def _all_first(names) -> list:
    names = list(dict.fromkeys(names))
    return [n for n in names if n == "all"] + [n for n in names if n != "all"]


def _label(item) -> str:
    """A list item's label (a layer band's ``name``, a grid point's ``value``, or the item)."""
    if isinstance(item, dict):
        return str(item.get("name", item.get("value", item)))
    return f"{item:g}" if isinstance(item, float) else str(item)


def _color(i: int) -> str:
    from plotly.colors import qualitative

    return qualitative.Plotly[i % len(qualitative.Plotly)]


@dataclass(frozen=True)
class BarData:
    """What a :class:`Bars` spec draws from one record, for either renderer (the report's plotly
    page, the PNG of ``kvnotes plot``): x ``categories`` (``all`` first) and per trace one point per
    category (None: no value)."""

    id: str
    title: str
    ylabel: str
    categories: list[str]
    traces: dict[str, list[_P | None]]
    ylog: bool = False


@dataclass(frozen=True)
class CurveData:
    """What a :class:`Curves` spec draws from one record, for either renderer: one panel per
    ``panels`` entry (titled ``titles``), per panel and trace the points ``(x, value)`` sorted by x,
    and a reference value per panel (``refs``)."""

    id: str
    title: str
    kind: str
    panels: list[str]
    titles: list[str]
    traces: list[str]
    points: dict[str, dict[str, list[tuple[float, _P]]]]
    refs: dict[str, _P]
    spec: "Curves"


@dataclass(frozen=True)
class Bars:
    """Grouped bars with 95% intervals: ``@`` the x categories, ``*`` / ``[a,b]`` the traces.

    Attributes:
        labels: a ``result`` key whose list labels the ``@`` level when it is a list (layer bands).
        names: trace labels by key.
    """

    id: str
    path: str
    title: str
    ylabel: str = ""
    labels: str | None = None
    names: dict = dataclasses.field(default_factory=dict)
    ylog: bool = False

    def data(self, rec: dict, root: dict | None = None) -> list[BarData]:
        """The bars of a record (none when the path reaches no value)."""
        res = rec["result"]
        root = (res["aggregates"] or {}) if root is None else root     # a result without aggregates is refused
        lab = res.get(self.labels) if self.labels else None
        traces: dict[str, dict[str, _P]] = {}
        alt = ""
        for keys, leaf in _walk(root, self.path.split("/")):
            p = _point(leaf)
            if p is None:
                continue
            cat = _key(keys, "@")
            cat = _label(lab[cat]) if isinstance(cat, int) and isinstance(lab, list) and cat < len(lab) else str(cat)
            name = " ".join(str(self.names.get(k, k)) for m, k in keys if m == "*")
            alt = alt or (_key(keys, "?") or "")
            traces.setdefault(name, {})[cat] = p
        if not traces:
            return []
        cats = _all_first(c for t in traces.values() for c in t)
        return [BarData(self.id, self.title.format(alt=alt), self.ylabel, cats,
                        {name: [pts.get(c) for c in cats] for name, pts in traces.items()}, self.ylog)]

    def draw(self, page: _Page, rec: dict, root: dict | None = None) -> None:
        for d in self.data(rec, root):
            _plotly_bars(page, d)


def _plotly_bars(page: _Page, d: BarData) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for i, (name, ps) in enumerate(d.traces.items()):
        fig.add_bar(x=d.categories, y=[p.y if p else None for p in ps], name=name or d.ylabel, marker_color=_color(i),
                    error_y={"type": "data", "array": [p.hi - p.y if p and p.hi is not None else 0 for p in ps],
                             "arrayminus": [p.y - p.lo if p and p.lo is not None else 0 for p in ps]},
                    customdata=[p.hover if p else "-" for p in ps],
                    hovertemplate=f"{html.escape(name)} · %{{x}}: %{{customdata}}<extra></extra>")
    fig.update_layout(title=d.title, barmode="group", height=400, yaxis_title=d.ylabel,
                      showlegend=len(d.traces) > 1 or bool(next(iter(d.traces))))
    if d.ylog:
        fig.update_yaxes(type="log")
    page.figure(fig, d.id, {"kind": "family_bars", "title": d.title, "categories": d.categories,
                            "traces": list(d.traces)})


@dataclass(frozen=True)
class Curves:
    """Curves with 95% intervals over ``#`` (k, a threshold, a layer), one panel per ``@`` (families,
    ``all`` first), one trace per ``*`` / ``[a,b]``.

    Attributes:
        x: a ``result`` key whose list gives the x values of ``#`` list indexes (numbers, or
            ``{kind, value}`` grid points: one figure per kind); without it dict keys are the x values.
        xy: instead of ``#``, a leaf of parallel lists: the x and y keys.
        xlog: log x axis: True, or the grid kinds that get one.
        ref: a path (``@`` replaced by the panel) of a reference value drawn as a dotted line.
        dashed: traces whose names start with one of these are dashed.
        xreverse: the x axis runs right to left.
        markers: points only, no lines (a scatter of labelled points: one trace each).
    """

    id: str
    path: str
    title: str
    xlabel: str = ""
    ylabel: str = ""
    x: str | None = None
    xy: tuple[str, str] | None = None
    xlog: bool | tuple[str, ...] = False
    ylog: bool = False
    ref: str | None = None
    ref_name: str = "reference"
    dashed: tuple[str, ...] = ()
    xreverse: bool = False
    markers: bool = False

    def data(self, rec: dict, root: dict | None = None) -> list[CurveData]:
        """The curves of a record, one :class:`CurveData` per grid kind (none when the path reaches
        no value)."""
        res = rec["result"]
        root = (res["aggregates"] or {}) if root is None else root     # a result without aggregates is refused
        xs = res.get(self.x) if self.x else None
        # kind -> panel -> trace -> [(x, point)]
        data: dict[str, dict[str, dict[str, list[tuple[float, _P]]]]] = {}
        alt = ""
        for keys, leaf in _walk(root, self.path.split("/")):
            panel = str(_key(keys, "@") if _key(keys, "@") is not None else "")
            name = " ".join(str(k) for m, k in keys if m == "*")
            alt = alt or (_key(keys, "?") or "")
            for kind, x, p in self._points(keys, leaf, xs):
                data.setdefault(kind, {}).setdefault(panel, {}).setdefault(name, []).append((x, p))
        out = []
        for kind, panels in data.items():
            names = _all_first(panels)
            titles = []
            for name in names:
                ns = [p.n for pts in panels[name].values() for _, p in pts if p.n]
                titles.append(f"{name} (n≤{max(ns)})" if ns and name else name)
            refs = {}
            for name in names:
                ref = next((_point(leaf) for _, leaf in _walk(root, self.ref.replace("@", name).split("/"))),
                           None) if self.ref else None
                if ref is not None:
                    refs[name] = ref
            title = self.title.format(alt=alt) + (f" · k as {kind}" if kind else "")
            out.append(CurveData(f"{self.id}-{kind}" if kind else self.id, title, kind, names, titles,
                                 list(dict.fromkeys(t for name in names for t in panels[name])),
                                 {n: {t: sorted(pts, key=lambda q: q[0]) for t, pts in panels[n].items()} for n in names},
                                 refs, self))
        return out

    def draw(self, page: _Page, rec: dict, root: dict | None = None) -> None:
        for d in self.data(rec, root):
            _plotly_curves(page, d)

    def xlog_for(self, kind: str) -> bool:
        """Whether the x axis of grid kind ``kind`` is logarithmic."""
        return self.xlog is True or (isinstance(self.xlog, tuple) and kind in self.xlog)

    def _points(self, keys: tuple, leaf, xs):
        if self.xy:
            xv, yv = (leaf.get(k) if isinstance(leaf, dict) else None for k in self.xy)
            if isinstance(xv, list) and isinstance(yv, list):
                for x, y in zip(xv, yv):
                    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                        yield "", x, _P(float(y), None, None, None, f"{y:.4f}")
            return
        p = _point(leaf)
        k = _key(keys, "#")
        if p is None or k is None:
            return
        if isinstance(k, int) and isinstance(xs, list) and k < len(xs):
            item = xs[k]
            kind, x = (str(item.get("kind", "")), item.get("value")) if isinstance(item, dict) else ("", item)
        else:
            kind, x = "", k
        try:
            x = float(x)
        except (TypeError, ValueError):
            return
        yield kind, (int(x) if x.is_integer() else x), p


def _plotly_curves(page: _Page, d: CurveData) -> None:
    from plotly.subplots import make_subplots

    spec, names = d.spec, d.panels
    cols = min(3, len(names))
    nrows = -(-len(names) // cols)
    specs = [[{} if r * cols + c < len(names) else None for c in range(cols)] for r in range(nrows)]
    fig = make_subplots(rows=nrows, cols=cols, specs=specs, subplot_titles=d.titles, shared_yaxes=True,
                        horizontal_spacing=0.05, vertical_spacing=min(0.12, 0.5 / nrows))
    for i, name in enumerate(names):
        row, col = i // cols + 1, i % cols + 1
        for t in d.traces:
            pts = d.points[name].get(t, [])
            if not pts:
                continue
            c = d.traces.index(t)
            fig.add_scatter(x=[x for x, _ in pts], y=[p.y for _, p in pts], name=t or spec.ylabel,
                            legendgroup=t, showlegend=i == 0 or t not in {u for m in names[:i] for u in d.points[m]},
                            mode="markers" if spec.markers else "lines+markers",
                            line={"color": _color(c), "dash": "dash" if t.startswith(spec.dashed) else None},
                            error_y={"type": "data", "array": [p.hi - p.y if p.hi is not None else 0 for _, p in pts],
                                     "arrayminus": [p.y - p.lo if p.lo is not None else 0 for _, p in pts],
                                     "thickness": 1, "width": 2},
                            customdata=[p.hover for _, p in pts],
                            hovertemplate=f"{html.escape(t)} · {html.escape(name)}, x=%{{x}}: %{{customdata}}"
                                          "<extra></extra>", row=row, col=col)
        ref = d.refs.get(name)
        if ref is not None:
            fig.add_hline(y=ref.y, line_dash="dot", line_color="black", line_width=1, row=row, col=col,
                          annotation_text=f"{spec.ref_name} {ref.y:.2f}", annotation_font_size=9)
    fig.update_xaxes(title_text=f"{spec.xlabel} ({d.kind})" if d.kind else spec.xlabel,
                     type="log" if spec.xlog_for(d.kind) else None, autorange="reversed" if spec.xreverse else None)
    fig.update_yaxes(title_text=spec.ylabel, col=1, type="log" if spec.ylog else None)
    fig.update_layout(title=d.title, height=300 * nrows + 120, legend={"font": {"size": 10}})
    page.figure(fig, d.id, {"kind": "curves", "title": d.title, "panels": names, "traces": d.traces})


@dataclass(frozen=True)
class Reshaped:
    """A :class:`Bars` or :class:`Curves` drawn from ``reshape(result)`` instead of the aggregates."""

    figure: Bars | Curves
    reshape: Callable[[dict], dict]

    @property
    def id(self) -> str:
        return self.figure.id

    def data(self, rec: dict) -> list:
        """The figure's :class:`BarData` / :class:`CurveData` from the reshaped result."""
        return self.figure.data(rec, self.reshape(rec["result"]))

    def draw(self, page: _Page, rec: dict) -> None:
        self.figure.draw(page, rec, self.reshape(rec["result"]))


#: The flip-share axis title of a patch probe's figures.
FLIPPED = "share of pairs whose decision the patch flipped (Wilson 95%)"


def _figures(page: _Page, rec: dict) -> None:
    """Every figure of a record's page but the aggregate bars: what its data holds (token strips,
    example maps, head maps) and the figures its probe's presentation declares
    (:func:`kvnotes.records.presentation.presentation`)."""
    _single_strips(page, rec)
    _example_maps(page, rec)
    for fig in presentation(rec).figures:
        fig.draw(page, rec)
    _row_maps(page, rec)


def _summary_bars(page: _Page, rec: dict) -> None:
    """Means with their intervals of the record's summaries over all families (paths ending in
    ``/all``), the first 24: a figure for every probe, next to its dedicated ones."""
    import plotly.graph_objects as go

    rows = [(p, s) for p, s in summaries(rec["result"].get("aggregates", {}))
            if s.get("n") and s.get("mean") is not None and p.endswith("/all")][:24]
    if not rows:
        return
    err = [[(s["ci_mean"][1] - s["mean"]) if s.get("ci_mean") else 0 for _, s in rows],
           [(s["mean"] - s["ci_mean"][0]) if s.get("ci_mean") else 0 for _, s in rows]]
    fig = go.Figure(go.Bar(x=[p for p, _ in rows], y=[s["mean"] for _, s in rows],
                           error_y={"type": "data", "array": err[0], "arrayminus": err[1]},
                           customdata=[[s["n"], s.get("ci_method") or "none"] for _, s in rows],
                           hovertemplate="%{x}: %{y:.4f} (n=%{customdata[0]}, %{customdata[1]})<extra></extra>"))
    fig.update_layout(title="aggregates over all families (mean, 95% interval)", height=420, xaxis_tickangle=-30)
    page.figure(fig, "aggregates", {"kind": "aggregate_bars"})


# ------------------------------------------------------------------------------------- drill-down

