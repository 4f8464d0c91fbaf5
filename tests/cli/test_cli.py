"""The command line as users meet it: one-line errors with exit 2, records, sweeps, skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import HANG_S, ROOT

import pytest
import yaml

from tests.harness.test_tokens import BASE



def run(*args, env=None, timeout=HANG_S):
    e = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def run_main(monkeypatch, capsys, *args) -> subprocess.CompletedProcess:
    """``run.py``'s own ``main`` in this process (for bad input caught before any model loads: a
    subprocess would spend seconds importing torch), as a ``CompletedProcess`` like :func:`run`."""
    from kvnotes.cli import run as cli

    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("kvnotes: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def test_misspelt_model(tmp_path, monkeypatch, capsys):
    one_line_error(run_main(monkeypatch, capsys, "model=qwen3-9b", f"out_root={tmp_path}"), "unknown model 'qwen3-9b'",
                   "qwen3-8b")
    assert not any(tmp_path.iterdir())


def test_unknown_probe(tmp_path, monkeypatch, capsys):
    one_line_error(run_main(monkeypatch, capsys, "probe=blastradius", f"out_root={tmp_path}"),
                   "unknown probe 'blastradius'")


def test_offline_hub_model_names_model_and_remedy(tmp_path):
    proc = run("model=qwen3-0.6b", f"out_root={tmp_path}", env={"HF_HOME": str(tmp_path / "hf")})
    one_line_error(proc, "qwen3-0.6b", "Qwen/Qwen3-0.6B", "hf download")
    assert not (tmp_path / "qwen3-0.6b").exists()


@pytest.mark.embedded
def test_field_missing_from_template(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "context": "Profile of {name}."}))
    one_line_error(run(f"scenario.paths=[{bad}]", f"out_root={tmp_path / 'runs'}"), str(bad), "key 'context'")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("record.json"))


def test_cot_variant_refused_by_probes_that_do_not_generate(tmp_path, monkeypatch, capsys):
    proc = run_main(monkeypatch, capsys, "probe=blast_radius", "scenario.variant=cot", f"out_root={tmp_path}")
    one_line_error(proc, "blast_radius", "scenario.variant=cot",
                   "probes that do: agent, compose, edit, field_refresh, injection, read_location, suffix_recovery")
    assert not any(tmp_path.iterdir())


def test_a_bad_transcript_length_is_one_line(tmp_path, monkeypatch, capsys):
    proc = run_main(monkeypatch, capsys, "probe=screen", "scenario.transcript={turns: -1}", f"out_root={tmp_path}")
    one_line_error(proc, "scenario.transcript.turns")
    assert not any(tmp_path.iterdir())


def test_sweep_writes_one_record_per_job(sweep):
    out, _ = sweep
    records = sorted(out.rglob("record.json"))
    assert [r.relative_to(out).parts[:2] for r in records] == [("smollm2-135m", "blast_radius"), ("smollm2-135m", "screen")]
    for r in records:
        rec = json.loads(r.read_text())
        assert rec["schema"] == "kvnotes.record" and rec["status"] == "complete"
        assert rec["model"]["file_sha256"] and rec["model"]["dtype"] == "float32"
        assert rec["model"]["attn_implementation"] == "sdpa"
        assert rec["config"]["scenario"]["n_instances"] == 3 and rec["hydra"]["overrides"]
        assert rec["packages"]["torch"] and "commit" in rec["git"] and rec["timing"]["total"] > 0
        assert rec["scenario"]["n_pairs_aligned"] == 3
        rows = rec["result"]["rows"]
        assert len(rows) == 3 and all(row["scenario"] == "favourite_fruit" for row in rows)
        figs = list(r.parent.glob(f"{rec['probe']}-*.png"))       # one per figure spec of the probe
        assert figs and all(f.stat().st_size > 10_000 for f in figs)


def test_blast_radius_record_contents(sweep):
    out, _ = sweep
    rec = json.loads(next(out.rglob("blast_radius/**/record.json")).read_text())
    res = rec["result"]
    row = res["rows"][0]
    assert row["prefix_max_dev"] < 1e-5
    assert len(row["k_rel_share"]) == len(res["thresholds"]) and len(row["k_rel_layer_profile"]) == 30
    agg = res["aggregates"]["all"]["k_rel_p95"]["all"]
    assert agg["n"] == 3 and agg["n_scenarios"] == 1 and agg["ci_mean"][0] <= agg["mean"] <= agg["ci_mean"][1]
    ex = next(iter(res["examples"].values()))
    assert len(ex["maps"]["k_rel"]) == 30 and len(ex["tokens"]) == ex["decision"] + 1


def test_rerun_skips_complete_record_unless_forced(sweep):
    out, _ = sweep
    rec_path = next(out.rglob("screen/**/record.json"))
    before = rec_path.stat().st_mtime_ns
    new = Path(json.loads(rec_path.read_text())["config"]["scenario"]["paths"][0])
    proc = run("probe=screen", f"scenario.paths=[{new}]", "scenario.n_instances=3", f"out_root={out}")
    assert proc.returncode == 0 and "skipping" in proc.stdout
    assert rec_path.stat().st_mtime_ns == before


def test_notebook_executes_on_sweep_records(sweep):
    """The inspection notebook runs top to bottom on real records (so it cannot rot)."""
    import nbformat
    from nbclient import NotebookClient

    out, _ = sweep
    nb = nbformat.read(ROOT / "notebooks" / "inspect_records.ipynb", as_version=4)
    os.environ["KVNOTES_RUNS"] = str(out)
    try:
        NotebookClient(nb, timeout=HANG_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.pop("KVNOTES_RUNS")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    from kvnotes.records.presentation import presentation

    records = [json.loads(p.read_text()) for p in Path(out).rglob("record.json")]
    drawn = sum(len(spec.data(rec)) for rec in records for spec in presentation(rec).figures)   # one per figure spec
    assert "6 rows from 2 records" in text and f"{drawn} figures" in text and drawn >= len(records)


def test_recurrent_architecture_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    """A checkpoint whose layers keep a recurrent state (Qwen3-Next: linear attention) is refused in
    one line naming the layer type, before any weights are read (the directory holds only a config)."""
    import transformers as T

    ckpt = tmp_path / "qwen3-next"
    T.Qwen3NextConfig(num_hidden_layers=4).save_pretrained(ckpt)
    one_line_error(run_main(monkeypatch, capsys, "model=qwen3-8b", f"model.path={ckpt}", "model.architecture=null",
                            f"out_root={tmp_path / 'runs'}"),
                   "qwen3_next", "'linear_attention' layers (3 of 4 layers)")
    # under the entry's own architecture, the checkpoint's model_type is refused first: a record named
    # Qwen3-8B would hold another model
    one_line_error(run_main(monkeypatch, capsys, "model=qwen3-8b", f"model.path={ckpt}", f"out_root={tmp_path / 'runs'}"),
                   "holds a qwen3_next checkpoint, but model=qwen3-8b is qwen3")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("record.json"))


def test_results_table_joins_the_columns_records_declare(sweep):
    """``kvnotes table --results``: a row per family and ``all``, with the columns every record's
    presentation declares (the screen's flipping / aligned pairs, from its aggregates); a record
    whose presentation declares none (blast_radius) adds none, and none at all is refused."""
    from kvnotes.records.tables import results_table, suite_records

    out, _ = sweep
    screen = next(out.rglob("screen/**/record.json"))
    model_dir = screen.parents[3]
    suite = str(screen.parent.relative_to(model_dir / "screen"))              # default/<the sweep's overrides>
    recs = suite_records(model_dir, suite)
    assert list(recs) == ["screen"] and (model_dir / "blast_radius" / suite / "record.json").is_file()
    lines = results_table(recs).splitlines()
    assert lines[0] == "| family | flipping / aligned pairs |"
    agg = recs["screen"]["result"]["aggregates"]
    rows = {cells[1].strip(): cells[2].strip() for cells in (line.split("|") for line in lines[2:] if line.startswith("| "))}
    assert rows == {**{f: f"{t['n_flip']}/{t['n_pairs']}" for f, t in agg["by_family"].items()},
                    "all": f"{agg['n_flip']}/{agg['n_pairs']}"}
    with pytest.raises(ValueError, match="no record"):
        results_table({"blast_radius": json.loads((model_dir / "blast_radius" / suite / "record.json").read_text())})


def test_quoted_override_values_round_trip():
    """``kvnotes.cli.run.quoted``: any path a command passes on (``scenario.paths``, ``scenario.locomo``)
    reaches the config as the same string, whatever quotes, commas or backslashes it holds."""
    from hypothesis import given, settings, strategies as st
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvnotes.cli.run import quoted

    parser = OverridesParser.create()

    @settings(max_examples=200, deadline=None)
    @given(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30))
    def round_trip(value):
        assert parser.parse_overrides([f"key={quoted(value)}"])[0].value() == value

    round_trip()
    for value in ("/a/b c.json", "it's,=x", "C:\\runs\\", "a\\'b", "[x]"):
        assert parser.parse_overrides([f"key={quoted(value)}"])[0].value() == value


def test_a_users_suite_names_its_record_folder(tmp_path):
    """A suite given by its files (``scenario.paths``, as ``kvnotes ownership-scan`` and a user's own
    suite do) names the record folder's suite part after them, readably (no quotes, brackets or
    cut-off path), with a hash that keeps two folders of one name apart, for a command composing its
    jobs in-process (:func:`kvnotes.cli.run.compose_jobs`) as for ``run.py`` (the same function names
    Hydra's folder: ``conf/config.yaml``)."""
    from kvnotes.cli.run import compose_jobs, quoted, suite_dir

    mine, other = tmp_path / "my suite,v2", tmp_path / "elsewhere" / "my suite,v2"
    name = suite_dir("default", [f"scenario.paths=[{quoted(str(mine))}]", "probe.n_boot=10"])
    assert name.startswith("my_suite_v2~") and len(name) == len("my_suite_v2~") + 8
    assert suite_dir("default", [f"scenario.paths=[{quoted(str(other))}]"]) != name
    assert suite_dir("default", ["probe.n_boot=10"]) == "default"
    assert suite_dir("locomo", ["scenario.locomo=/data/locomo10.json"]).startswith("locomo10~")
    suite = tmp_path / "recall_copy"
    suite.mkdir()
    for f in (ROOT / "scenarios" / "suites" / "recall").glob("*.yaml"):
        (suite / f.name).write_text(f.read_text())
    (job,) = compose_jobs([["probe=screen", f"scenario.paths=[{quoted(str(suite))}]", "scenario.n_instances=2",
                            f"out_root={tmp_path / 'runs'}"]])
    assert job.out_dir.relative_to(tmp_path / "runs").parts[2].startswith("recall_copy~")
    assert job.out_dir.name == "scenario.n_instances=2"                       # the paths are not repeated there
