"""A record's inputs: what decides its numbers besides its config.

A record's identity (:func:`kvnotes.harness.runconfig.identity`) is its resolved config; two runs
with the same config can still differ when a scenario file was edited, other weights sit behind the
same model name (a checkpoint directory rewritten, a new embedded package), or the library changed.
:func:`record_inputs` names those inputs, cheaply and before any model loads:

- ``scenario``: the sha256 over every scenario file the config reads (``scenario.paths`` as
  :func:`kvnotes.scenarios.schema.load_suite` finds them, the memory suite ``scenario.memory`` and the
  LoCoMo file ``scenario.locomo``), each
  file's content with its name relative to the path entry, and the number of files;
- ``weights``: for a checkpoint directory (``model.path``), its absolute path and the sha256 over
  every file's name and content (each file's digest is cached by path, size and modification time
  under :func:`kvnotes.models.loading.cache_dir`, so a multi-GB checkpoint is read once); for an
  embedded model, its packages' installed versions and the GGUF file (and declared sha256); for a
  hub id, the id, the requested revision and the commit of the local snapshot (None when not in the
  local cache); for random weights, the seed and shape switches (already in the config) and the
  tokenizer's own inputs;
- ``kvnotes``: the installed kvnotes version;
- ``code``: the code that computes the result (:func:`code_inputs`): the sha256 over the kvnotes
  package's source (every ``.py`` file, the linked ``probes/``, ``circuits/`` and ``scenarios/``
  included, and the adapter table) and over the probe's own module (its file, or its package's files),
  which may live in a user's project outside kvnotes. The content is the identity, so an edit to any
  of them, committed or not, makes the next run recompute; the git commit and dirty flag are recorded
  beside it in the record's envelope (``git``).

:func:`inputs_diff` names the parts in which two records' inputs differ. The job path stores the
inputs in the record (``record["inputs"]``) and runs a job again when a complete record's inputs
differ from the current ones (docs/design.md, "Records").
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from kvnotes.errors import KvnotesError
from kvnotes.models.loading import cache_dir, file_sha256

#: Files of a checkpoint directory left out of its digest (caches written beside the weights).
_SKIP_NAMES = (".DS_Store",)


def _digest_cache_path() -> Path:
    return cache_dir() / "file_digests.json"


def cached_file_sha256(path: Path) -> str:
    """The sha256 of a file's content, cached by (absolute path, size, mtime in ns) in
    ``<cache>/file_digests.json`` so that a large checkpoint is read once per change.

    Raises:
        OSError: the file cannot be read.
    """
    path = path.resolve()
    st = path.stat()
    if st.st_size < 1 << 24:                  # only large files are worth remembering (nor looking up)
        return file_sha256(path)
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    store = _digest_cache_path()
    try:
        cache = json.loads(store.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    digest = file_sha256(path)
    cache = {k: v for k, v in cache.items() if not k.startswith(f"{path}\0")} | {key: digest}
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, store)
    except OSError:
        pass                                  # a read-only cache costs a re-read, nothing else
    return digest


def tree_sha256(files: list[tuple[str, Path]]) -> str:
    """sha256 over ``(name, content digest)`` of each file, in the given order."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode())
        h.update(b"\0")
        h.update(cached_file_sha256(path).encode())
        h.update(b"\n")
    return h.hexdigest()


def scenario_files(scenario_cfg: Any) -> list[tuple[str, Path]]:
    """``(name, path)`` of every file a scenario config reads: the YAML files under ``paths`` (as
    :func:`kvnotes.scenarios.schema.load_suite` lists them; a missing path is left to the loader's error)
    the memory suite file ``memory`` (as :func:`kvnotes.scenarios.memory.load_memory` resolves it) and
    the LoCoMo file ``scenario.locomo``."""
    from kvnotes.scenarios.schema import resolve_path

    out: list[tuple[str, Path]] = []
    for entry in scenario_cfg.get("paths") or ():
        p = resolve_path(str(entry))
        if p.is_dir():
            out += [(f"{entry}/{f.relative_to(p)}", f) for f in sorted(p.rglob("*.yaml"))]
        elif p.is_file():
            out.append((str(entry), p))
    memory = scenario_cfg.get("memory")
    if memory:
        p = resolve_path(str(memory))
        files = sorted(p.glob("*.yaml")) if p.is_dir() else [p] if p.is_file() else []
        out += [(f"{memory}:{f.name}", f) for f in files]
    locomo = scenario_cfg.get("locomo")
    if locomo and resolve_path(str(locomo)).is_file():
        out.append((f"locomo:{locomo}", resolve_path(str(locomo))))
    return out


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _local_snapshot_commit(hf_id: str, revision: str | None) -> str | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hf_id, revision=revision, local_files_only=True)).name
    except Exception:  # not in the local cache (or no hub library state): unknown until it loads
        return None


def checkpoint_files(path: Path) -> list[tuple[str, Path]]:
    """``(relative name, path)`` of every file of a checkpoint directory, sorted, hidden ones and
    :data:`_SKIP_NAMES` left out."""
    return [(str(f.relative_to(path)), f) for f in sorted(path.rglob("*"))
            if f.is_file() and f.name not in _SKIP_NAMES
            and not any(part.startswith(".") for part in f.relative_to(path).parts)]


def weights_inputs(model_cfg: Any) -> dict:
    """The weights part of :func:`record_inputs` for a model config (module docstring).

    Raises:
        KvnotesError: ``model.path`` is not a readable checkpoint directory.
    """
    random_init = model_cfg.get("random_init") or {}
    if random_init.get("enabled"):
        from kvnotes.models import zoo

        tok = str(random_init.get("tokenizer", "smollm2-135m"))
        tok_dir = Path(os.path.expanduser(tok))
        if tok_dir.is_dir():           # a directory of tokenizer files: its files are its identity
            tok_inputs = {"path": str(tok_dir.resolve()), "sha256": tree_sha256(checkpoint_files(tok_dir))}
        else:
            try:
                tok_inputs = weights_inputs(zoo.zoo_config(tok))
            except KvnotesError:
                tok_inputs = {"entry": tok}
        return {"source": "random", "tokenizer": tok_inputs}
    if model_cfg.get("path"):
        path = Path(os.path.expanduser(str(model_cfg.path))).resolve()
        try:
            return {"source": "local", "path": str(path), "sha256": tree_sha256(checkpoint_files(path))}
        except OSError as exc:
            raise KvnotesError(f"model.path={model_cfg.path}: cannot read the checkpoint "
                               f"({exc.strerror or type(exc).__name__})") from None
    planted = model_cfg.get("planted")
    if planted:                        # built from the config by code: the construction's version is its identity
        from kvnotes.models import zoo
        from kvnotes.models.planted import CONSTRUCTION_VERSION

        return {"source": "planted", "planted": zoo.plain(planted), "construction_version": CONSTRUCTION_VERSION}
    embedded = model_cfg.get("embedded")
    if embedded:
        packages = [p["package"] for p in embedded.get("parts")] if embedded.get("parts") else [embedded["package"]]
        return {"source": "embedded", "file": str(embedded["file"]), "sha256": embedded.get("sha256"),
                "packages": {p: _package_version(p.replace("_", "-")) for p in packages}}
    hf_id = model_cfg.get("hf_id")
    return {"source": "hub", "hf_id": hf_id, "revision": model_cfg.get("revision"),
            "commit": _local_snapshot_commit(str(hf_id), model_cfg.get("revision")) if hf_id else None}


#: The kvnotes package directory (``probes/``, ``circuits/``, ``scenarios/`` are linked into it).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: Files of the package besides its ``.py`` files whose content can change a result.
_PACKAGE_DATA = ("models/adapters.yaml",)


def source_files(root: Path) -> list[tuple[str, Path]]:
    """``(name relative to root, path)`` of every ``.py`` file below ``root`` (links followed, caches
    and hidden folders skipped), sorted: the source a digest of code covers."""
    out = []
    for top, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        out += [(str(Path(top, f).relative_to(root)), Path(top, f)) for f in files if f.endswith(".py")]
    return sorted(out)


def code_inputs(probe_cfg: Any = None) -> dict:
    """The code part of :func:`record_inputs`: ``{kvnotes: sha256 of the package source, probe:
    {module, sha256} | None}``. The probe's module is found from its config's ``_target_``
    (:func:`kvnotes.harness.registry.module`); a module that is a package's ``__init__`` counts with
    every ``.py`` file of that package.

    Args:
        probe_cfg: the run's ``probe`` config, or None (no probe part).

    Raises:
        KvnotesError: the probe's module cannot be imported.
    """
    import inspect

    files = source_files(PACKAGE_DIR) + [(n, PACKAGE_DIR / n) for n in _PACKAGE_DATA if (PACKAGE_DIR / n).is_file()]
    out: dict[str, Any] = {"kvnotes": tree_sha256(files), "probe": None}
    if probe_cfg is not None and probe_cfg.get("_target_"):
        from kvnotes.harness import registry

        mod = registry.module(probe_cfg)
        path = Path(inspect.getsourcefile(mod) or mod.__file__ or "")
        if path.name == "__init__.py":
            probe_files = source_files(path.parent)
        else:
            probe_files = [(path.name, path)] if path.is_file() else []
        out["probe"] = {"module": mod.__name__, "sha256": tree_sha256(probe_files)}
    return out


def record_inputs(cfg: Any) -> dict:
    """What decides a run's numbers besides its config (module docstring): ``{scenario: {sha256,
    files}, weights: {...}, kvnotes: version, code: {kvnotes, probe}}``.

    Args:
        cfg: a composed run config (``model`` and ``scenario`` keys; ``probe``, when present, adds its
            module to the code part).

    Raises:
        KvnotesError: an unreadable checkpoint directory; ScenarioError is left to the loaders.
    """
    files = scenario_files(cfg.scenario)
    try:
        scenario = {"sha256": tree_sha256(files), "files": len(files)}
    except OSError as exc:
        raise KvnotesError(f"scenario file unreadable: {exc.filename} ({exc.strerror})") from None
    return {"scenario": scenario, "weights": weights_inputs(cfg.model), "kvnotes": _package_version("kvnotes"),
            "code": code_inputs(cfg.get("probe"))}


def inputs_diff(old: dict | None, new: dict) -> list[str]:
    """The parts of :func:`record_inputs` in which a record's ``old`` inputs differ from ``new``,
    in words (``"scenario files"``, ``"weights"``, ``"kvnotes version"``, ``"kvnotes source"``,
    ``"probe module <name>"``, ``"code not recorded"``); a record written before inputs were
    recorded gives ``["inputs not recorded"]``."""
    if not old:
        return ["inputs not recorded"]
    names = {"scenario": "scenario files", "weights": "weights", "kvnotes": "kvnotes version"}
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) == new.get(k):
            continue
        if k != "code":
            out.append(names.get(k, k))
        elif not old.get(k):
            out.append("code not recorded")
        else:
            if old[k].get("kvnotes") != (new.get(k) or {}).get("kvnotes"):
                out.append("kvnotes source")
            if old[k].get("probe") != (new.get(k) or {}).get("probe"):
                module = ((new.get(k) or {}).get("probe") or old[k].get("probe") or {}).get("module")
                out.append(f"probe module {module}")
    return out
