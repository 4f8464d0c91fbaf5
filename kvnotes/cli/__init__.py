"""The ``kvnotes`` command: one entry point, one subcommand per job.

    kvnotes run [hydra overrides]        compose a config and run a probe (same as python run.py)
    kvnotes table RECORD...              a record's table (by its probe), or --results DIR --suite S
    kvnotes plot RECORD... [-o DIR]      a record's figures
    kvnotes report RUNS -o SITE          the offline HTML report of a records tree
    kvnotes bench NAME [flags]           a micro-benchmark: probes, circuits, edit, compose, compose-plot, compose-gpu, generate, linear, auto
    kvnotes battery [flags]              every probe in one process, with the roofline floor (--floor)
    kvnotes serve-bench [flags]          the vLLM prefix-caching experiment (serving environment)
    kvnotes ownership-scan PATH...       which scenario values the model owns
    kvnotes locomo --data FILE [flags]   LoCoMo QA: transplanted session memory against a full prefill

Each subcommand's ``--help`` gives its flags. Shared flags mean the same everywhere: ``--device``
(``cpu``, ``cuda``, ``auto``), ``--threads`` (torch CPU threads; default ``OMP_NUM_THREADS`` when set,
else every CPU this process may use), ``--json PATH`` (also write the numbers), ``--model`` (a ``conf/model`` name).

Every subcommand runs inside one error boundary (:func:`kvnotes.cli.errors.guarded`): bad input is
one ``kvnotes: error: <message>`` line on stderr and exit status 2 (argparse's own errors also exit
2), Ctrl-C one line and exit status 130.
"""

from __future__ import annotations

import importlib
import os
import sys

#: subcommand -> (module with ``main()``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("kvnotes.cli.run", "compose a config with Hydra and run a probe (python run.py)"),
    "table": ("kvnotes.cli.table", "a record's table, by its probe; --results DIR for a model's results table"),
    "plot": ("kvnotes.cli.plot", "draw a record's figures"),
    "report": ("kvnotes.records.report", "the offline HTML report of a records tree"),
    "battery": ("kvnotes.cli.battery", "every probe in one process; --floor for the roofline floor"),
    "serve-bench": ("kvnotes.cli.serve_bench", "the vLLM prefix-caching experiment (bash scripts/install.sh --serving)"),
    "ownership-scan": ("kvnotes.cli.ownership_scan", "which scenario values the model owns"),
    "locomo": ("kvnotes.cli.locomo", "LoCoMo QA: transplanted session memory against a full prefill (--data FILE)"),
}
#: ``kvnotes bench NAME`` -> module with ``main()``
BENCHES: dict[str, str] = {
    "probes": "kvnotes.bench.probes",
    "circuits": "kvnotes.bench.circuits",
    "edit": "kvnotes.bench.edit",
    "compose": "kvnotes.bench.compose",
    "compose-plot": "kvnotes.bench.compose_plot",
    "compose-gpu": "kvnotes.bench.compose_gpu",
    "generate": "kvnotes.bench.generate",
    "linear": "kvnotes.bench.linear",
    "auto": "kvnotes.bench.auto",
}


def usage() -> str:
    lines = ["usage: kvnotes <command> [args]   (kvnotes <command> --help for its flags)", "", "commands:"]
    for name, (_, text) in COMMANDS.items():
        lines.append(f"  {name:<15} {text}")
    lines.append(f"  {'bench':<15} a micro-benchmark: {', '.join(BENCHES)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``kvnotes <command> [args]`` to the command's ``main()`` with ``sys.argv`` set to its
    own arguments (so each command parses its flags as when run as a module), inside the error
    boundary (:func:`kvnotes.cli.errors.guarded`).

    Raises:
        SystemExit: 0 after ``--help``; 2 for an unknown command or benchmark, any user error of the
            command (:data:`kvnotes.cli.errors.USER_ERRORS`) or a bad flag; 130 on Ctrl-C; else as the
            command exits.
    """
    from kvnotes.cli.errors import guarded

    guarded(lambda: _dispatch(sys.argv[1:] if argv is None else list(argv)))


def _dispatch(argv: list[str]) -> None:
    """Find the command's module and run its ``main()`` (see :func:`main`).

    Raises:
        KvnotesError: an unknown command or benchmark.
    """
    from kvnotes.errors import KvnotesError

    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            print(f"usage: kvnotes bench NAME [flags]\n\nbenchmarks: {', '.join(BENCHES)}")
            sys.exit(0 if rest else 2)
        if rest[0] not in BENCHES:
            raise KvnotesError(f"unknown benchmark '{rest[0]}' (known: {', '.join(BENCHES)})")
        target, prog, rest = BENCHES[rest[0]], f"kvnotes bench {rest[0]}", rest[1:]
    elif cmd in COMMANDS:
        target, prog = COMMANDS[cmd][0], f"kvnotes {cmd}"
    else:
        raise KvnotesError(f"unknown command '{cmd}' (known: {', '.join([*COMMANDS, 'bench'])})")
    sys.argv = [prog, *rest]
    importlib.import_module(target).main()


def default_threads() -> int:
    """``--threads``' default: ``OMP_NUM_THREADS`` when it is a positive whole number (so
    ``OMP_NUM_THREADS=1 kvnotes bench edit`` runs on one thread), else every CPU this process may use
    (``os.sched_getaffinity``)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))


def add_machine_flags(ap, device: str = "cpu") -> None:
    """The flags every benchmark shares: ``--device``, ``--threads`` (default: :func:`default_threads`)
    and ``--json PATH``, each checked as it is parsed (:mod:`kvnotes.cli.errors`: an unknown device,
    ``cuda`` without CUDA, fewer than one thread, a ``--json`` path that cannot be written
    are one ``kvnotes: error:`` line before any work)."""
    from kvnotes.cli.errors import device_name, int_at_least, output_file

    ap.add_argument("--device", default=device, type=device_name, help=f"cpu, cuda or auto (default {device})")
    ap.add_argument("--threads", type=int_at_least("--threads", 1), default=default_threads(),
                    help="torch CPU threads (default: OMP_NUM_THREADS when set, else every CPU this process may use)")
    ap.add_argument("--json", default=None, type=output_file("--json"), help="also write the numbers to this file")
