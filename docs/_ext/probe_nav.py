"""MkDocs hook: the nav's "Specifications" section lists the specification page of every probe and
circuit, found from the probe modules themselves (``probes/<name>.py``, ``probes/<name>/__init__.py``,
the same under ``circuits/``) and their pages (``docs/probes/<name>.md``), so no central list names a
probe (issue #51): a new probe is its module, its YAML and its page."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The nav entry whose children this hook writes.
SECTION = ("Probes", "Specifications")


def probe_names() -> list[str]:
    """Every probe (``probes/``) then circuit (``circuits/``), each sorted: a module or a package."""
    out = []
    for folder in ("probes", "circuits"):
        mods = [p.stem for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"]
        pkgs = [p.parent.name for p in (ROOT / folder).glob("*/__init__.py")]
        out += sorted(mods + pkgs)
    return out


def probe_pages() -> list[dict[str, str]]:
    """The nav entries ``{name: "probes/<name>.md"}`` of the probes whose page exists."""
    return [{n: f"probes/{n}.md"} for n in probe_names() if (ROOT / "docs" / "probes" / f"{n}.md").is_file()]


def on_config(config, **kwargs):
    """Fill :data:`SECTION` of the nav with :func:`probe_pages`."""
    for top in config["nav"] or []:
        if isinstance(top, dict) and SECTION[0] in top:
            for entry in top[SECTION[0]]:
                if isinstance(entry, dict) and SECTION[1] in entry:
                    entry[SECTION[1]] = probe_pages()
    return config
