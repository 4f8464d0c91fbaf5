"""An interactive, offline HTML report built only from record files.

    kvnotes report runs/ -o report/          (or: python -m kvnotes.records.report runs/ -o report/)

The site is static and self-contained: every page inlines plotly.js (no network, opens from
``file://``). ``index.html`` lists every complete record under the given roots (model, probe, suite,
distinguishing overrides, flip rule, date, commit, package versions, a headline aggregate with its
interval and method); each record gets a page with its table (:func:`kvnotes.records.tables.record_table`,
the same code as the table scripts), interactive figures with hover values (token strips of
single-position recovery and of key deviation, layer x position maps, head curves, the edit
frontier, compose seam curves, agent per-turn curves), a per-pair drill-down (rendered prompt with
the field marked, candidates, each clean run's top-1 and probability, the flip rule's verdict,
exclusion reasons) and a link to the raw JSON. ``report.json`` lists the pages and the figures on
each (what the browser test checks). A record that lacks what a figure needs (older versions) gets a
note on its page instead.

Every record is checked before anything is written (:func:`kvnotes.records.envelope.read_record`);
an unreadable record, or one that lacks a key its page reads, is one ``kvnotes: error:`` line naming
the file and the key, with exit status 2. The site is written into a temporary directory beside
the target and moved into place only when complete, so a failure writes nothing.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvnotes.records.envelope import read_record, reading
from kvnotes.records.store import find_records, record_overrides
from kvnotes.records.tables import ci, record_table, summaries

#: Pairs drawn as token strips per record page.
MAX_STRIPS = 4
#: Preferred headline aggregate per probe (path under ``result.aggregates``); else the first with pairs.
HEADLINES = {"field_refresh": "recovery/field/all", "blast_radius": "all/k_rel_p95/all", "suffix_recovery": "references/field/all",
             "injection": "flipping/all/old_notes_into_new/r_notes", "heads": "curves/read/all_heads/all"}

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;
font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}th{background:#eee}
.note{background:#fff3cd;padding:6px 10px;border:1px solid #e0c36a}.prompt{font-family:monospace;
white-space:pre-wrap;font-size:12px}mark{background:#8fe3ff}code{background:#f3f3f3}"""


class _Page:
    """One HTML page: sections, plotly figures (plotly.js inlined once per page)."""

    def __init__(self, title: str) -> None:
        self.title, self.parts, self.figures = title, [], []

    def add(self, html_text: str) -> None:
        self.parts.append(html_text)

    def figure(self, fig, fig_id: str, meta: dict | None = None) -> None:
        first = not self.figures
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=True if first else False, div_id=fig_id,
                                      config={"displaylogo": False}))
        self.figures.append({"id": fig_id, **(meta or {})})

    def write(self, path: Path) -> None:
        body = "\n".join(self.parts)
        path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                        f"<style>{_CSS}</style></head><body>{body}</body></html>")


def _md(text: str) -> str:
    import markdown

    return markdown.markdown(text, extensions=["tables"])


def _page_name(rec: dict, i: int) -> str:
    return f"r{i:03d}-{rec['model']['name']}-{rec['probe']}-{rec['scenario']['name']}"


def headline(rec: dict) -> tuple[str, str]:
    """(aggregate path, ``mean [interval] method``) shown for a record in the index."""
    aggs = rec["result"].get("aggregates", {})
    if rec["probe"] == "screen" and "n_flip" in aggs:
        return "flipping pairs", f"{aggs['n_flip']} of {aggs['n_pairs']} ({rec['config'].get('flip_rule')} rule)"
    found = dict(summaries(aggs))
    path = HEADLINES.get(rec["probe"])
    if path not in found or not found[path].get("n"):
        path = next((p for p, s in found.items() if s.get("n")), None)
    if path is None:
        return "-", "no aggregate with pairs"
    s = found[path]
    return path, f"{ci(s)} ({s.get('ci_method') or 'no interval'})"


# ----------------------------------------------------------------------------------------- figures

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


def _strips(page: _Page, rec: dict) -> None:
    prompts = rec.get("prompts") or {}
    res = rec["result"]
    if rec["probe"] == "suffix_recovery":
        rows = [r for r in res.get("rows", []) if r.get("single") and r["pair"] in prompts]
        # the pairs whose notes carry the most (largest single-position recovery) first
        rows = sorted(rows, key=lambda r: -max((v for v in r["single"] if v is not None), default=0.0))[:MAX_STRIPS]
        for j, r in enumerate(rows):
            b = r["downstream"][0]
            vals = {b + k: v for k, v in enumerate(r["single"]) if v is not None}
            p = prompts[r["pair"]]
            page.figure(token_strip(p["tokens"], vals, f"{r['pair']}: single-position recovery", "recovery",
                                    p["field"], p["decision"]), f"strip-{j}",
                        {"kind": "token_strip", "pair": r["pair"], "n_tokens": len(p["tokens"]),
                         "position": b, "value": vals.get(b)})
    if rec["probe"] == "blast_radius":
        for j, (fam, ex) in enumerate(list((res.get("examples") or {}).items())[:MAX_STRIPS]):
            maps = ex.get("maps", {}).get("k_rel")
            if not maps or not ex.get("tokens"):
                continue
            import plotly.graph_objects as go

            n = len(maps[0])
            mean = {i: sum(row[i] for row in maps) / len(maps) for i in range(n)}
            f = ex.get("field")
            field = tuple(f) if isinstance(f, (list, tuple)) else ((f, f + 1) if isinstance(f, int) else (0, 0))
            page.figure(token_strip(ex["tokens"][:n], mean, f"{fam}: {ex.get('pair', '')} key deviation, layer mean",
                                    "rel. L2", field, ex.get("decision", n - 1)), f"strip-{j}",
                        {"kind": "token_strip", "pair": ex.get("pair"), "n_tokens": n})
            fig = go.Figure(go.Heatmap(z=maps, colorscale="Magma", hovertemplate="layer %{y}, position %{x}: "
                                       "%{z:.4f}<extra></extra>"))
            fig.update_layout(title=f"{fam}: relative L2 change of the keys (layer x position)", height=380,
                              xaxis_title="position", yaxis_title="layer")
            page.figure(fig, f"map-{j}", {"kind": "layer_position_map"})


def _curves(page: _Page, rec: dict) -> None:
    import plotly.graph_objects as go

    aggs = rec["result"].get("aggregates", {})
    probe = rec["probe"]
    if probe == "heads":
        for mode, curves in (aggs.get("curves") or {}).items():
            fig = go.Figure()
            for name in ("topk", "random"):
                by_k = curves.get(name) or {}
                pts = [(int(k), v.get("all", {}).get("mean")) for k, v in by_k.items() if isinstance(v, dict)]
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=name, mode="lines+markers",
                                    hovertemplate="k=%{x}: %{y:.4f}<extra></extra>")
            if fig.data:
                fig.update_layout(title=f"{mode} heads: cumulative top-k recovery on held-out pairs (k-matched random)",
                                  xaxis_title="k", xaxis_type="log", height=360)
                page.figure(fig, f"heads-{mode}", {"kind": "head_curve"})
    if probe == "heads":
        mapped = [r for r in rec["result"].get("rows", []) if r.get("maps")][:2]
        for j, r in enumerate(mapped):
            for mode, grid in r["maps"].items():
                fig = go.Figure(go.Heatmap(z=grid, colorscale="RdBu", zmid=0,
                                           hovertemplate="layer %{y}, head %{x}: recovery %{z:.4f}<extra></extra>"))
                fig.update_layout(title=f"{r['pair']} ({r['split']}): single-head {mode} map (recovery)",
                                  xaxis_title="head", yaxis_title="layer", height=420)
                page.figure(fig, f"headmap-{mode}-{j}", {"kind": "head_map", "pair": r["pair"]})
    if probe == "screen" and isinstance(aggs.get("by_family"), dict):
        fams = list(aggs["by_family"])
        fig = go.Figure()
        for key, name in (("n_pairs", "aligned pairs"), ("n_flip_relative", "flipping, relative rule"),
                          ("n_flip_owned", "flipping, owned rule")):
            fig.add_bar(x=fams, y=[aggs["by_family"][f].get(key) for f in fams], name=name,
                        hovertemplate="%{x}: %{y} " + name + "<extra></extra>")
        fig.update_layout(title="screen: pairs per family", barmode="group", height=360)
        page.figure(fig, "screen-families", {"kind": "screen_bars"})
    if probe == "edit":
        pts = [(name, m["frac"]["all"].get("mean"), m["recovery"]["all"].get("mean"))
               for name, m in {**aggs.get("methods", {}), **aggs.get("sweep", {})}.items()
               if isinstance(m, dict) and "frac" in m and "recovery" in m]
        pts = [p for p in pts if p[1] is not None and p[2] is not None]
        if pts:
            fig = go.Figure(go.Scatter(x=[p[1] for p in pts], y=[p[2] for p in pts], text=[p[0] for p in pts],
                                       mode="markers", hovertemplate="%{text}: tokens %{x:.3f}, recovery %{y:.3f}"
                                       "<extra></extra>"))
            fig.update_layout(title="edit frontier: recovery against the share of tokens recomputed",
                              xaxis_title="tokens recomputed / total", yaxis_title="mean recovery", height=380)
            page.figure(fig, "edit-frontier", {"kind": "edit_frontier"})
    if probe == "compose":
        variants = aggs.get("variants", {})
        fig = go.Figure()
        for rot in ("rotate", "no_rotate"):
            for sink in sorted({v.split("/")[1] for v in variants}):
                pts = sorted((int(v.rsplit("=", 1)[1]), d["kl"]["all"].get("mean")) for v, d in variants.items()
                             if v.startswith(f"{rot}/{sink}/"))
                if pts:
                    fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=f"{rot} {sink}",
                                    mode="lines+markers")
        if fig.data:
            fig.update_layout(title="compose: KL(full || composed) by seam", xaxis_title="seam tokens", height=360)
            page.figure(fig, "compose-seams", {"kind": "seam_curve"})
    if probe == "agent":
        rows = rec["result"].get("rows", [])
        turns = sorted({r["turn"] for r in rows})
        if turns:
            fig = go.Figure()
            for key, name in (("agree_oracle", "agent = oracle"), ("agree_transcript", "agent = transcript")):
                ys = [sum(bool(r[key]) for r in rows if r["turn"] == t) / max(1, sum(r["turn"] == t for r in rows))
                      for t in turns]
                fig.add_scatter(x=turns, y=ys, name=name, mode="lines+markers")
            fig.update_layout(title="agent: agreement per turn", xaxis_title="turn", yaxis_range=[0, 1.05], height=360)
            page.figure(fig, "agent-turns", {"kind": "turn_curve"})


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

def _prompt_html(p: dict) -> str:
    a, b = p["field"]
    toks = [html.escape(t) for t in p["tokens"]]
    new = html.escape("".join(p["new_field"]))
    return ("".join(toks[:a]) + f"<mark title='new value: {new}'>" + "".join(toks[a:b]) + "</mark>"
            + "".join(toks[b:]))


def _drilldown(rec: dict) -> str:
    prompts = rec.get("prompts") or {}
    vocab = rec.get("vocab") or {}
    rows = rec["result"].get("rows", [])
    out = ["<h2>Pairs</h2>", "<table><tr><th>pair</th><th>family</th><th>candidates (old / new)</th>"
           "<th>old run top-1 (p)</th><th>new run top-1 (p)</th><th>flips</th><th>reason</th><th>prompt</th></tr>"]
    for r in rows:
        p = prompts.get(r.get("pair"))
        cands = f"{html.escape(repr(p['cand_old']))} / {html.escape(repr(p['cand_new']))}" if p else "-"

        def top(run: str, r=r) -> str:
            tid = r.get(f"top1_id_{run}")
            if tid is None:
                return "-"
            tok = vocab.get(str(tid), f"id {tid}")
            return f"{html.escape(repr(tok))} ({r.get(f'p_top1_{run}', float('nan')):.2f})"
        verdict = f"{r.get('flips')} ({r.get('flip_rule', rec['config'].get('flip_rule'))})"
        prompt = f"<details><summary>show</summary><div class='prompt'>{_prompt_html(p)}</div></details>" if p else "-"
        out.append(f"<tr><td>{html.escape(str(r.get('pair')))}</td><td>{html.escape(str(r.get('family')))}</td>"
                   f"<td>{cands}</td><td>{top('old')}</td><td>{top('new')}</td><td>{verdict}</td>"
                   f"<td>{html.escape(str(r.get('reason') or '-'))}</td><td>{prompt}</td></tr>")
    out.append("</table>")
    excluded = rec["result"].get("excluded") or []
    if excluded:
        out.append(f"<h3>Excluded pairs ({len(excluded)})</h3><table><tr><th>pair</th><th>reason</th></tr>")
        out += [f"<tr><td>{html.escape(str(e.get('pair')))}</td><td>{html.escape(str(e.get('reason')))}</td></tr>"
                for e in excluded]
        out.append("</table>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ build

def record_page(rec: dict, name: str) -> _Page:
    """The page of one record (see the module docstring)."""
    page = _Page(f"{rec['model']['name']} · {rec['probe']} · {rec['scenario']['name']}")
    git = rec.get("git") or {}
    page.add(f"<p><a href='index.html'>index</a> · <a href='records/{name}.json'>raw JSON</a></p>"
             f"<h1>{html.escape(page.title)}</h1><p>overrides <code>{html.escape(record_overrides(rec) or '-')}</code>"
             f" · flip rule <code>{html.escape(str(rec['config'].get('flip_rule')))}</code> · readout "
             f"<code>{html.escape(str(rec['config'].get('readout')))}</code> · created {html.escape(str(rec.get('created')))}"
             f" · commit <code>{html.escape(str(git.get('commit'))[:10])}</code>{' (dirty)' if git.get('dirty') else ''}"
             f" · model source {html.escape(str(rec['model'].get('source')))}</p>")
    if not rec.get("prompts"):
        page.add("<p class='note'>This record carries no decoded tokens (it was written before records kept "
                 "them): token strips and prompts are not shown.</p>")
    page.add("<h2>Figures</h2>")
    _strips(page, rec)
    _curves(page, rec)
    _summary_bars(page, rec)
    if not page.figures:
        page.add("<p class='note'>No figure: this record has no aggregate with pairs.</p>")
    page.add("<h2>Table</h2>" + _md(record_table(rec)))
    page.add(_drilldown(rec))
    return page


def build_report(roots: list[str | Path], out: str | Path) -> dict:
    """Write the site for every complete record under ``roots`` into ``out``.

    Every record is read and checked first (:func:`kvnotes.records.envelope.read_record`: its
    envelope and a ``result``), then the whole site is written into a temporary directory beside
    ``out`` and moved into place only when complete: a failure leaves ``out`` as it was. A new or
    empty ``out`` is replaced by the site in one rename; an ``out`` that already holds files gets the
    site's files moved into it (same names replaced, other files kept).

    Returns:
        the manifest written to ``out/report.json``: ``{"pages": [{page, record, probe, figures}]}``.

    Raises:
        KvnotesError: a root that does not exist, no complete record under the roots, a record that
            is unreadable or lacks what its page needs (naming the file and the key), an ``out``
            that is not a writable directory.
    """
    from kvnotes.errors import KvnotesError

    for root in roots:
        if not Path(root).exists():
            raise KvnotesError(f"{root}: no such file or directory")
    paths = [p for root in roots for p in find_records(root)]
    if not paths:
        raise KvnotesError(f"no complete record under {', '.join(map(str, roots))}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KvnotesError(f"cannot write the report to {out}: it exists and is not a directory")
    base = _existing_ancestor(out.parent)
    if not base.is_dir():
        raise KvnotesError(f"cannot write the report to {out}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK | os.X_OK)):
        raise KvnotesError(f"cannot write the report to {out}: permission denied")
    records = [(path, read_record(path)) for path in paths]         # every record checked before any page
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name or 'report'}.tmp-", dir=base))
        manifest = _write_site(records, tmp)
        _move_into_place(tmp, out)
    except OSError as exc:
        raise KvnotesError(f"cannot write the report to {out}: {exc}") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _existing_ancestor(path: Path) -> Path:
    """The nearest of ``path`` and its parents that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_site(records: list[tuple[Path, dict]], out: Path) -> dict:
    """Write the index, one page and one raw JSON per record into the (new, empty) directory ``out``;
    returns the manifest (see :func:`build_report`).

    Raises:
        KvnotesError: a record lacks a key its page reads (:func:`kvnotes.records.envelope.reading`).
    """
    (out / "records").mkdir()
    index = _Page("kvnotes report")
    rows = ["<h1>kvnotes report</h1>", f"<p>{len(records)} records.</p>",
            "<table><tr><th>model</th><th>probe</th><th>suite</th><th>overrides</th><th>flip rule</th>"
            "<th>created</th><th>commit</th><th>torch / transformers</th><th>headline</th><th></th></tr>"]
    manifest: dict = {"pages": []}
    for i, (path, rec) in enumerate(records):
        with reading(path, "report page"):
            name = _page_name(rec, i)
            page = record_page(rec, name)
            hpath, hval = headline(rec)
            pk, git = rec.get("packages") or {}, rec.get("git") or {}
            rows.append(f"<tr><td>{html.escape(rec['model']['name'])}</td><td>{html.escape(rec['probe'])}</td>"
                        f"<td>{html.escape(rec['scenario']['name'])}</td>"
                        f"<td>{html.escape(record_overrides(rec) or '-')}</td>"
                        f"<td>{html.escape(str(rec['config'].get('flip_rule')))}</td>"
                        f"<td>{html.escape(str(rec.get('created')))}</td>"
                        f"<td>{html.escape(str(git.get('commit'))[:10])}</td>"
                        f"<td>{pk.get('torch')} / {pk.get('transformers')}</td>"
                        f"<td>{html.escape(hpath)}: {html.escape(hval)}</td><td><a href='{name}.html'>page</a> · "
                        f"<a href='records/{name}.json'>JSON</a></td></tr>")
        shutil.copyfile(path, out / "records" / f"{name}.json")
        page.write(out / f"{name}.html")
        manifest["pages"].append({"page": f"{name}.html", "record": str(path), "probe": rec["probe"],
                                  "figures": page.figures})
    rows.append("</table>")
    index.add("\n".join(rows))
    index.write(out / "index.html")
    (out / "report.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _move_into_place(site: Path, out: Path) -> None:
    """Move the finished ``site`` directory to ``out``: one rename when ``out`` is new or an empty
    directory, else each entry moved into ``out`` (directories merged), ``index.html`` last.

    Raises:
        OSError: a move failed (e.g. ``out`` holds a directory where the site has a file).
    """
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(site, out)
        return
    clash = _clash(site, out)
    if clash is not None:                      # checked before anything moves: no half-merged site
        raise IsADirectoryError(f"{clash} is in the way of the report's own {clash.name}")
    entries = sorted(site.iterdir(), key=lambda e: e.name == "index.html")
    for entry in entries:
        dst = out / entry.name
        if entry.is_dir() and dst.is_dir():
            _move_into_place(entry, dst)
        else:
            os.replace(entry, dst)


def _clash(site: Path, out: Path) -> Path | None:
    """The first path under ``out`` that is a directory where ``site`` has a file, or the reverse."""
    for entry in site.iterdir():
        dst = out / entry.name
        if dst.exists() and entry.is_dir() != dst.is_dir():
            return dst
        if entry.is_dir() and dst.is_dir():
            found = _clash(entry, dst)
            if found is not None:
                return found
    return None


def main(argv: list[str] | None = None) -> None:
    """``kvnotes report ROOTS -o SITE`` (see the module docstring).

    Raises:
        SystemExit: 2 with one ``kvnotes: error:`` line on bad input (:func:`build_report`'s
            errors, a flag error), 130 on Ctrl-C; nothing is written then.
    """
    import sys

    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(description="Build the offline HTML report of every record under the given roots.")
    ap.add_argument("roots", nargs="+", help="directories searched for complete record.json files")
    ap.add_argument("-o", "--out", default="report", help="output directory (default: report)")
    args = ap.parse_args(argv)
    try:
        manifest = build_report(args.roots, args.out)
    except KvnotesError as exc:
        print(f"kvnotes: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvnotes: error: interrupted; no report written", file=sys.stderr)
        sys.exit(130)
    n_fig = sum(len(p["figures"]) for p in manifest["pages"])
    print(f"kvnotes: wrote {Path(args.out) / 'index.html'} ({len(manifest['pages'])} record pages, {n_fig} figures)")


if __name__ == "__main__":
    main()
