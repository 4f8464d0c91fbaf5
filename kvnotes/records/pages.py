"""A report page: sections and plotly figures, with the site's one shared plotly.js
(:mod:`kvnotes.records.report` builds the site; :mod:`kvnotes.records.figures` draws the figures)."""

from __future__ import annotations

import html
import os
from pathlib import Path

#: The site's one copy of plotly.js, relative to the site's root; every page with figures loads it.
PLOTLY_JS = "assets/plotly.min.js"

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;
font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}th{background:#eee}
.note{background:#fff3cd;padding:6px 10px;border:1px solid #e0c36a}.prompt{font-family:monospace;
white-space:pre-wrap;font-size:12px}mark{background:#8fe3ff}code{background:#f3f3f3}"""


class _Page:
    """One HTML page: sections and plotly figures. plotly.js is not inlined: a page with figures loads
    the site's one copy (:data:`PLOTLY_JS`) by a ``<script src>`` relative to the page."""

    def __init__(self, title: str) -> None:
        self.title, self.parts, self.figures = title, [], []

    def add(self, html_text: str) -> None:
        self.parts.append(html_text)

    def figure(self, fig, fig_id: str, meta: dict | None = None) -> None:
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=fig_id,
                                      config={"displaylogo": False}))
        self.figures.append({"id": fig_id, **(meta or {})})

    def write(self, path: Path, site: Path) -> None:
        """Write the page to ``path`` inside the site rooted at ``site`` (the script's path is
        relative to the page, so the site opens from ``file://`` wherever it lies)."""
        body = "\n".join(self.parts)
        head = ""
        if self.figures:
            src = Path(os.path.relpath(site / PLOTLY_JS, path.parent)).as_posix()
            head = ("<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
                    f"<script src='{html.escape(src)}' charset='utf-8'></script>")
        path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                        f"<style>{_CSS}</style>{head}</head><body>{body}</body></html>", encoding="utf-8")


def write_plotly_js(site: Path) -> Path:
    """Write the installed ``plotly`` package's plotly.js to ``site/``:data:`PLOTLY_JS` (once per site)."""
    from plotly.offline import get_plotlyjs

    path = site / PLOTLY_JS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(get_plotlyjs(), encoding="utf-8")
    return path


def _md(text: str) -> str:
    import markdown

    return markdown.markdown(text, extensions=["tables"])




def not_read_list(skipped) -> str:
    """The index's "Records not read" section: each ``record.json`` the report skipped
    (:class:`kvnotes.records.store.Unreadable`), with why."""
    items = "".join(f"<li><code>{html.escape(str(u.path))}</code>: {html.escape(u.reason)}</li>" for u in skipped)
    return (f"<h2 id='not-read'>Records not read ({len(skipped)})</h2><p class='note'>These <code>record.json</code> "
            f"files are not in the report: each could not be read as a complete record.</p><ul>{items}</ul>")
