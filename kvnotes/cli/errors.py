"""The error boundary of every ``kvnotes`` entry point, and the checks of command-line values.

Project rule: bad input at any entry point is ONE line on stderr, ``kvnotes: error: <message>``, and
exit status 2; never a traceback, never a half-written output. Ctrl-C is one line and exit status
130. :func:`guarded` is that boundary: the ``kvnotes`` dispatcher (:func:`kvnotes.cli.main`) runs
every subcommand through it, and each module's ``__main__`` block does the same when run alone.

Commands raise :class:`kvnotes.errors.KvnotesError` (or a scenario file's
:class:`kvnotes.scenarios.errors.ScenarioError`; together :data:`USER_ERRORS`) for bad input, BEFORE doing
any work or printing anything. The argparse ``type=`` functions here (:func:`int_at_least`,
:func:`float_at_least`, :func:`one_of`, :func:`conf_name`, :func:`existing_path`,
:func:`output_file`, :func:`device_name`) raise it while the arguments are parsed, so a bad flag never reaches a model
load. (They raise :class:`KvnotesError`, not ``ValueError``: argparse turns a ``ValueError`` into
its own two-line usage message.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from kvnotes import CONF_DIR, existing_ancestor, try_new_entry
from kvnotes.errors import KvnotesError
from kvnotes.scenarios.errors import ScenarioError

#: Exceptions reported as ``kvnotes: error: <message>`` with exit status 2: the same tuple as
#: :data:`kvnotes.harness.runconfig.USER_ERRORS` (kept here so the dispatcher imports no torch).
USER_ERRORS: tuple[type[Exception], ...] = (KvnotesError, ScenarioError)
#: Exit status of bad input; of an interrupted command (128 + SIGINT).
STATUS_ERROR, STATUS_INTERRUPTED = 2, 130
CONF = CONF_DIR


def fail(msg: str, status: int = STATUS_ERROR) -> NoReturn:
    """Print ``kvnotes: error: <msg>`` (on one line) to stderr and exit with ``status``.

    Raises:
        SystemExit: always, with ``status``.
    """
    print(f"kvnotes: error: {one_line(msg)}", file=sys.stderr)
    sys.exit(status)


def one_line(msg: object) -> str:
    """``msg`` as one line: its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(str(msg).split())


def guarded(main: Callable[[], object]) -> None:
    """Run ``main()`` inside the error boundary: a :data:`USER_ERRORS` exception becomes one
    ``kvnotes: error:`` line and exit status 2, Ctrl-C one line and exit status 130 (SIGTERM: 143),
    and argparse's own errors (a missing argument, an unknown flag) one line too, naming the command
    and its usage (:func:`argparse_error`). Other exceptions (bugs) propagate with their traceback.

    Raises:
        SystemExit: on a user error (2) or an interrupt (130), or as ``main`` exits.
    """
    import argparse

    from kvnotes.errors import stop_message, terminate_as_interrupt

    terminate_as_interrupt()                 # SIGTERM cleans up as Ctrl-C does (exit 143)
    plain = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = argparse_error      # type: ignore[method-assign]
    try:
        main()
    except USER_ERRORS as exc:
        fail(str(exc))
    except KeyboardInterrupt as exc:
        fail(*stop_message(exc))
    finally:
        argparse.ArgumentParser.error = plain          # type: ignore[method-assign]


def argparse_error(parser, message: str) -> NoReturn:
    """argparse's error, the project's way: ``kvnotes: error: <prog>: <message> (usage: ...)`` on one
    line and exit status 2, instead of argparse's usage block and ``<prog>: error:`` line (what
    :func:`guarded` puts in place of :meth:`argparse.ArgumentParser.error` for every subcommand).

    Raises:
        SystemExit: always, with status 2.
    """
    fail(f"{parser.prog}: {message} ({parser.format_usage().strip()}; {parser.prog} --help for more)")


# ----------------------------------------------------------------------- argparse value checks

def _int(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise KvnotesError(f"{flag}: expected an integer, got '{text}'") from None


def _float(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KvnotesError(f"{flag}: expected a number, got '{text}'") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise KvnotesError(f"{flag}: expected a finite number, got '{text}'")
    return value


def int_at_least(flag: str, least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= least`` (each element of an ``nargs`` list alike).

    Raises:
        KvnotesError: (from the returned function) not an integer, or below ``least``; the message
            names ``flag``.
    """
    def parse(text: str) -> int:
        value = _int(flag, text)
        if value < least:
            raise KvnotesError(f"{flag}: must be at least {least}, got {value}")
        return value
    parse.__name__ = "int"          # argparse names the type in --help and its own messages
    return parse


def float_at_least(flag: str, least: float, strict: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number ``>= least`` (``> least`` when ``strict``).

    Raises:
        KvnotesError: (from the returned function) not a finite number, or out of range; the message
            names ``flag``.
    """
    def parse(text: str) -> float:
        value = _float(flag, text)
        if value < least or (strict and value == least):
            raise KvnotesError(f"{flag}: must be {'greater than' if strict else 'at least'} {least:g}, got {value:g}")
        return value
    parse.__name__ = "float"
    return parse


def one_of(flag: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse ``type``: one of ``choices``.

    Raises:
        KvnotesError: (from the returned function) another value; the message lists the choices.
    """
    def parse(text: str) -> str:
        if text not in choices:
            raise KvnotesError(f"{flag}: unknown value '{text}' (known: {', '.join(choices)})")
        return text
    parse.__name__ = "str"
    return parse


#: ``--dtype`` values of the scripts (torch dtype names).
DTYPES = ("float32", "float16", "bfloat16", "float64")


def conf_names(group: str, dirs: Sequence[Path] = ()) -> list[str]:
    """The entries of ``conf/<group>`` (``model``, ``probe``, ``scenario``) and of ``<dir>/<group>``
    for a user's config folders ``dirs`` (``--config-dir``), ``_`` files excluded, sorted."""
    return sorted({p.stem for d in (CONF, *map(Path, dirs)) for p in (d / group).glob("*.yaml")
                   if not p.stem.startswith("_")})


def conf_name(group: str, flag: str | None = None, dirs: Sequence[Path] = ()) -> Callable[[str], str]:
    """An argparse ``type``: the name of a ``conf/<group>/<name>.yaml`` entry (kvnotes' own, or one in
    a user's config folders ``dirs``).

    Raises:
        KvnotesError: (from the returned function) no such entry; the message lists the known ones.
    """
    def parse(text: str) -> str:
        if text not in conf_names(group, dirs):
            where = f"{flag}: " if flag else ""
            raise KvnotesError(f"{where}unknown {group} '{text}' (known: {', '.join(conf_names(group, dirs))})")
        return text
    parse.__name__ = group
    return parse


def existing_path(flag: str, kind: str = "any") -> Callable[[str], str]:
    """An argparse ``type``: a path that exists (``kind``: ``"file"``, ``"dir"`` or ``"any"``).

    Raises:
        KvnotesError: (from the returned function) the path is missing or of the other kind.
    """
    def parse(text: str) -> str:
        p = Path(text)
        if not p.exists():
            what = {"any": "file or directory", "dir": "directory"}.get(kind, kind)
            raise KvnotesError(f"{flag}: {text}: no such {what}")
        if kind == "file" and not p.is_file():
            raise KvnotesError(f"{flag}: {text}: not a file")
        if kind == "dir" and not p.is_dir():
            raise KvnotesError(f"{flag}: {text}: not a directory")
        return text
    parse.__name__ = "path"
    return parse


def check_writable(path: str | Path, flag: str, directory: bool = False) -> None:
    """Check that ``path`` can be written, by trying: an existing file (or, with ``directory``,
    directory) that opens for writing (a file is opened for appending and closed unchanged; a
    directory takes a new file); or a new one whose nearest existing ancestor is a directory that
    takes a new entry. The trial entry is removed at once, so nothing is left behind. Trying, not
    ``os.access``, is what refuses a path root cannot write either (under ``/proc``, on a read-only
    file system) and a path under a regular file.

    Raises:
        KvnotesError: ``path`` exists and is of the other kind or cannot be written, or cannot be
            created (an ancestor is a file, or does not take new entries); the message names ``flag``.
    """
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise KvnotesError(f"{flag}: {path} exists and is not a directory")
        if not directory and p.is_dir():
            raise KvnotesError(f"{flag}: {path} is a directory")
        try:
            if directory:
                try_new_entry(p, directory=False)
            elif p.is_file():
                os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))     # changes nothing
            elif not os.access(p, os.W_OK):             # a device or a pipe (/dev/null): not opened here
                raise PermissionError(13, "Permission denied")
        except OSError as exc:
            raise KvnotesError(f"{flag}: cannot write {path}: {_why(exc)}") from None
        return
    base = existing_ancestor(p.parent)
    if not base.is_dir():
        raise KvnotesError(f"{flag}: cannot create {path}: {base} is not a directory")
    try:
        # the same kind of entry the command makes in ``base``: a directory when it creates folders
        try_new_entry(base, directory=directory or base != Path(os.path.abspath(p.parent)))
    except OSError as exc:
        raise KvnotesError(f"{flag}: cannot create {path}: {base} does not take new files ({_why(exc)})") from None


def _why(exc: OSError) -> str:
    """An ``OSError``'s reason in a few words (``permission denied``)."""
    return (exc.strerror or type(exc).__name__).lower()


def output_file(flag: str) -> Callable[[str], str]:
    """An argparse ``type``: a file to write (see :func:`check_writable`); checked before any work.

    Raises:
        KvnotesError: (from the returned function) the path cannot be written.
    """
    def parse(text: str) -> str:
        check_writable(text, flag)
        return text
    parse.__name__ = "path"
    return parse


#: ``--device`` values of the scripts (``auto``: CUDA when available).
DEVICES = ("cpu", "cuda", "auto")


def device_name(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``cpu``, ``cuda`` (only where CUDA is available) or ``auto``.

    Raises:
        KvnotesError: another name, or ``cuda`` on a machine without CUDA.
    """
    if text not in DEVICES:
        raise KvnotesError(f"--device: unknown device '{text}' (known: {', '.join(DEVICES)})")
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise KvnotesError("--device cuda: no CUDA device on this machine (torch.cuda.is_available() is False)")
    return text


device_name.__name__ = "device"
