"""One error boundary for every entry point (issue #35, item 4): bad input to any ``kvnotes``
subcommand is one ``kvnotes: error:`` line on stderr with exit status 2 (Ctrl-C: exit 130), never a
traceback, and nothing is written: no table, no figure, no half-built report site.

The commands run in-process (``kvnotes.cli.main`` with ``sys.argv`` set), so no test here starts a
Python or loads a model; one test runs the command as a user does, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, one_line_error
from tests.helpers import run_kvnotes

SUITE = str(ROOT / "scenarios" / "suites" / "recall")

#: A valid record envelope (kvnotes.records.envelope.Record) without its result.
ENVELOPE = {"schema": "kvnotes.record", "schema_version": 2, "status": "complete", "probe": "screen",
            "created": "2026-11-24T06:00:00+0000", "config": {"flip_rule": "relative"}, "hydra": {},
            "model": {"name": "m", "source": "random"}, "seed": 0, "packages": {"torch": "2.13.0"},
            "git": {"commit": "abc", "dirty": False}, "host": {"platform": "x", "torch_threads": 1, "cuda": None},
            "scenario": {"name": "s", "n_scenarios": 1, "families": ["recall"]}}
SUMMARY = {"n": 3, "n_scenarios": 1, "mean": 0.5, "median": 0.5, "ci_mean": [0.1, 0.9],
           "ci_method": "t_over_instance_means"}
#: Results a table, the figures and a report page can be made from.
BLAST = {"rows": [], "aggregates": {"all": {"k_rel_p95": {"all": SUMMARY}}}, "exclusions": {}, "excluded": [],
         "examples": {}}
SCREEN = {"rows": [], "exclusions": {}, "excluded": [],
          "aggregates": {"by_family": {"recall": {"n_pairs": 3, "n_flip": 1, "excluded": {}}}}}


def write_record(path: Path, result: dict | None = None, **changes) -> Path:
    """A ``record.json`` at ``path`` (a directory) with the envelope, ``changes`` and ``result`` (none: no key);
    its config names the probe's module, as a run's does (which its presentation is read from)."""
    rec = ENVELOPE | changes | ({"result": result} if result is not None else {})
    rec["config"] = {"probe": {"_target_": f"kvnotes.probes.{rec['probe']}.run"}} | rec["config"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "record.json").write_text(json.dumps(rec))
    return path / "record.json"


def tree(root: Path) -> dict[str, int]:
    """Every path under ``root`` (hidden ones included) with its size (directories: -1)."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in sorted(root.rglob("*"))}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty working directory (the commands' relative defaults land here)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------------ readers

def test_report_into_an_existing_file_is_one_line(work, monkeypatch, capsys):
    write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    (work / "existing").write_text("keep me")
    before = tree(work)
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", work / "existing")
    one_line_error(ran, str(work / "existing"), "not a directory")
    assert tree(work) == before and (work / "existing").read_text() == "keep me"


@pytest.mark.parametrize("command", ["report", "table", "plot"])
def test_record_without_result_is_one_line_naming_file_and_key(command, work, monkeypatch, capsys):
    """Valid JSON, a valid envelope, no ``result``: one line naming the file and the key; the report
    writes no site at all (it used to copy ``records/`` and stop before ``index.html``)."""
    path = write_record(work / "runs" / "m" / "screen" / "s")
    before = tree(work)
    args = {"report": [work / "runs", "-o", work / "site"], "table": [path], "plot": [path, "-o", work / "figs"]}
    ran = run_kvnotes(monkeypatch, capsys, command, *args[command])
    one_line_error(ran, str(path), "record.result")
    assert ran.stdout == "" and tree(work) == before


@pytest.mark.parametrize("command", ["table", "plot"])
@pytest.mark.parametrize("content,needle", [(None, "No such file"), ("garbage", "not JSON"), ("[1, 2]", "not an object"),
                                            (json.dumps(ENVELOPE | {"seed": "zero"}), "record.seed")])
def test_unreadable_or_invalid_record_is_one_line(command, content, needle, work, monkeypatch, capsys):
    """A missing, non-JSON or non-object file, or a broken envelope: one line naming the file and
    what is wrong, exit status 2 (``table`` and ``plot`` used to exit 1)."""
    path = work / "record.json"
    if content is not None:
        path.write_text(content)
    before = tree(work)
    ran = run_kvnotes(monkeypatch, capsys, command, path)
    one_line_error(ran, str(path), needle)
    assert ran.stdout == "" and tree(work) == before


@pytest.mark.parametrize("command", ["report", "table", "plot"])
def test_result_lacking_what_the_reader_needs_is_one_line(command, work, monkeypatch, capsys):
    """A record whose result lacks a key its table, figure or page reads: one line naming the file
    and the key; a good record given with it gets nothing either (all or nothing)."""
    if command == "plot":
        good = write_record(work / "elsewhere", SCREEN)
    else:
        good = write_record(work / "runs" / "m" / "blast_radius" / "good", BLAST, probe="blast_radius")
    bad = write_record(work / "runs" / "m" / "screen" / "bad", {"rows": []})
    before = tree(work)
    args = {"report": [work / "runs", "-o", work / "site"], "table": [good, bad], "plot": [good, bad]}
    ran = run_kvnotes(monkeypatch, capsys, command, *args[command])
    one_line_error(ran, str(bad), "'aggregates'")
    assert ran.stdout == "" and tree(work) == before


def test_readers_still_work(work, monkeypatch, capsys):
    """The good records of the tests above do make a table, a figure and a report."""
    blast = write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    screen = write_record(work / "figs-of" / "screen", SCREEN)
    ran = run_kvnotes(monkeypatch, capsys, "table", blast)
    assert ran.returncode == 0 and "all/k_rel_p95/all" in ran.stdout, ran.stderr
    ran = run_kvnotes(monkeypatch, capsys, "plot", screen, "-o", work / "figs")
    assert ran.returncode == 0 and ran.stdout.strip() == str(work / "figs" / "screen-screen-families.png"), ran.stderr
    assert (work / "figs" / "screen-screen-families.png").stat().st_size > 1000
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", work / "a" / "b" / "site")
    assert ran.returncode == 0, ran.stderr
    assert sorted(p.name for p in (work / "a" / "b" / "site").iterdir()) == [
        "assets", "index.html", "r000-m-blast_radius-s.html", "records", "report.json"]
    assert [p.name for p in (work / "a" / "b").iterdir()] == ["site"]        # no temporary directory left


def test_failed_report_leaves_the_previous_site_as_it_was(work, monkeypatch, capsys):
    """A report into a directory that holds other files keeps them; a later report that fails
    changes nothing there."""
    write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    site = work / "site"
    site.mkdir()
    (site / "notes.txt").write_text("mine")
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", site)
    assert ran.returncode == 0 and (site / "index.html").is_file() and (site / "notes.txt").read_text() == "mine"
    before = tree(work)
    bad = write_record(work / "runs" / "m" / "screen" / "bad", {"rows": []})
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", site)
    one_line_error(ran, str(bad))
    assert {k: v for k, v in tree(work).items() if not k.startswith("runs")} == \
        {k: v for k, v in before.items() if not k.startswith("runs")}


def test_report_where_no_one_can_write_is_one_line(work, monkeypatch, capsys):
    """``-o`` under ``/proc`` (root passes ``os.access`` there): one line, nothing written."""
    write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    before = tree(work)
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", "/proc/kvnotes-site")
    one_line_error(ran, "cannot write the report to /proc/kvnotes-site")
    assert ran.stdout == "" and tree(work) == before


def test_report_on_a_missing_root_is_one_line(work, monkeypatch, capsys):
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "nowhere", "-o", work / "site")
    one_line_error(ran, str(work / "nowhere"), "no such file or directory")
    assert tree(work) == {}


# ------------------------------------------------------------------------------------ scripts

#: (arguments, what the line names); ``{bad}`` is a garbage file, ``{missing}`` a path that does not
#: exist, ``{tmp}`` the working directory. Each fails before a model loads or a header prints.
SCRIPT_CASES = [
    (["bench", "edit", "--lengths", "-5", "--trials", "0"], ["--lengths", "-5"]),
    (["bench", "edit", "--trials", "0"], ["--trials", "at least 1"]),
    (["bench", "edit", "--rankings", "best"], ["--rankings", "'best'"]),
    (["bench", "edit", "--threads", "0"], ["--threads"]),
    (["bench", "edit", "--device", "tpu"], ["--device", "'tpu'"]),
    (["bench", "edit", "--json", "{tmp}"], ["--json", "is a directory"]),
    (["ownership-scan", "{bad}"], ["{bad}", "mapping"]),
    (["ownership-scan", "{missing}"], ["{missing}", "not found"]),
    (["ownership-scan", SUITE, "--model", "nope"], ["unknown model 'nope'", "smollm2-135m"]),
    (["ownership-scan", SUITE, "--n-instances", "-1"], ["--n-instances", "-1"]),
    (["ownership-scan", SUITE, "--variant", "sideways"], ["--variant", "'sideways'"]),
    (["battery", "--probes", "nonexistent"], ["unknown probe 'nonexistent'", "screen"]),
    (["battery", "--model", "nope"], ["unknown model 'nope'"]),
    (["battery", "--records", "{bad}"], ["--records", "not a directory"]),
    (["battery", "--compare", "{missing}", "--records", "{tmp}/new"], ["--compare", "{missing}"]),
    # output paths no one can write, root included (issue #54): refused before the model loads
    (["battery", "--json", "/proc/kvnotes-battery.json"], ["--json", "/proc does not take new files"]),
    (["battery", "--json", "{bad}/battery.json"], ["--json", "{bad} is not a directory"]),
    (["battery", "--json", "{tmp}"], ["--json", "is a directory"]),
    (["battery", "--records", "{bad}/runs"], ["--records", "{bad} is not a directory"]),
    (["battery", "--records", "/proc/kvnotes-runs"], ["--records", "/proc does not take new files"]),
    (["ownership-scan", SUITE, "--json", "/proc/kvnotes-scan.json"], ["--json", "/proc"]),
    (["locomo", "--data", "{bad}", "--json", "{bad}/out.json"], ["--json", "not a directory"]),
    (["serve-bench", "--out-root", "{bad}/runs"], ["--out-root", "{bad} is not a directory"]),
    (["serve-bench", "--out-root", "/proc/kvnotes-serving"], ["--out-root", "/proc does not take new files"]),
    (["serve-bench", "--store", "{bad}"], ["--store", "exists and is not a directory"]),
    (["bench", "compose-plot", "{bad}", "--out", "/proc/ttft.png"], ["--out", "/proc does not take new files"]),
    (["bench", "edit", "--json", "/proc/kvnotes-edit.json"], ["--json", "/proc"]),
    (["bench", "probes", "--n-pairs", "0"], ["--n-pairs"]),
    (["bench", "probes", "--random-init", "nope"], ["--random-init", "'nope'"]),
    (["bench", "probes", "--turns", "-1"], ["--turns"]),
    (["bench", "probes", "--turns", "6", "--random-init", "smollm2-135m"], ["--turns", "--prompt-len"]),
    (["bench", "circuits", "--chunk", "0"], ["--chunk"]),
    (["bench", "compose", "--lengths", "50"], ["--lengths", "50"]),
    (["bench", "compose", "--image", "--grids", "16x16"], ["--grids", "16x16"]),
    (["bench", "compose-plot", "{bad}", "--out", "{tmp}/ttft.png"], ["{bad}", "not JSON"]),
    (["bench", "compose-gpu", "--trials", "0"], ["--trials"]),
    (["bench", "generate", "--dtype", "int8"], ["--dtype", "'int8'"]),
    (["bench", "linear", "--rows", "0"], ["--rows"]),
    (["bench", "auto", "--checks", "selective"], ["--checks", "'selective'"]),
    (["bench", "auto", "--from-json", "{bad}"], ["--from-json", "{bad}"]),
    (["locomo", "--data", "{bad}", "--max-questions", "0"], ["--max-questions"]),
    (["serve-bench", "--sessions", "0"], ["--sessions"]),
]


@pytest.mark.parametrize("args,needles", SCRIPT_CASES, ids=[" ".join(a) for a, _ in SCRIPT_CASES])
def test_script_rejects_bad_arguments_in_one_line(args, needles, work, monkeypatch, capsys):
    (work / "bad.json").write_text("garbage\n")
    fill = {"{bad}": str(work / "bad.json"), "{missing}": str(work / "missing"), "{tmp}": str(work)}

    def sub(s: str) -> str:
        for k, v in fill.items():
            s = s.replace(k, v)
        return s

    before = tree(work)
    ran = run_kvnotes(monkeypatch, capsys, *map(sub, args))
    one_line_error(ran, *map(sub, needles))
    assert ran.stdout == "" and tree(work) == before


def test_every_script_runs_its_main_inside_the_boundary():
    """Run alone (``python -m kvnotes.bench.X``), every command and reader uses the same boundary."""
    mains = [p for p in [*sorted((ROOT / "kvnotes/bench").glob("*.py")), *sorted((ROOT / "kvnotes/cli").glob("*.py"))]
             if 'if __name__ == "__main__":' in p.read_text() and p.name != "run.py"]
    assert len(mains) >= 14
    unguarded = [p.name for p in mains if "guarded(main)" not in p.read_text().split('if __name__ == "__main__":')[1]]
    assert not unguarded, unguarded


def test_output_paths_are_checked_before_any_work(tmp_path):
    """``--json``, ``--records``, ``-o``: an existing file may be overwritten and a new path's
    directories created; a path of the other kind, or under a file, is refused."""
    from kvnotes.cli.errors import check_writable
    from kvnotes.errors import KvnotesError

    (tmp_path / "old.json").write_text("{}")
    check_writable(tmp_path / "old.json", "--json")
    check_writable(tmp_path / "new" / "deeper" / "out.json", "--json")
    check_writable(tmp_path, "-o", directory=True)
    check_writable(tmp_path / "new-site", "-o", directory=True)
    with pytest.raises(KvnotesError, match="^--json: .* is a directory$"):
        check_writable(tmp_path, "--json")
    with pytest.raises(KvnotesError, match="^-o: .*old.json exists and is not a directory$"):
        check_writable(tmp_path / "old.json", "-o", directory=True)
    with pytest.raises(KvnotesError, match="^--records: cannot create .*old.json is not a directory$"):
        check_writable(tmp_path / "old.json" / "runs", "--records", directory=True)
    with pytest.raises(KvnotesError, match="^--json: cannot create .*old.json is not a directory$"):
        check_writable(tmp_path / "old.json" / "deeper" / "out.json", "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]          # the trial entries are gone


@pytest.mark.parametrize("path,directory", [("/proc/kvnotes-out.json", False), ("/proc/kvnotes/deeper/out.json", False),
                                            ("/proc/kvnotes-runs", True)])
def test_output_paths_are_tried_not_guessed(path, directory):
    """``os.access`` says yes to root for ``/proc`` (mode 555): the check creates a trial entry
    instead, which no one can there (it used to accept the path and the command failed at its end)."""
    from kvnotes.cli.errors import check_writable
    from kvnotes.errors import KvnotesError

    with pytest.raises(KvnotesError, match="^-o: cannot create /proc/.*: /proc does not take new files"):
        check_writable(path, "-o", directory=directory)


def test_battery_says_what_it_does_before_the_model_loads(work, monkeypatch, capsys):
    """``kvnotes battery`` prints a line before loading the model and as each probe starts (it used
    to print nothing for minutes). The model load, pairs and probe are stand-ins here."""
    import types

    import torch

    import kvnotes.harness.jobs
    import kvnotes.harness.pairs
    from kvnotes.errors import KvnotesError

    loaded = []
    model = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]), device=torch.device("cpu"))

    def load_bundle(cfg):
        loaded.append(capsys.readouterr().out)                  # what was printed before the load
        return types.SimpleNamespace(model=model, tokenizer=None)

    def run_job(*args, **kwargs):
        raise KvnotesError("stopped by the test")

    monkeypatch.setattr(kvnotes.harness.jobs, "load_bundle", load_bundle)
    monkeypatch.setattr(kvnotes.harness.jobs, "run_job", run_job)
    monkeypatch.setattr(kvnotes.harness.pairs, "prepare_for_probe", lambda *a: types.SimpleNamespace(pairs=[]))
    ran = run_kvnotes(monkeypatch, capsys, "battery", "--probes", "screen", "--scenario", "small", "--threads", "1")
    one_line_error(ran, "stopped by the test")
    assert loaded == ["battery: loading smollm2-135m ...\n"]
    assert ran.stdout.splitlines()[-1] == f"  {'screen':16s} running (probe 1 of 1) ..."


# ------------------------------------------------------------------------------- the boundary

def test_interrupt_is_one_line_with_status_130(work, monkeypatch, capsys):
    import kvnotes.cli.table

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(kvnotes.cli.table, "main", interrupted)
    try:
        ran = run_kvnotes(monkeypatch, capsys, "table", "x")
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the error boundary")
    assert ran.returncode == 130 and ran.stderr.strip() == "kvnotes: error: interrupted", ran.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only user errors become one line: anything else (a bug) propagates."""
    import kvnotes.cli.table

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(kvnotes.cli.table, "main", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        run_kvnotes(monkeypatch, capsys, "table", "x")


def test_multiline_message_becomes_one_line(monkeypatch, capsys):
    import kvnotes.cli.table
    from kvnotes.errors import KvnotesError

    def bad():
        raise KvnotesError("first\n  second")

    monkeypatch.setattr(kvnotes.cli.table, "main", bad)
    ran = run_kvnotes(monkeypatch, capsys, "table", "x")
    assert ran.returncode == 2 and ran.stderr == "kvnotes: error: first second\n"


def test_flag_errors_keep_argparse_status_2(monkeypatch, capsys):
    ran = run_kvnotes(monkeypatch, capsys, "table")
    assert ran.returncode == 2 and "give record paths" in ran.stderr
    ran = run_kvnotes(monkeypatch, capsys, "bench", "edit", "--no-such-flag")
    assert ran.returncode == 2 and "--no-such-flag" in ran.stderr


def test_user_errors_are_the_run_commands():
    """The dispatcher's user errors are exactly ``run.py``'s."""
    from kvnotes.cli.errors import USER_ERRORS
    from kvnotes.harness.runconfig import USER_ERRORS as RUN_USER_ERRORS

    assert set(USER_ERRORS) == set(RUN_USER_ERRORS)


def test_console_command_in_a_subprocess(tmp_path):
    """As a user meets it (issue #35's first example): no table header, one line, exit 2."""
    proc = subprocess.run([sys.executable, "-c", "from kvnotes.cli import main; main()", "bench", "edit",
                           "--lengths", "-5", "--trials", "0"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    one_line_error(proc, "--lengths")
    assert proc.stdout == "" and not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, needles", [
    (["table"], ("kvnotes table: give record paths or --results DIR", "usage: kvnotes table")),
    (["table", "--nosuch", "x"], ("unrecognized arguments: --nosuch",)),
    (["bench", "auto", "--margins", "abc"], ("kvnotes bench auto: argument --margins: invalid float value: 'abc'",)),
    (["ownership-scan"], ("kvnotes ownership-scan:", "usage:")),
])
def test_argparse_errors_are_one_line_too(args, needles, work, monkeypatch, capsys):
    """argparse's own errors (a missing argument, an unknown flag, a value of the wrong type) are one
    ``kvnotes: error:`` line with the command's usage folded in, exit 2, like every other bad input."""
    ran = run_kvnotes(monkeypatch, capsys, *args)
    assert ran.returncode == 2, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvnotes: error: "), ran.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert ran.stdout == "" and not any(work.iterdir())
