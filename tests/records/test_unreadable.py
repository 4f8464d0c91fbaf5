"""No silent wrongs among records (issue #54): a reader that walks a tree names every
``record.json`` it cannot read, and reading nothing is an error, never an empty success.

``kvnotes report`` skips an unreadable record with one stderr line and lists it on the index;
``kvnotes table --results`` refuses one; the inspection notebook finds a relative ``KVNOTES_RUNS``
from where the command runs (``jupyter execute`` starts the kernel in ``notebooks/``) and stops on a
folder that is missing or holds no readable record. No model is loaded here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, one_line_error
from tests.cli.test_cli_errors import BLAST, ENVELOPE, SCREEN, tree, write_record
from tests.helpers import run_kvnotes

#: case -> (content of a record.json, the reason it is not read)
BAD = {
    "truncated": ('{"schema": "kvnotes.record", "status": "comp',
                  "not JSON (Unterminated string starting at line 1 column 40)"),
    "empty": ("", "not JSON (Expecting value at line 1 column 1)"),
    "list": ("[1, 2]", "a JSON list, not a record object"),
    "foreign": ('{"hello": "world"}', 'not a kvnotes record (no "schema": "kvnotes.record")'),
    "running": (json.dumps(ENVELOPE | {"status": "running"}), "not complete (status 'running': its job has not finished)"),
    "bad-key": (json.dumps(ENVELOPE | {"seed": "zero", "result": SCREEN}),
                "record.seed: Input should be a valid integer, unable to parse string as an integer"),
    "version": (json.dumps(ENVELOPE | {"schema_version": 7, "result": SCREEN}),
                "record.schema_version: Input should be 1 or 2"),
    "no-result": (json.dumps(ENVELOPE), "record.result: Field required"),
}


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def bad_record(path: Path, content: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "record.json").write_text(content)
    return path / "record.json"


@pytest.mark.parametrize("case", BAD)
def test_scan_names_why_a_record_is_not_read(case, tmp_path):
    from kvnotes.records.store import scan_records

    content, reason = BAD[case]
    good = write_record(tmp_path / "runs" / "good", SCREEN)
    bad = bad_record(tmp_path / "runs" / "bad", content)
    scan = scan_records([tmp_path / "runs"])
    assert [p for p, _ in scan.records] == [good]
    assert [(u.path, u.reason) for u in scan.skipped] == [(bad, reason)]
    assert scan.skipped[0].line() == f"kvnotes: skipped {bad}: {reason}"


def test_report_names_every_record_it_cannot_read(work, monkeypatch, capsys):
    """One good record and two unreadable ones: one page, one stderr line per skipped record with
    why, and a "Records not read" list on the index (and in report.json)."""
    write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    bad_record(work / "runs" / "a", '{"schema": "kvnotes.record", "sta')
    bad_record(work / "runs" / "b", '{"rows": []}')
    ran = run_kvnotes(monkeypatch, capsys, "report", "runs", "-o", "site")
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.splitlines() == [
        "kvnotes: skipped runs/a/record.json: not JSON (Unterminated string starting at line 1 column 30)",
        'kvnotes: skipped runs/b/record.json: not a kvnotes record (no "schema": "kvnotes.record")']
    assert "1 record pages" in ran.stdout and "2 record files not read" in ran.stdout
    manifest = json.loads((work / "site" / "report.json").read_text())
    assert len(manifest["pages"]) == 1
    assert [s["record"] for s in manifest["skipped"]] == ["runs/a/record.json", "runs/b/record.json"]
    index = (work / "site" / "index.html").read_text()
    assert "Records not read (2)" in index and "runs/a/record.json" in index and "not a kvnotes record" in index
    assert "1 records; 2 record files not read" in index


def test_report_without_a_readable_record_is_one_line(work, monkeypatch, capsys):
    """Record files, none readable: an error naming them, exit 2, no site (it used to say
    nothing of them)."""
    a = bad_record(work / "runs" / "a", "{")
    b = bad_record(work / "runs" / "b", json.dumps(ENVELOPE | {"status": "running"}))
    before = tree(work)
    ran = run_kvnotes(monkeypatch, capsys, "report", work / "runs", "-o", work / "site")
    one_line_error(ran, f"no complete record under {work / 'runs'}: 2 record files not read", f"{a}: not JSON",
                   f"{b}: not complete")
    assert len(ran.stderr.splitlines()) == 1 and ran.stdout == "" and tree(work) == before


def test_report_of_a_clean_tree_lists_nothing_as_not_read(work, monkeypatch, capsys):
    write_record(work / "runs" / "m" / "blast_radius" / "s", BLAST, probe="blast_radius")
    ran = run_kvnotes(monkeypatch, capsys, "report", "runs", "-o", "site")
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert "not read" not in (work / "site" / "index.html").read_text() and "not read" not in ran.stdout
    assert json.loads((work / "site" / "report.json").read_text())["skipped"] == []


def test_results_table_refuses_an_unreadable_record(work, monkeypatch, capsys):
    """``kvnotes table --results`` reads ``DIR/*/SUITE/record.json``: an unreadable one is an error
    naming it (the table would otherwise lose its columns without a word)."""
    write_record(work / "runs" / "m" / "screen" / "default", SCREEN)
    bad = bad_record(work / "runs" / "m" / "field_refresh" / "default", '{"schema": ')
    ran = run_kvnotes(monkeypatch, capsys, "table", "--results", work / "runs" / "m")
    one_line_error(ran, str(bad), "not JSON")
    assert ran.stdout == ""


# ------------------------------------------------------------------------- the notebook's loader

def test_runs_dir_resolves_a_relative_path_from_where_the_command_runs(tmp_path, monkeypatch):
    """``jupyter execute`` starts the kernel in the notebook's folder; the shell's ``$PWD`` names
    where the command ran, and a relative ``KVNOTES_RUNS`` is found there first."""
    from kvnotes.records.store import runs_dir

    (tmp_path / "runs").mkdir()
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.setenv("PWD", str(tmp_path))
    assert runs_dir("runs") == tmp_path / "runs"
    assert runs_dir(None) == tmp_path / "runs"
    assert runs_dir(str(tmp_path / "runs")) == tmp_path / "runs"
    monkeypatch.delenv("PWD")
    assert runs_dir("runs", also=[tmp_path]) == tmp_path / "runs"      # no $PWD: the notebook's checkout
    (tmp_path / "notebooks" / "runs").mkdir()
    assert runs_dir("runs", also=[tmp_path]) == tmp_path / "notebooks" / "runs"      # the process's own first


def test_runs_dir_that_is_nowhere_or_a_file_is_an_error(tmp_path, monkeypatch):
    from kvnotes.errors import KvnotesError
    from kvnotes.records.store import runs_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    with pytest.raises(KvnotesError, match=rf"^KVNOTES_RUNS=nowhere: no such directory \(looked for {tmp_path}/nowhere"):
        runs_dir("nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(KvnotesError, match="is not a directory"):
        runs_dir("file")


def test_load_runs_needs_a_readable_record_and_names_the_others(tmp_path, monkeypatch, capsys):
    from kvnotes.errors import KvnotesError
    from kvnotes.records.store import load_runs

    (tmp_path / "empty").mkdir()
    with pytest.raises(KvnotesError, match=f"^no complete record under {tmp_path / 'empty'}$"):
        load_runs(tmp_path / "empty")
    bad = bad_record(tmp_path / "runs" / "bad", "[]")
    with pytest.raises(KvnotesError, match="1 record file not read .*a JSON list"):
        load_runs(tmp_path / "runs")
    write_record(tmp_path / "runs" / "good", SCREEN | {"rows": [{"pair": "p", "family": "recall", "flips": True}]})
    runs = load_runs(tmp_path / "runs")
    assert capsys.readouterr().err == f"kvnotes: skipped {bad}: a JSON list, not a record object\n"
    assert len(runs.records) == 1 and runs.summary() == f"1 record under {tmp_path / 'runs'}; 1 record file not read"
    frame = runs.frame()
    assert list(frame["probe"]) == ["screen"] and list(frame["record"]) == [str(tmp_path / "runs" / "good" / "record.json")]


def _execute_notebook(cwd: Path, kernel_dir: Path, runs: str, monkeypatch):
    """Execute the inspection notebook as ``cd CWD && KVNOTES_RUNS=RUNS jupyter execute
    notebooks/inspect_records.ipynb`` does: the kernel in ``kernel_dir``, ``$PWD`` the shell's."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "inspect_records.ipynb", as_version=4)
    monkeypatch.setenv("KVNOTES_RUNS", runs)
    monkeypatch.setenv("PWD", str(cwd))
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(kernel_dir)}})
    client.execute()
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_notebook_finds_relative_runs_from_where_it_is_run(tmp_path, monkeypatch):
    """The documented ``KVNOTES_RUNS=runs jupyter execute notebooks/inspect_records.ipynb``: the
    kernel runs in ``notebooks/``, the records are found under the shell's ``runs`` (it printed
    "0 rows from 0 records" and succeeded), and an unreadable record is named."""
    write_record(tmp_path / "runs" / "m" / "screen" / "s", SCREEN | {"rows": [{"pair": "p", "family": "recall",
                                                                                "flips": True}]})
    bad = bad_record(tmp_path / "runs" / "bad", "{")
    text = _execute_notebook(tmp_path, ROOT / "notebooks", "runs", monkeypatch)
    assert f"1 record under {tmp_path / 'runs'}; 1 record file not read" in text
    assert f"kvnotes: skipped {bad}: not JSON" in text
    assert "1 rows from 1 records" in text and "1 figures" in text


@pytest.mark.parametrize("folder", ["empty", "nowhere"])
def test_notebook_stops_on_a_folder_without_records(folder, tmp_path, monkeypatch):
    """A missing folder, or one without a readable record, fails the notebook with one clear line
    instead of printing 0 rows and succeeding."""
    from nbclient.exceptions import CellExecutionError

    (tmp_path / "empty").mkdir()
    with pytest.raises(CellExecutionError) as failed:
        _execute_notebook(tmp_path, ROOT / "notebooks", folder, monkeypatch)
    says = {"empty": f"no complete record under {tmp_path / 'empty'}",
            "nowhere": f"KVNOTES_RUNS=nowhere: no such directory (looked for {tmp_path / 'nowhere'}, "}
    assert failed.value.ename == "KvnotesError" and failed.value.evalue.startswith(says[folder])
    assert "\n" not in failed.value.evalue
