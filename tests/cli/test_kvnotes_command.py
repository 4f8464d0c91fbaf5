"""The ``kvnotes`` command and the record envelope: subcommands, one-line errors, tables from
records, the published JSON Schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvnotes.errors import KvnotesError
from kvnotes.records.envelope import check_record, json_schema
from kvnotes.records.store import find_records, load_record
from kvnotes.records.presentation import presentation
from kvnotes.probes.screen import screen_table
from kvnotes.records.tables import record_table
from tests.helpers import HANG_S, ROOT, run_kvnotes



def kvnotes(*args):
    return subprocess.run([sys.executable, "-c", "from kvnotes.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)


def test_help_lists_every_subcommand():
    proc = kvnotes("--help")
    assert proc.returncode == 0
    for cmd in ("run", "table", "plot", "report", "bench", "battery", "serve-bench", "ownership-scan", "locomo"):
        assert f"\n  {cmd} " in proc.stdout, cmd
    assert "probes, circuits, edit, compose" in proc.stdout


@pytest.mark.parametrize("args,needle", [(["nope"], "unknown command 'nope'"),
                                         (["bench", "nope"], "unknown benchmark 'nope'")])
def test_unknown_subcommand_is_one_line(args, needle):
    proc = kvnotes(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"kvnotes: error: {needle}")


def test_subcommand_help_passes_through():
    proc = kvnotes("table", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: kvnotes table")


def test_record_schema_file_is_current():
    """``docs/record.schema.json`` is what ``python -m kvnotes.records.envelope`` writes."""
    published = json.loads((ROOT / "docs" / "record.schema.json").read_text())
    assert published == json.loads(json.dumps(json_schema()))
    assert {"schema", "schema_version", "status", "probe", "model", "host"} <= set(published["required"])


def test_envelope_rejects_a_broken_record():
    good = {"schema": "kvnotes.record", "schema_version": 2, "status": "complete", "probe": "screen",
            "created": "2026-11-24T06:00:00+0000", "config": {}, "hydra": {}, "model": {"name": "m", "source": "random"},
            "seed": 0, "packages": {"torch": "2.13.0"}, "git": {}, "host": {"platform": "x", "torch_threads": 2,
                                                                               "cuda": None}}
    check_record(good)
    with pytest.raises(KvnotesError, match=r"^record\.seed: "):
        check_record(good | {"seed": "zero"})
    with pytest.raises(KvnotesError, match=r"^record\.model\.name: Field required"):
        check_record(good | {"model": {"source": "random"}})


@pytest.mark.embedded
def test_sweep_records_and_tables(sweep, tmp_path):
    """Records written by ``run.py`` pass the envelope; ``kvnotes table`` prints each record's
    registered table, the same text the library returns."""
    out, _ = sweep
    paths = find_records(out)
    assert len(paths) == 2
    for path in paths:
        check_record(load_record(path))
    screen = next(p for p in paths if "/screen/" in str(p))
    proc = kvnotes("table", str(screen), "--by", "scenario")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == screen_table(load_record(screen), "scenario")
    blast = next(p for p in paths if "/blast_radius/" in str(p))
    proc = kvnotes("table", str(blast))
    assert proc.returncode == 0 and proc.stdout == record_table(load_record(blast))
    assert presentation(load_record(blast)).table is None                  # no table of its own: every summary
    assert presentation(load_record(screen)).table is screen_table
    proc = kvnotes("table", str(tmp_path / "missing.json"))
    assert proc.returncode != 0 and proc.stderr.startswith("kvnotes: error: cannot read record")


def test_serving_table_renders_every_run():
    """The serving table (a ``serve_bench`` record; no vLLM here) names every run, its ratio and
    shares, with one missing marker for absent numbers."""
    share = {"k": 3, "n": 4, "p": 0.75, "ci": [0.3, 0.95]}
    run = {"arm": "erratum", "position": "early", "rate": 1.0, "n_sent": 4, "n_not_sent": 0, "hit_rate": 0.5,
           "hit_rate_updates": 0.77, "engine_hit_rate": None, "ttft_updates_p50_s": 0.1, "ttft_updates_p90_s": 0.2,
           "throughput_rps": 1.5, "n_owned": 4, "correct_owned": share, "agreement": share, "reset_ok": True,
           "first_request_cached_tokens": 0}
    rec = {"probe": "serving", "presentation": "kvnotes.serving", "model": {"name": "m"}, "packages": {"vllm": "0.32.0"},
           "scenario": {"n_scenarios": 2, "families": ["recall"]},
           "config": {"sessions": 2, "turns": 3, "doc_tokens": 600},
           "result": {"engine": {"block_size": 16}, "runs": [run, run | {"arm": "in_place", "position": "late"}],
                      "aggregates": {"p90_ttft_ratio_vs_in_place": {"erratum": {"early": {"1.0": 2.5}}}},
                      "cross_check": {"rows": [1], "max_abs_diff_candidates": 1e-5, "max_abs_diff_vocab": 2e-5,
                                      "tolerance_nats": 1e-3, "all_top1_equal": True},
                      "rows": [{"sent": True, "max_abs_diff_candidates": 3e-5}]}}
    text = record_table(rec)
    lines = [ln for ln in text.splitlines() if ln.startswith("| 1 |")]
    assert len(lines) == 2 and "| early | erratum |" in lines[0] and "| 2.50 |" in lines[0]
    assert "0.75 [0.30, 0.95] (n=4)" in lines[0] and "| n/a |" in lines[0]
    assert "cold start: every run reset the prefix cache and its first request had 0 cached tokens: True" in text


def test_records_of_the_old_top_level_probes_keep_their_presentation():
    """A record written when probes were the top-level ``probes``/``circuits`` packages names
    ``probes.screen.run``: it finds the module at its place in ``kvnotes`` and keeps its table."""
    from kvnotes.records.presentation import source_module

    old = {"config": {"probe": {"_target_": "probes.screen.run"}}}
    assert source_module(old) == "kvnotes.probes.screen"
    assert source_module({"config": {"probe": {"_target_": "circuits.heads.run"}}}) == "kvnotes.circuits.heads"
    assert source_module({"config": {"probe": {"_target_": "mypackage.probe.run"}}}) == "mypackage.probe"
    assert presentation(old).table is screen_table


@pytest.mark.embedded
def test_ownership_scan_is_a_view_of_a_screen_record(tmp_path, monkeypatch, capsys):
    """``kvnotes ownership-scan`` runs ``probe=screen`` on its files through the job path and prints
    the record's per-scenario ownership; its counts are the record's rows; a second scan reuses the
    record."""
    from kvnotes.records.ownership import ownership

    suite = ROOT / "scenarios" / "suites" / "recall" / "home_city.yaml"
    args = ["ownership-scan", str(suite), "--n-instances", "1", "--json", str(tmp_path / "scan.json")]
    monkeypatch.chdir(tmp_path)
    ran = run_kvnotes(monkeypatch, capsys, *args)
    assert ran.returncode == 0, ran.stderr
    out = ran.stdout
    (path,) = (tmp_path / "runs" / "smollm2-135m" / "screen").rglob("record.json")
    assert path.relative_to(tmp_path / "runs").parts[2].startswith("home_city~")    # the suite part names the file
    rec = load_record(path)
    rows = rec["result"]["rows"]
    counts = ownership(rec)
    expected = [r for r in rows if r["expect_flip"]]
    assert set(counts) == {"home_city"} and counts["home_city"]["expected"] == len(expected) > 0
    assert counts["home_city"]["owned"] == sum(bool(r["flips_owned"]) for r in expected)
    assert counts["home_city"]["flip"] == sum(bool(r["flips_relative"]) for r in expected)
    assert (f"recall     home_city              owned {counts['home_city']['owned']:2d}/{len(expected):2d}" in out
            and "FAMILY recall: owned" in out), out
    assert json.loads((tmp_path / "scan.json").read_text())["scenarios"] == counts
    assert f"{path.relative_to(tmp_path)} is complete; skipping" in run_kvnotes(monkeypatch, capsys, *args).stdout


@pytest.mark.parametrize("env, want", [("1", 1), ("3", 3), ("0", None), ("two", None), ("", None)])
def test_threads_default_honours_omp_num_threads(monkeypatch, env, want):
    """``OMP_NUM_THREADS=1 kvnotes bench edit`` runs on one thread (the flag's default used to be every
    CPU, overriding the variable the docs' commands set); unset or not a positive whole number: every CPU."""
    import os

    from kvnotes.cli import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert default_threads() == (want or len(os.sched_getaffinity(0)))
