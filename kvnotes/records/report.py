"""An interactive, offline HTML report built only from record files.

    kvnotes report runs/ -o report/          (or: python -m kvnotes.records.report runs/ -o report/)

The site is static and opens from ``file://`` with no network: plotly.js is written once into the
site (``assets/plotly.min.js``, from the installed ``plotly`` package) and every page with figures
loads it by a relative ``<script src>``. ``index.html`` lists every complete record under the given
roots (model, probe, suite, distinguishing overrides, flip rule, date, commit, package versions, a
headline aggregate with its interval and method); each record gets a page with its table
(:func:`kvnotes.records.tables.record_table`, the same code as the table scripts), interactive
figures with hover values, a per-pair drill-down (rendered prompt with the field marked, candidates,
each clean run's top-1 and probability, the flip rule's verdict, exclusion reasons) and a link to the
raw JSON. The figures: what the record's data holds (token strips of single-position recovery and
of key deviation, layer x position maps, single-head maps), the per-family figures and the curves
over k (or a threshold, a layer, a seam) that ``kvnotes plot`` draws, read from the keys
its probe's presentation names (``PRESENTATION``, :mod:`kvnotes.records.presentation`), and the aggregates over all families.
``report.json`` lists the pages and the figures on each (what the browser test checks). A figure
whose keys a record lacks (older versions) is left out; a page without decoded tokens or without any
figure says so.

Every ``record.json`` under the roots is read before anything is written
(:func:`kvnotes.records.store.scan_records`). One that cannot be read as a complete record (not JSON,
not a kvnotes record, not complete, an invalid envelope, no ``result``) gets no page: it is named on
stderr, one line each (``kvnotes: skipped runs/a/record.json: not JSON (Expecting value at line 1
column 1)``), and in the index's "Records not read" list. When none can be read it is one
``kvnotes: error:`` line (naming the files not read) with exit status 2; so is a record that was
read but lacks a key its page reads (naming the file and the key). The site is written into a temporary directory beside the target and
moved into place only when complete, so a failure writes nothing.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvnotes import existing_ancestor
from kvnotes.records.envelope import reading
from kvnotes.records.store import RecordScan, Unreadable, record_overrides, scan_records
from kvnotes.records.tables import ci, record_table, summaries, verdict_summary
from kvnotes.records.figures import _figures, _summary_bars
from kvnotes.records.pages import PLOTLY_JS, _Page, _md, not_read_list, write_plotly_js
from kvnotes.records.presentation import presentation


def _page_name(rec: dict, i: int) -> str:
    return f"r{i:03d}-{rec['model']['name']}-{rec['probe']}-{rec['scenario']['name']}"


def headline(rec: dict) -> tuple[str, str]:
    """(aggregate path, ``mean [interval] method``) shown for a record in the index."""
    aggs = rec["result"].get("aggregates", {})
    preferred = presentation(rec).headline
    if callable(preferred) and (got := preferred(rec)) is not None:
        return got
    path = preferred if isinstance(preferred, str) else None
    found = dict(summaries(aggs))
    if path not in found or not found[path].get("n"):
        path = next((p for p, s in found.items() if s.get("n")), None)
    if path is None:
        return "-", "no aggregate with pairs"
    s = found[path]
    return path, f"{ci(s)} ({s.get('ci_method') or 'no interval'})"


# ----------------------------------------------------------------------------------------- figures

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
    _figures(page, rec)
    _summary_bars(page, rec)
    if not page.figures:
        page.add("<p class='note'>No figure: this record has no aggregate with pairs.</p>")
    page.add("<h2>Table</h2>" + _md(record_table(rec)))
    page.add(_drilldown(rec))
    return page


def build_report(roots: list[str | Path], out: str | Path, scan: RecordScan | None = None) -> dict:
    """Write the site for every complete record under ``roots`` into ``out``.

    Every ``record.json`` is read first (:func:`kvnotes.records.store.scan_records`, or the given
    ``scan`` of ``roots``): the complete, valid ones get pages, the others are listed on the index
    as not read (the manifest's ``skipped``; :func:`main` prints them). Then the whole site is
    written into a temporary directory beside ``out`` and moved into place only when complete: a
    failure leaves ``out`` as it was. A new or empty ``out`` is replaced by the site in one rename; an
    ``out`` that already holds files gets the site's files moved into it (same names replaced, other
    files kept).

    Returns:
        the manifest written to ``out/report.json``: ``{"pages": [{page, record, probe, figures}],
        "skipped": [{record, reason}]}``.

    Raises:
        KvnotesError: a root that does not exist, no record under the roots that can be read (naming
            the files not read), a record that lacks what its page needs (naming the file and the
            key), an ``out`` that cannot be written as a directory.
    """
    from kvnotes.errors import KvnotesError

    scan = (scan or scan_records(roots)).require()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise KvnotesError(f"cannot write the report to {out}: it exists and is not a directory")
    base = existing_ancestor(out.parent)
    if not base.is_dir():
        raise KvnotesError(f"cannot write the report to {out}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK | os.X_OK)):
        raise KvnotesError(f"cannot write the report to {out}: permission denied")
    tmp = None                # the temporary site below is the real test (root passes os.access under /proc)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name or 'report'}.tmp-", dir=base))
        umask = os.umask(0o022)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)          # mkdtemp's 0700 would stay on a site renamed into place
        manifest = _write_site(scan.records, tmp, scan.skipped)
        _move_into_place(tmp, out)
    except OSError as exc:
        raise KvnotesError(f"cannot write the report to {out}: {exc}") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write_site(records: list[tuple[Path, dict]], out: Path, skipped: list[Unreadable] = ()) -> dict:
    """Write the index (with the ``skipped`` files in a "Records not read" list), one page and one
    raw JSON per record into the (new, empty) directory ``out``; returns the manifest (see
    :func:`build_report`).

    Raises:
        KvnotesError: a record lacks a key its page reads (:func:`kvnotes.records.envelope.reading`).
    """
    (out / "records").mkdir()
    index = _Page("kvnotes report")
    not_read = f"; {len(skipped)} record files not read (listed below)" if skipped else ""
    rows = ["<h1>kvnotes report</h1>", f"<p>{len(records)} records{not_read}.</p>",
            "<table><tr><th>model</th><th>probe</th><th>suite</th><th>overrides</th><th>flip rule</th>"
            "<th>created</th><th>commit</th><th>torch / transformers</th><th>headline</th><th>verdicts</th><th></th></tr>"]
    manifest: dict = {"pages": [], "skipped": [{"record": str(u.path), "reason": u.reason} for u in skipped]}
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
                        f"<td>{html.escape(hpath)}: {html.escape(hval)}</td>"
                        f"<td>{html.escape(verdict_summary(rec) or '-')}</td><td><a href='{name}.html'>page</a> · "
                        f"<a href='records/{name}.json'>JSON</a></td></tr>")
        shutil.copyfile(path, out / "records" / f"{name}.json")
        page.write(out / f"{name}.html", out)
        manifest["pages"].append({"page": f"{name}.html", "record": str(path), "probe": rec["probe"],
                                  "figures": page.figures})
    rows.append("</table>")
    if skipped:
        rows.append(not_read_list(skipped))
    index.add("\n".join(rows))
    index.write(out / "index.html", out)
    if any(p["figures"] for p in manifest["pages"]):
        write_plotly_js(out)                            # one copy, loaded by every page with figures
        manifest["plotly_js"] = PLOTLY_JS
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
        scan = scan_records(args.roots).require()
        manifest = build_report(args.roots, args.out, scan)
    except KvnotesError as exc:
        print(f"kvnotes: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvnotes: error: interrupted; no report written", file=sys.stderr)
        sys.exit(130)
    scan.warn()                                     # every record.json not read, one line each
    n_fig = sum(len(p["figures"]) for p in manifest["pages"])
    not_read = f", {len(scan.skipped)} record files not read" if scan.skipped else ""
    print(f"kvnotes: wrote {Path(args.out) / 'index.html'} ({len(manifest['pages'])} record pages, {n_fig} figures"
          f"{not_read})")


if __name__ == "__main__":
    main()
