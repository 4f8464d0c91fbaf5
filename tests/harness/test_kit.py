"""The probe kit: registry and typed config (a misspelt key is an error), declared result schemas,
exclusion rows, and the worked example of docs/adding_a_probe.md run verbatim on the embedded model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import kvnotes.probes
from kvnotes.harness import kit as K
from kvnotes.errors import KvnotesError
from kvnotes.records.schema import BaseResult, SchemaError, check_result, result_schema
from tests.helpers import recall_pairs

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_probe.md"


def test_every_probe_is_found_from_its_config_and_declares_config_and_result():
    assert {"field_refresh", "suffix_recovery", "heads", "dissociation"} <= set(kvnotes.probes.names())
    for name in kvnotes.probes.names():
        cfg = kvnotes.probes.load_config(name)
        mod = kvnotes.probes.module(cfg)
        assert cfg.name == name and mod.run is kvnotes.probes.get(name)
        assert hasattr(mod, "Config") and result_schema(mod) is not BaseResult, name
        assert cfg.progress is True and cfg.n_boot == 2000                     # shared base defaults
    assert kvnotes.probes.load_config("dissociation").pairs == "polarity"


def test_misspelt_or_mistyped_key_is_one_clear_error():
    with pytest.raises(KvnotesError, match=r"probe 'heads': Key 'n_bot' not in 'Config'"):
        kvnotes.probes.load_config("heads", {"n_bot": 10})
    with pytest.raises(KvnotesError, match="chunk_heads"):
        kvnotes.probes.load_config("heads", {"chunk_heads": "many"})
    with pytest.raises(KvnotesError, match="unknown probe 'nope'"):
        kvnotes.probes.load_config("nope")


def test_schema_check_finds_missing_keys_and_wrong_types():
    row = {"pair": "p", "scenario": "s", "family": "f", "instance": "i", "s_old": -1.0, "s_new": 2,
           "effect": 3.0, "flips": True, "reason": None}
    good = {"rows": [row], "aggregates": {}, "exclusions": {"small_effect": 1},
            "excluded": [{"pair": "q", "scenario": "s", "family": "f", "reason": "small_effect"}]}
    check_result(good, BaseResult)
    with pytest.raises(SchemaError, match=r"result.rows\[0\].flips"):
        check_result(good | {"rows": [row | {"flips": "yes"}]}, BaseResult)
    with pytest.raises(SchemaError, match=r"result.rows\[5\].s_old"):       # every row, not the first few
        check_result(good | {"rows": [row] * 5 + [row | {"s_old": None}]}, BaseResult)
    with pytest.raises(SchemaError, match=r"result.rows\[0\].effect"):      # a bool is not a number
        check_result(good | {"rows": [row | {"effect": True}]}, BaseResult)
    with pytest.raises(SchemaError, match="missing key 'excluded'"):
        check_result({k: v for k, v in good.items() if k != "excluded"}, BaseResult)


def test_excluded_rows_and_worst():
    rows = [{"pair": "a", "scenario": "s", "family": "f", "instance": "i", "reason": None, "flips": True, "x": 0.5},
            {"pair": "b", "scenario": "s", "family": "f", "instance": "i", "reason": "small_effect", "flips": False,
             "x": -2.0}]
    tok = [{"pair": "c", "scenario": "s", "family": "f", "instance": "j", "reason": "unequal_field_length"}]
    ex = K.excluded_rows(tok, rows)
    assert [r["pair"] for r in ex] == ["c", "b"] and set(ex[1]) == set(K.EXCLUSION_COLUMNS)
    assert K.exclusion_counts(ex) == {"unequal_field_length": 1, "small_effect": 1}
    assert K.worst(rows, "x", 1.0) == 3.0 and K.worst([], "x") is None


def _doc_blocks() -> tuple[str, str, str]:
    """The module, config and specification page of docs/adding_a_probe.md (its first python, yaml
    and markdown blocks)."""
    text = DOC.read_text()
    return tuple(re.search(rf"```{kind}\n(.*?)```", text, re.S).group(1)  # type: ignore[return-value]
                 for kind in ("python", "yaml", "markdown"))


@pytest.mark.embedded          # no model, but a copy of the repository and a pytest run in it (~15 s)
def test_the_documented_probe_is_its_module_config_and_page(tmp_path):
    """The three files of docs/adding_a_probe.md, placed where the page says (``probes/``,
    ``conf/probe/``, ``docs/probes/``) in a copy of this repository, make a probe the layout tests
    accept (its page linked and in the nav, no harness module of its own, imports in their layers),
    that the planted lane accounts for (its module says why it is not scored) and that the registry
    finds, with nothing else changed (issue #51)."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "repo"
    for folder in ("kvnotes", "probes", "circuits", "scenarios", "conf", "docs"):
        shutil.copytree(root / folder, copy / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.png", "assets"))
    (copy / "mkdocs.yml").write_text((root / "mkdocs.yml").read_text())
    shutil.copytree(root / "tests", copy / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    code, yaml, page = _doc_blocks()
    (copy / "probes" / "field_only.py").write_text(code)
    (copy / "conf" / "probe" / "field_only.yaml").write_text(yaml)
    (copy / "docs" / "probes" / "field_only.md").write_text(page)
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTEST_XDIST_WORKER_COUNT"}
    env["PYTHONPATH"] = str(copy)
    found = subprocess.run([sys.executable, "-c", "import kvnotes.probes as P; print(P.module(P.load_config('field_only')).__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True)
    assert found.returncode == 0 and found.stdout.strip().startswith(str(copy)), found.stderr
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-c", "/dev/null",
                          "--rootdir", str(copy), "tests/lanes/test_layout.py",
                          "tests/lanes/test_planted.py::test_the_lane_names_every_probe"], cwd=copy, env=env,
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout and "failed" not in ran.stdout


def test_worked_example_runs_as_documented(smol, tmp_path, monkeypatch):
    """The module and config of docs/adding_a_probe.md, written out verbatim (the module under
    another importable name), are found from the config alone, reject a misspelt key, run on the
    embedded model and return a result matching their own schema, whose presentation (headline,
    table, the figure specs drawn as PNGs) is found from a record."""
    code, yaml, _ = _doc_blocks()
    (tmp_path / "doc_field_only.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = OmegaConf.create(yaml.replace("kvnotes.probes.field_only.run", "doc_field_only.run"))
    raw = OmegaConf.merge(raw, {"progress": False, "n_boot": 200})
    with pytest.raises(KvnotesError, match="cot_max_new_token"):
        kvnotes.probes.typed_config(OmegaConf.merge(raw, {"cot_max_new_token": 20}))
    cfg = kvnotes.probes.typed_config(raw)                 # the Config's defaults, as run.py composes them
    ctx = kvnotes.probes.ProbeContext(bundle=smol, pairs=recall_pairs(smol, ["favourite_colour"], n_instances=1, per_instance=2), cfg=cfg)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    check_result(res, result_schema(kvnotes.probes.module(ctx.cfg)))
    assert res["aggregates"]["readout"] == "direct"
    assert res["rows"] and all(math.isfinite(r["r_field"]) for r in res["rows"])
    assert res["aggregates"]["recovery"]["all"]["n"] == len(res["rows"])
    assert len(res["rows"]) + len(res["excluded"]) == len(ctx.pairs.pairs) + len(ctx.pairs.excluded)
    # its presentation is found from a record through the module the record names
    from kvnotes.records.presentation import presentation
    from kvnotes.records.report import headline
    from kvnotes.records.tables import aggregates_table, record_table
    rec = {"probe": "field_only", "config": {"probe": {"_target_": "doc_field_only.run"}, "flip_rule": "owned"},
           "result": res}
    assert [f.id for f in presentation(rec).figures] == ["family-recovery", "family-flipped"]
    assert headline(rec)[0] == "recovery/all" and record_table(rec) == aggregates_table(rec)
    from kvnotes.plots import plot_record                  # both renderers read the specs: the PNGs here
    from kvnotes.records.store import to_jsonable
    pngs = plot_record(json.loads(json.dumps(to_jsonable(rec | {"model": {"name": "smollm2-135m"},
                                                                "scenario": {"name": "t"}}))), tmp_path)
    assert len(pngs) == 2 and all(p.stat().st_size > 10_000 for p in pngs)
    # the same module under the generated readout: a parameter of the run, no second code path
    cot = kvnotes.probes.ProbeContext(bundle=smol, pairs=recall_pairs(smol, ["favourite_colour"], n_instances=1, variant="cot"),
                              cfg=OmegaConf.merge(cfg, {"cot_max_pairs": 2}),
                              scenario_cfg=OmegaConf.create({"variant": "cot"}))
    res = kvnotes.probes.get(cot.cfg)(cot)
    check_result(res, result_schema(kvnotes.probes.module(cot.cfg)))
    assert res["aggregates"]["readout"] == "generated"
    assert set(res["exclusions"]) <= {"old_no_marker", "new_no_marker", "no_cot_flip", "beyond_max_pairs"}
    assert len(res["rows"]) + sum(res["exclusions"].values()) == len(cot.pairs.pairs)
    assert all(r["reached_field"] is not None and r["chain_len_field"] >= 0 for r in res["rows"])


def _without_timing(res: dict) -> dict:
    """A probe result as JSON text, for an exact comparison of two runs."""
    import json

    from kvnotes.records.store import to_jsonable
    return json.loads(json.dumps(to_jsonable(res), sort_keys=True, default=str))


def test_clean_runs_shared_across_probes_give_the_same_results(smol):
    """The battery's shared clean-run store (each pair prefilled once per job) changes no number:
    probes that take their caches from the store return exactly what they return alone, and a
    store over its byte budget keeps scores only and prefills the caches again. Pairs sharing a
    prompt (an instance's value in two pairs) share one prefill."""
    pairs = recall_pairs(smol, ["favourite_colour"], n_instances=1, per_instance=2)
    overrides = {"progress": False, "n_boot": 200}
    cfgs = {"injection": kvnotes.probes.load_config("injection", overrides),
            "field_refresh": kvnotes.probes.load_config("field_refresh", overrides),
            "heads": kvnotes.probes.load_config("heads", overrides | {"modes": ["read"], "ks": [1, 4],
                                                             "random": {"n_draws": 2}})}
    alone = {n: _without_timing(kvnotes.probes.get(c)(kvnotes.probes.ProbeContext(bundle=smol, pairs=pairs, cfg=c)))
             for n, c in cfgs.items()}
    for budget in (8 << 30, 1):                       # everything kept / nothing but scores kept
        store = K.CleanRuns(budget)
        for n, c in cfgs.items():
            res = kvnotes.probes.get(c)(kvnotes.probes.ProbeContext(bundle=smol, pairs=pairs, cfg=c, clean_runs=store))
            assert _without_timing(res) == alone[n], (n, budget)
        prompts = {tuple(x.ids[:p.decision].tolist()) for p in pairs.pairs for x in (p.old, p.new)}
        assert store.reused == 2 * len(pairs.pairs)                      # 3 probes: 1 prefill, 2 reuses
        assert store.prefilled + store.shared == 2 * len(pairs.pairs)
        assert store.prefilled == (len(prompts) if budget > 1 else 2 * len(pairs.pairs))
        assert (store.used_bytes > 0) == (budget > 1)


def test_per_prompt_runs_once_per_distinct_prompt():
    import torch

    calls = []
    f = K.per_prompt(lambda ids: calls.append(ids.tolist()) or int(ids.sum()), size=2)
    a, b, c = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), torch.tensor([9])
    assert [f(a), f(b), f(a.clone()), f(b)] == [6, 7, 6, 7] and calls == [[1, 2, 3], [1, 2, 4]]
    f(c)                                                 # size 2: c evicts the least recent, a
    assert len(calls) == 3 and f(b) == 7 and len(calls) == 3
    assert f(a) == 6 and len(calls) == 4
