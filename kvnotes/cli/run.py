"""``kvnotes run`` (and ``python run.py``): compose config -> load model -> build pairs -> run probe -> write record.

    python run.py                                   # blast_radius on the embedded SmolLM2-135M
    python run.py model=qwen3-8b probe=screen       # a hub model (GPU)
    python run.py -m model=smollm2-135m probe=blast_radius,screen   # one record per job

A record lives at ``<out_root>/<model>/<probe>/<scenario>/<overrides>/record.json``, where
``<overrides>`` names the job's command-line overrides other than the group choices and the keys
that cannot change a result (``hydra.job.config.override_dirname`` in ``conf/config.yaml``; empty for
a plain run): a sweep over any key keeps its records side by
side. A complete record is reused only when the config that produced it equals the requested one
(otherwise the job stops with one line naming the keys that differ; ``force=true`` replaces it) and
its inputs (scenario files' content, weights, kvnotes version: :mod:`kvnotes.harness.inputs`) are
the current ones (otherwise the job says what changed and runs again).
Two processes asking for the same record take turns on a lock file beside it.

Bad input (unknown model/probe/scenario or key, a value of the wrong type, a device or quantization
this machine cannot run, an unwritable out_root, invalid scenario files, a model unavailable
offline) is reported as one line on stderr with exit status 2, before any model loads, and no
record is written. Ctrl-C leaves no record behind (exit status 130).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes import CONF_DIR
from kvnotes.cli.errors import conf_names, fail

CONF = CONF_DIR
GROUPS = ("model", "probe", "scenario")
#: Sweep points composed and checked up front (a larger sweep checks its first ones).
MAX_CHECKED = 64


def remove_empty_dirs(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while empty, up to (not including) ``stop``."""
    path, stop = path.resolve(), stop.resolve()
    while path != stop and stop in path.parents and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


def user_config_dirs(argv: list[str]) -> tuple[list[str], list[Path]]:
    """``argv`` without its ``--config-dir DIR`` / ``-cd DIR`` options (Hydra's flag; repeatable here),
    and those directories: a user's own config groups (``model/``, ``probe/``, ``scenario/``) beside
    the ones kvnotes ships. They join Hydra's search path as ``hydra.searchpath`` (after kvnotes'
    own configs, so a user's file adds choices and its ``defaults`` may name kvnotes' entries), the
    same for the up-front check and for the job.

    Raises:
        SystemExit: (exit 2) a missing directory, a flag without one, or ``hydra.searchpath`` given too.
    """
    rest: list[str] = []
    dirs: list[Path] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in ("--config-dir", "-cd"):
            value = value if eq else next(it, "")
            if not value:
                fail(f"{flag} needs a directory")
            path = Path(value).expanduser().resolve()
            if not path.is_dir():
                fail(f"{flag} {value}: no such directory")
            dirs.append(path)
        else:
            rest.append(arg)
    if dirs and any(a.partition("=")[0].lstrip("+") == "hydra.searchpath" for a in rest):
        fail("give your config folders either as --config-dir or as hydra.searchpath, not both")
    return rest, dirs


def quoted(value: str) -> str:
    """A Hydra override value quoted, so that any path (``/``, ``,``, ``=``, quotes, backslashes) is
    one string: quotes are escaped, and so are backslashes before a quote or the closing one (Hydra's
    rule for quoted values)."""
    import re

    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value)).replace("'", "\\'")
    return f"'{escaped}'"


def searchpath_override(dirs: list[Path]) -> list[str]:
    """The ``hydra.searchpath=[file://...]`` override naming ``dirs`` (none when there are none)."""
    return [f"hydra.searchpath=[{','.join(repr(f'file://{d}') for d in dirs)}]"] if dirs else []


def check_choices(argv: list[str], dirs: Sequence[Path] = ()) -> None:
    """Reject unknown config-group choices with one line before Hydra prints its own page: a choice
    is known when ``conf/<group>/<choice>.yaml`` is in kvnotes' configs or in a user's ``dirs``."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS:
            continue
        known = conf_names(key, dirs)
        for choice in value.split(","):
            if choice and choice not in known:
                fail(f"unknown {key} '{choice}' (known: {', '.join(known)})")


def probe_choices(args: Sequence[str]) -> set[str] | None:
    """The probes a command line (or a sweep point's overrides) composes: the values of ``probe=``
    (a comma sweep gives several) and ``conf/config.yaml``'s default; None when a sweep function
    (``choice(...)``, ``glob(...)``) names them, so every probe is registered
    (:func:`kvnotes.harness.registry.register_schemas`)."""
    from omegaconf import OmegaConf

    # the default probe too: a multirun composes the primary config with it before the sweep's points
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml")).get("defaults", [])  # type: ignore[union-attr]
    out: set[str] = {str(d["probe"]) for d in defaults if isinstance(d, dict) and "probe" in d}
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "probe":
            if any(c in value for c in "()*[]"):
                return None
            out.update(v.strip() for v in value.split(",") if v.strip())
    return out or None


def _hydra_message(exc: Exception) -> str:
    """Hydra's multi-line composition error (and the OmegaConf error behind it) as one line."""
    text = "\n".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if key and key.startswith("probe.") and any(" not in '" in ln or "not in struct" in ln for ln in lines):
        # the probe node is its Config dataclass (kvnotes.harness.registry.register_schemas): every
        # key it declares composes, so this one is not declared
        from kvnotes.harness.registry import declared_probe_keys
        from kvnotes.harness.runconfig import nearest_key

        near = nearest_key(key.rpartition(".")[2], declared_probe_keys())
        return f"unknown key '{key}': the probe's Config does not declare it" + (f"; did you mean probe.{near}?"
                                                                                  if near else "")
    if key and any("not in struct" in ln for ln in lines):
        from kvnotes.harness.runconfig import known_keys, nearest_key

        parent, _, last = key.rpartition(".")
        near = nearest_key(last, known_keys(tuple(parent.split(".")) if parent else ()))
        if near == last:                    # declared, but its parent is null in this config
            return f"{key}: {parent} is null in this config; set it whole, e.g. {parent}={{{last}:...}}"
        return f"unknown key '{key}'" + (f"; did you mean {parent + '.' if parent else ''}{near}?" if near else "")
    if lines[0].startswith("Error merging override") and len(lines) > 1:
        lines = lines[1:]                   # the reason (a value of the wrong type), not the wrapper
    return lines[0] if not key else f"{key}: {lines[0]}"


def precheck(argv: list[str]) -> None:
    """Compose the config of every job the command line asks for (each point of a sweep, up to
    :data:`MAX_CHECKED`) and check it (:func:`kvnotes.harness.runconfig.check_run_config`) before Hydra
    runs anything: every mistake is one line, before any model loads."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvnotes.harness.runconfig import USER_ERRORS
    from kvnotes.harness.runconfig import check_run_config

    args = overrides_of(argv)
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except Exception as exc:  # hydra's OverrideParseException and friends
        fail(f"cannot parse the overrides: {str(exc).splitlines()[0]}")
    # a job that runs on another machine (a SLURM launcher) checks its device and quantization there
    launchers = [str(o.value()) for o in overrides if o.key_or_group == "hydra/launcher"]
    local = not any("slurm" in name for name in launchers)
    if not local:
        check_slurm(launchers[0])
    multirun = "-m" in argv or "--multirun" in argv
    fixed, sweeps, hydra_overrides = [], [], []
    for o in overrides:
        if o.key_or_group.split(".")[0].split("/")[0] == "hydra":
            hydra_overrides.append(o)
            continue
        if o.is_delete():
            what = "a config group" if o.key_or_group in GROUPS else "a key"
            fail(f"~{o.key_or_group}: deleting {what} is not supported (every key has a value the job reads); "
                 f"set it instead, e.g. {o.key_or_group}=...")
        if o.is_sweep_override():
            if not multirun:
                fail(f"{o.input_line} is a sweep (several values): add -m to run one job per value")
            try:
                sweeps.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
            except (ValueError, TypeError) as exc:                  # range(0, 3, 0), a sweep of no values
                fail(f"{o.input_line}: not a sweep Hydra can expand ({exc})")
        else:
            fixed.append(o.input_line)
    fixed += [a for a in args if a.startswith("hydra.searchpath=")]
    check_hydra_overrides(hydra_overrides, fixed)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for point in itertools.islice(itertools.product(*sweeps), MAX_CHECKED):
            try:
                cfg = compose("config", overrides=fixed + list(point))
            except Exception as exc:  # ConfigCompositionException, OmegaConf errors
                fail(_hydra_message(exc))
            try:
                note_out_root(str(cfg.out_root))
                check_run_config(cfg, machine=local)
            except USER_ERRORS as exc:
                fail(str(exc))


#: Hydra's own command-line flags (``python run.py --help``); any other flag is refused in one line.
HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p", "--package", "-r",
               "--run", "-m", "--multirun", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
               "--config-name", "-cd", "--config-dir", "--experimental-rerun", "-i", "--info")


#: Hydra's flags that take a value as the next argument (``--cfg job``, ``-cn NAME``).
HYDRA_VALUE_FLAGS = ("-c", "--cfg", "-p", "--package", "-i", "--info", "-cp", "--config-path", "-cn", "--config-name",
                     "-cd", "--config-dir", "--experimental-rerun", "-sc", "--shell-completion")


def overrides_of(argv: Sequence[str]) -> list[str]:
    """The overrides of a command line: its arguments less Hydra's flags and their values."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-") and not _is_number(arg):
            skip = arg in HYDRA_VALUE_FLAGS                       # --cfg=job keeps its value in the flag
        else:
            out.append(arg)
    return out


def check_flags(argv: Sequence[str]) -> None:
    """Refuse a flag Hydra does not know (``--nosuch``) in one line, before Hydra prints its usage page.

    Raises:
        SystemExit: (exit 2) the first unknown flag.
    """
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if arg.startswith("-") and flag not in HYDRA_FLAGS and not _is_number(arg):
            fail(f"unknown flag {flag} (run.py takes overrides key=value and Hydra's flags: {', '.join(HYDRA_FLAGS)})")
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag in ("-cp", "--config-path") and not Path(value).expanduser().is_dir():
            fail(f"{flag} {value}: no such directory (kvnotes' configs are built in; add your own with --config-dir DIR)")
        if flag in ("-cn", "--config-name") and value.removesuffix(".yaml") != "config":
            fail(f"{flag} {value}: kvnotes runs its own primary config 'config' (conf/config.yaml); choose groups "
                 f"with model=, probe=, scenario= and add your own with --config-dir DIR")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def check_hydra_overrides(overrides: Sequence[Any], fixed: Sequence[str]) -> None:
    """The command line's ``hydra.*`` overrides and ``hydra/...`` choices compose (a key Hydra does
    not have, a launcher that does not exist), and a run or sweep folder given as ``hydra.run.dir`` /
    ``hydra.sweep.dir`` can be made (as ``out_root`` is checked: :func:`check_out_root`).

    Raises:
        SystemExit: (exit 2) the first problem, in one line; nothing is written.
    """
    from hydra import compose, initialize_config_dir

    from kvnotes.errors import KvnotesError
    from kvnotes.harness.runconfig import check_out_root

    if not overrides:
        return
    for o in overrides:
        if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir") and not o.is_sweep_override():
            try:
                check_out_root(str(o.value()))
            except KvnotesError as exc:
                fail(str(exc).replace("out_root=", f"{o.key_or_group}=", 1))
    lines = [o.input_line for o in overrides if not o.is_sweep_override()]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        try:
            compose("config", overrides=[*fixed, *lines], return_hydra_config=True)
        except Exception as exc:  # ConfigCompositionException, OmegaConf errors
            fail(_hydra_message(exc))


def check_slurm(launcher: str) -> None:
    """A SLURM launcher can submit from here: submitit calls ``sbatch`` (and the job ``srun``).

    Raises:
        SystemExit: (exit 2) neither is on this machine's PATH; nothing is written.
    """
    import shutil

    missing = [cmd for cmd in ("sbatch", "srun") if shutil.which(cmd) is None]
    if missing:
        fail(f"hydra/launcher={launcher} submits jobs to SLURM, but {' and '.join(missing)} "
             f"{'is' if len(missing) == 1 else 'are'} not on this machine's PATH: run from a SLURM login node, "
             f"or drop hydra/launcher to run here")


#: Longest record-directory part spelled out in full; longer ones keep a prefix and a hash.
MAX_VARIANT_CHARS = 120


def variant_dir(override_dirname: str) -> str:
    """The record directory's last part from Hydra's ``override_dirname``: ``''`` for no overrides,
    else the overrides with path separators made safe; past :data:`MAX_VARIANT_CHARS` characters a
    readable prefix and a hash of the whole (file systems cap a name at 255 bytes). The record keeps
    every override in full (``hydra.overrides``)."""
    import hashlib

    name = override_dirname.replace("/", "%2F")
    if len(name) <= MAX_VARIANT_CHARS:
        return name
    return f"{name[:MAX_VARIANT_CHARS - 13]}~{hashlib.sha1(name.encode()).hexdigest()[:12]}"


#: Scenario keys naming the files a suite is read from: given on the command line, they name the record
#: directory's suite part (:func:`suite_dir`) instead of its overrides part.
SUITE_KEYS = ("scenario.paths", "scenario.memory", "scenario.locomo")


def suite_dir(name: str, overrides: Sequence[str]) -> str:
    """The record directory's suite part: the scenario config's ``name``, or, when the job's
    ``overrides`` give the suite's files (:data:`SUITE_KEYS`: a user's own suite, a LoCoMo file), the
    files' names and a hash of their absolute paths, ``<stem>[+<stem>...]~<hash>`` (two folders of one
    name never share a directory). ``name`` is kept only when no such key is overridden.

    Args:
        name: ``scenario.name`` of the composed config.
        overrides: the job's command-line overrides (``hydra.overrides.task``).
    """
    import hashlib
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvnotes.scenarios.schema import resolve_path

    given = [o for o in overrides if o.lstrip("+~").partition("=")[0] in SUITE_KEYS]
    if not given:
        return name
    files: list[str] = []
    for o in OverridesParser.create().parse_overrides(given):
        value = o.value()
        files += [str(v) for v in (value if isinstance(value, list) else [value]) if v not in (None, "")]
    if not files:
        return name
    stems = [re.sub(r"[^A-Za-z0-9._-]+", "_", Path(f.rstrip("/")).stem or "suite") for f in files]
    shown = "+".join(stems[:3]) + (f"+{len(stems) - 3}more" if len(stems) > 3 else "")
    digest = hashlib.sha1("\0".join(str(resolve_path(f).resolve()) for f in files).encode()).hexdigest()[:8]
    return f"{shown[:60]}~{digest}"


def quiet_job(out_root: str, device: str) -> list[str]:
    """The overrides of a job a command runs for its numbers (``kvnotes battery``, ``ownership-scan``,
    ``locomo``): no progress bars or figures (keys that name no record directory), records under
    ``out_root``, and ``device`` unless ``auto`` (``run.py``'s default: the record is the one
    ``kvnotes run`` writes)."""
    return ["probe.progress=false", "plot=false", f"out_root={out_root}"] + ([f"device={device}"] if device != "auto" else [])


@dataclass
class Job:
    """One job of ``kvnotes run`` composed in this process: what Hydra would hand :func:`job`."""

    #: the composed run config (``conf/config.yaml`` with the overrides; no ``hydra`` node)
    cfg: Any
    #: the record's directory: ``<out_root>/<model>/<probe>/<scenario>/<overrides>`` as ``run.py`` names it
    out_dir: Path
    #: ``{choices, overrides, output_dir, mode}``: the record's ``hydra`` entry
    hydra_info: dict


def compose_jobs(points: Sequence[Sequence[str]], dirs: Sequence[Path] = ()) -> list[Job]:
    """The jobs ``kvnotes run`` would run for each list of overrides in ``points`` (one job each; no
    sweep syntax), composed and checked (:func:`kvnotes.harness.runconfig.check_run_config`) in this
    process, with the record directory and ``hydra`` entry ``run.py`` would give them: a command that
    runs jobs itself (``kvnotes battery``, ``kvnotes ownership-scan``) writes the records ``run.py``
    would. ``dirs``: a user's config folders (:func:`user_config_dirs`).

    Raises:
        KvnotesError, ScenarioError: a point that does not compose or fails its checks (one line).
    """
    from hydra import compose, initialize_config_dir
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from kvnotes.errors import KvnotesError
    from kvnotes.harness.runconfig import check_run_config

    from kvnotes.harness.registry import register_schemas

    named = [probe_choices(point) for point in points]
    register_schemas(dirs, None if None in named else set().union(*named))
    jobs = []
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for point in points:
            try:
                cfg = compose("config", overrides=[*point, *searchpath_override(list(dirs))], return_hydra_config=True)
            except Exception as exc:  # ConfigCompositionException, OmegaConf errors
                raise KvnotesError(_hydra_message(exc)) from None
            hc = cfg.hydra
            out_dir = (Path(cfg.out_root) / cfg.model.name / cfg.probe.name
                       / suite_dir(str(cfg.scenario.name), list(hc.overrides.task))
                       / variant_dir(str(hc.job.override_dirname)))
            info = {"choices": OmegaConf.to_container(hc.runtime.choices), "overrides": list(hc.overrides.task),
                    "output_dir": str(out_dir), "mode": str(RunMode.RUN)}
            with open_dict(cfg):
                del cfg["hydra"]
            note_out_root(str(cfg.out_root))
            check_run_config(cfg)
            jobs.append(Job(cfg, out_dir, info))
    return jobs


def register_resolvers() -> None:
    """The resolvers ``conf/config.yaml`` names the record directory with (:func:`variant_dir`,
    :func:`suite_dir`), registered once."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("kvnotes_variant"):
        OmegaConf.register_new_resolver("kvnotes_variant", variant_dir)
    if not OmegaConf.has_resolver("kvnotes_suite"):
        OmegaConf.register_new_resolver("kvnotes_suite", lambda name, task: suite_dir(str(name), list(task)))


def main() -> None:
    from kvnotes.errors import stop_message, terminate_as_interrupt

    terminate_as_interrupt()
    try:
        _main()
    except KeyboardInterrupt as exc:
        what, status = stop_message(exc)
        fail(f"{what}; no record written", status=status)


def _main() -> None:
    argv, dirs = user_config_dirs(sys.argv[1:])
    argv += searchpath_override(dirs)
    # A probe's _target_ may name a module of the user's project: the working directory is importable,
    # as under `python -m` (appended, so it never shadows an installed package).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    check_flags(argv)
    from kvnotes.harness.registry import register_schemas

    register_schemas(dirs, probe_choices(argv))  # the probes' Config dataclasses: their YAML sets what differs
    check_choices(argv, dirs)
    if "--help" not in argv and "-h" not in argv:
        precheck(argv)
    sys.argv[1:] = argv
    import hydra

    register_resolvers()
    hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")(job)()


def job(cfg) -> None:
    """Hydra's task function: :func:`run_or_reuse` in the directory Hydra chose."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    run_or_reuse(cfg, out_dir, {"choices": dict(hc.runtime.choices), "overrides": list(hc.overrides.task),
                                "output_dir": str(out_dir), "mode": str(hc.mode)})


def run_or_reuse(cfg, out_dir: Path, hydra_info: dict) -> Path:
    """What one ``kvnotes run`` job does in ``out_dir``: reuse a complete record of the same config
    computed from the current inputs, else run the job (:func:`kvnotes.harness.jobs.run_job`), one
    process at a time (a lock file beside the record). Returns the record's path.

    Raises:
        SystemExit: (one line; exit 2) bad input or a record of another config there; (130) Ctrl-C.
            Nothing of the job is left behind.
    """
    from filelock import FileLock
    from omegaconf import OmegaConf

    from kvnotes.harness.runconfig import USER_ERRORS
    from kvnotes.harness.inputs import inputs_diff, record_inputs
    from kvnotes.harness.jobs import run_job
    from kvnotes.records.store import RECORD_NAME, is_complete, load_record
    from kvnotes.harness.runconfig import check_run_config, identity, identity_diff

    record_path = out_dir / RECORD_NAME
    try:
        check_run_config(cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = Path(str(record_path) + ".lock")
        with FileLock(str(lock)), _lock_removed_when_complete(lock, record_path):   # a second process waits, then finds the record
            if is_complete(record_path) and not cfg.force:
                old = load_record(record_path)
                differ = identity_diff(identity(old["config"]), identity(OmegaConf.to_container(cfg, resolve=True)))
                if differ:
                    shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
                    fail(f"{record_path} holds a record of a different config (differs in {shown}): force=true "
                         f"replaces it, or choose another out_root")
                changed = inputs_diff(old.get("inputs"), record_inputs(cfg))
                if not changed:
                    print(f"kvnotes: {record_path} is complete; skipping (force=true to re-run)")
                    return record_path
                print(f"kvnotes: {record_path} was computed from other inputs ({', '.join(changed)} changed); "
                      f"running again")
            run_job(cfg, out_dir, hydra_info)
        return record_path
    except USER_ERRORS as exc:
        _clean(out_dir, record_path, Path(cfg.out_root))
        fail(str(exc))
    except KeyboardInterrupt as exc:            # Ctrl-C, or SIGTERM (kvnotes.errors.Terminated)
        from kvnotes.errors import stop_message

        _clean(out_dir, record_path, Path(cfg.out_root))
        what, status = stop_message(exc)
        fail(f"{what}; no record written", status=status)
    except BaseException:                       # a bug: its traceback, and nothing of this job left behind
        _clean(out_dir, record_path, Path(cfg.out_root))
        raise


@contextmanager
def _lock_removed_when_complete(lock: Path, record_path: Path):
    """On leaving (while the lock is still held), remove the lock file beside a complete record:
    a process waiting on it then finds the record and skips, a later one finds no lock file and the
    record, so no lock file outlives its job beside a complete record."""
    from kvnotes.records.store import is_complete

    try:
        yield
    finally:
        if is_complete(record_path):
            lock.unlink(missing_ok=True)


def _clean(out_dir: Path, record_path: Path, out_root: Path) -> None:
    """Remove this job's lock file (when no record is there) and its directories while empty, up to
    the folder that existed before this command ran (``out_root`` itself when this command made it:
    :data:`PREEXISTING`)."""
    lock = Path(str(record_path) + ".lock")
    if lock.exists() and not record_path.exists():
        lock.unlink(missing_ok=True)
    remove_empty_dirs(out_dir, PREEXISTING.get(str(out_root), out_root))


#: ``out_root`` -> the nearest of its folders that existed when this process first checked it
#: (:func:`note_out_root`): what a refused or interrupted job may remove stops there.
PREEXISTING: dict[str, Path] = {}


def note_out_root(out_root: str) -> None:
    """Remember the nearest existing folder of ``out_root`` (itself when it exists), before any job
    of this process creates it (:data:`PREEXISTING`)."""
    from kvnotes import existing_ancestor

    PREEXISTING.setdefault(str(out_root), existing_ancestor(Path(out_root)))


if __name__ == "__main__":
    main()
