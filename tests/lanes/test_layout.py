"""The package layout as a contract: each package imports only from the layers below it, and the
editing/composition library (:mod:`kvnotes.ops`) loads without scenarios, probes or the harness."""

from __future__ import annotations

import ast
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import default_probe

ROOT = Path(__file__).resolve().parents[2]

#: Each package (longest prefix wins) and the project packages it may import. Third-party imports
#: are free. ``kvnotes`` alone is the package's face (``CONF_DIR``, ``KvnotesError``).
ALLOWED: dict[str, set[str]] = {
    "kvnotes.errors": set(),
    "kvnotes": {"kvnotes.errors"},
    "kvnotes.models": {"kvnotes", "kvnotes.errors", "kvnotes.models"},
    "kvnotes.kv": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv"},
    "kvnotes.ops": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops"},
    "kvnotes.context": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops"},
    "kvnotes.records": {"kvnotes", "kvnotes.errors", "kvnotes.records"},
    "kvnotes.scenarios": {"kvnotes.scenarios"},
    "kvnotes.plots": {"kvnotes", "kvnotes.errors", "kvnotes.records", "kvnotes.plots"},
    "kvnotes.harness": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops", "kvnotes.context",
                        "kvnotes.records", "kvnotes.plots", "kvnotes.harness", "kvnotes.scenarios"},
    "kvnotes.serving": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops", "kvnotes.context",
                        "kvnotes.records", "kvnotes.plots", "kvnotes.harness", "kvnotes.scenarios", "kvnotes.serving"},
    "kvnotes.circuits": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops", "kvnotes.context",
                         "kvnotes.records", "kvnotes.plots", "kvnotes.harness", "kvnotes.scenarios", "kvnotes.circuits"},
    "kvnotes.probes": {"kvnotes", "kvnotes.errors", "kvnotes.models", "kvnotes.kv", "kvnotes.ops", "kvnotes.context",
                       "kvnotes.records", "kvnotes.plots", "kvnotes.harness", "kvnotes.scenarios", "kvnotes.circuits",
                       "kvnotes.probes"},
}
#: The repository's folders that install inside the package (linked: kvnotes/probes -> ../probes).
LINKED = ("probes", "circuits", "scenarios")
#: Top-level names code may import from the project: kvnotes only (the linked folders' own
#: top-level names, and the old ``scripts`` package, would load a second copy of each module).
PROJECT = ("kvnotes", *LINKED, "scripts")
#: Packages nothing in the library may import (the command line, its ``python -m kvnotes`` entry
#: point and the benchmarks sit on top).
TOP = {"kvnotes.cli", "kvnotes.bench", "kvnotes.__main__"}


def _package(module: str) -> str | None:
    """The entry of :data:`ALLOWED` a dotted module name belongs to (longest prefix)."""
    best = None
    for name in ALLOWED:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def _imports(path: Path, module: str) -> set[str]:
    """Every project module ``path`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                     # relative: resolve against the package
                base = module.split(".")[: -node.level] if not path.name == "__init__.py" else \
                    module.split(".")[: len(module.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] in PROJECT}


def _modules():
    """``(path, dotted name)`` of every module of the package, the linked folders included."""
    for folder, _, files in sorted(os.walk(ROOT / "kvnotes", followlinks=True)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / name
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            yield path, ".".join(parts)


def _resolves(name: str) -> bool:
    """Whether a dotted name is a module or package of the checkout (``from a import b`` may name an
    attribute rather than a module)."""
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_import_direction():
    bad = []
    for path, module in _modules():
        if any(module == t or module.startswith(t + ".") for t in TOP):
            continue
        own = _package(module)
        assert own is not None, f"{module} belongs to no package of the layout: add it to ALLOWED"
        for dep in _imports(path, module):
            if not _resolves(dep):
                continue
            if any(dep == t or dep.startswith(t + ".") for t in TOP):
                bad.append(f"{module} -> {dep}")
                continue
            target = _package(dep)
            if target is not None and target not in ALLOWED[own]:
                bad.append(f"{module} -> {dep} ({own} may import {sorted(ALLOWED[own])})")
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_layout_check_can_fail():
    """The checker sees a violation: the harness importing a probe is one."""
    src = ROOT / "kvnotes" / "harness" / "jobs.py"
    deps = _imports(src, "kvnotes.harness.jobs")
    assert "kvnotes.harness.pairs" in deps
    assert _package("kvnotes.harness.pairs") == "kvnotes.harness"
    probe = next(p.stem for p in sorted((ROOT / "probes").glob("*.py")) if p.stem != "__init__")
    assert "kvnotes.probes" not in ALLOWED["kvnotes.harness"] and _package(f"kvnotes.probes.{probe}") == "kvnotes.probes"


def test_one_import_namespace():
    """Every module imports the project as ``kvnotes.*``: ``import probes`` (possible from the
    repository root only) would load a second copy of a probe module beside ``kvnotes.probes``'s, and
    a wheel has no such top-level package. The linked folders are the package's own."""
    for top in LINKED:
        assert (ROOT / "kvnotes" / top).resolve() == (ROOT / top).resolve()
    assert (ROOT / "kvnotes" / "conf").resolve() == (ROOT / "conf").resolve()
    files = [(p, m) for p, m in _modules()] + [(p, p.stem) for p in sorted((ROOT / "tests").rglob("*.py"))]
    bad = [f"{m} imports {dep}" for p, m in files for dep in _imports(p, m) if dep.split(".")[0] != "kvnotes"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["kvnotes.ops", "kvnotes.context", "kvnotes.kv", "kvnotes.models.loading", "kvnotes.records.store"])
def test_library_imports_alone(module):
    """Importing the library loads neither scenarios, probes, circuits nor the harness."""
    code = (f"import sys, {module}; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"('scenarios', 'probes', 'circuits', 'scripts') or m.split('.')[:2] in "
            f"(['kvnotes', 'scenarios'], ['kvnotes', 'probes'], ['kvnotes', 'circuits']) "
            f"or m.startswith('kvnotes.harness'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} loaded: {out.stdout.strip()}"


def test_the_library_names_no_checkout():
    """The library finds its configs and suites inside the package (``kvnotes.CONF_DIR``,
    ``kvnotes.scenarios.schema.SUITES_DIR``), never through the repository around it: it runs from a wheel."""
    import kvnotes
    from kvnotes.scenarios.schema import SUITES_DIR

    assert not hasattr(kvnotes, "CHECKOUT")
    assert kvnotes.CONF_DIR == Path(kvnotes.__file__).parent / "conf" and (kvnotes.CONF_DIR / "config.yaml").is_file()
    assert SUITES_DIR.parent.parent == Path(kvnotes.__file__).parent and any(SUITES_DIR.rglob("*.yaml"))
    offenders = [str(p.relative_to(ROOT)) for p, _ in _modules()
                 if "CHECKOUT" in p.read_text() or "parent.parent" in p.read_text()]
    assert not offenders, offenders


#: Most lines of one module of the library, the probes or the circuits (issue #33: small modules, one job each).
MAX_MODULE_LINES = 600


def test_no_module_is_over_the_line_limit():
    """Every module of ``kvnotes/`` (its linked ``probes/`` and ``circuits/`` included) stays within
    :data:`MAX_MODULE_LINES`: a module that grows past it is split by job."""
    sizes = {name: len(path.read_text().splitlines()) for path, name in _modules()}
    seen = {f"kvnotes.{m.parent.name}.{m.stem}" for f in ("probes", "circuits") for m in (ROOT / f).glob("*.py")
            if m.stem != "__init__"}
    assert seen | {"kvnotes.ops.edit"} <= set(sizes)          # the linked probes and circuits are counted too
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_every_probe_module_links_its_specification_page():
    """Each probe and circuit module's docstring is a summary that names its specification page,
    ``docs/probes/<name>.md``, which exists, is in the site's navigation (found from the probe
    modules by the docs' hook, ``docs/_ext/probe_nav.py``: no list in ``mkdocs.yml`` names a probe)
    and names the module back (the specification lives in the docs, the module keeps what is the
    probe's own)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("probe_nav", ROOT / "docs" / "_ext" / "probe_nav.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    nav = {page for entry in hook.probe_pages() for page in entry.values()}
    assert "docs/_ext/probe_nav.py" in (ROOT / "mkdocs.yml").read_text()
    # a probe is a module (probes/<name>.py) or a package (probes/<name>/__init__.py: its name is the folder's)
    modules = sorted((p, p.stem, f"{p.parent.name}/{p.name}") for folder in ("probes", "circuits")
                     for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
    modules += sorted((p, p.parent.name, f"{p.parent.parent.name}/{p.parent.name}/")
                      for folder in ("probes", "circuits") for p in (ROOT / folder).glob("*/__init__.py"))
    from kvnotes.cli.errors import conf_names

    assert {name for _, name, _ in modules} == set(conf_names("probe"))      # every registered probe, each found
    for path, name, shown in modules:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        page = f"docs/probes/{name}.md"
        assert page in doc, f"{path.relative_to(ROOT)}: its docstring does not link {page}"
        assert (ROOT / page).is_file(), f"{page} is missing"
        assert f"probes/{name}.md" in nav, f"{page} is not in the site's nav"
        assert f"`{shown}`" in (ROOT / page).read_text(), f"{page} does not name {shown}"


def _owner(module: str) -> str | None:
    """The probe or circuit a module belongs to (``kvnotes.probes.<name>.<part>`` -> ``kvnotes.probes.<name>``)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] in (["kvnotes", "probes"], ["kvnotes", "circuits"]) and len(parts) > 2 else None


def test_no_harness_module_serves_one_probe_alone():
    """Probe-private code lives with its probe (issue #51): every harness module that a probe or
    circuit imports is also imported by another probe, circuit, command, benchmark or harness module
    (tests do not count). A module only one probe needs belongs in that probe's module or package."""
    modules = dict((name, path) for path, name in _modules())
    users: dict[str, set[str]] = {}
    for name, path in modules.items():
        for dep in _imports(path, name):
            target = dep if dep in modules else dep.rpartition(".")[0]
            if target.startswith("kvnotes.harness.") and target != name:
                users.setdefault(target, set()).add(_owner(name) or name)
    private = {m: sorted(u) for m, u in users.items() if len(u) == 1 and _owner(next(iter(u)))}
    assert not private, f"harness modules only one probe uses (move them into it): {private}"


def _probe_names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "probe").glob("*.yaml"))


def _mentions(name: str, text: str, lane: bool = False) -> list[str]:
    """How ``text`` names probe ``name``: any occurrence of a name no other concept shares (one with
    an underscore); else as a probe's module (``probes.name``, ``circuits.name``) or spec page, and
    in a lane (``lane``) also as a run's probe (``probe=name``, a quoted name). A single-word name
    elsewhere is a term of the field (an edit method, composition, heads, the screen)."""
    if "_" in name:
        pattern = rf"(?<![\w-]){name}(?![\w-])"
    else:
        pattern = rf"\b(?:probes|circuits)\.{name}\b|\bprobes/{name}\.md"
        if lane:
            pattern += rf"|probe[=:]\s*{name}\b|['\"]{name}['\"]|planted\(['\"]{name}"
    return re.findall(pattern, text)


def test_no_file_outside_a_probe_names_it():
    """A probe is its module, its YAML and its spec page (issue #51): no other file of ``kvnotes/``,
    ``conf/``, ``tests/lanes/`` or ``mkdocs.yml`` names it (:func:`_mentions`), but for the run's own
    choice of a default probe (``conf/config.yaml``, and the usage lines of ``run.py``, the
    experiments and the launchers that show it) and a command of the probe's own
    (``kvnotes/cli/<name>.py``: ``kvnotes locomo`` runs its probe on a LoCoMo file)."""
    names = _probe_names()
    default = default_probe()
    files = [p for p in (ROOT / "kvnotes").rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".md")
             and not {"probes", "circuits"} & set(p.relative_to(ROOT / "kvnotes").parts[:1])]
    files += [p for p in (ROOT / "conf").rglob("*.yaml")] + [p for p in (ROOT / "tests" / "lanes").glob("*.py")
                                                             if p.name != Path(__file__).name]
    files.append(ROOT / "mkdocs.yml")
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for name in names:
            if rel in (f"conf/probe/{name}.yaml", f"kvnotes/cli/{name}.py") or (name == default and rel.startswith(
                    ("conf/config.yaml", "conf/experiment/", "conf/hydra/launcher/", "kvnotes/cli/run.py"))):
                continue
            found += [f"{rel}: {m}" for m in _mentions(name, text, rel.startswith("tests/lanes/"))]
    assert not found, "files that name a probe:\n" + "\n".join(found)


def test_the_probe_name_check_can_fail():
    assert _mentions("field_refresh", "see field_refresh's page") and _mentions("edit", "from probes.edit import")
    assert _mentions("edit", "probe=edit", lane=True) and not _mentions("edit", "probe=edit")
    assert not _mentions("edit", "an edit method", lane=True) and not _mentions("field_refresh", "a field_refresher")
