"""Runs you can trust: the typed run config, one-line errors before any model loads, a record's
identity, interrupted and concurrent jobs, and the model placement keys (device map, quantization)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvnotes.errors import KvnotesError
from tests.cli.test_cli import ROOT, one_line_error, run, run_main
from tests.helpers import HANG_S, fruit_scenario


# ------------------------------------------------------------------ bad input: one line, before loading

@pytest.mark.parametrize("override, needles", [
    ("min_effect=abc", ("min_effect", "valid number", "'abc'")),
    ("flip_rule=sideways", ("flip_rule", "'sideways'")),
    ("readout=last", ("readout", "'last'")),
    ("budget_mb=-5", ("budget_mb", "greater than 0")),
    ("out_root=/proc/nope", ("out_root=/proc/nope", "not writable")),
    ("out_root=", ("out_root is empty",)),
    ("out_root=/", ("out_root=/", "file system's root")),
    ("out_root=/etc/hostname/runs", ("out_root=/etc/hostname/runs", "under a file")),
    ("+min_efect=2", ("unknown key 'min_efect'", "no part of kvnotes reads it", "did you mean min_effect?")),
    ("min_efect=2", ("unknown key 'min_efect'", "did you mean min_effect?")),
    ("+foo=bar", ("unknown key 'foo'",)),
    ("+model.xyz=1", ("unknown key 'model.xyz'",)),
    ("+scenario.n_instance=3", ("unknown key 'scenario.n_instance'", "did you mean scenario.n_instances?")),
    ("scenario.n_instances=12345678901234567890", ("scenario.n_instances=12345678901234567890", "GiB available",
                                                   "lower scenario.n_instances")),
    ("scenario.paths=[]", ("scenario.paths is empty", "field_refresh")),
    ("scenario.families=[recall,polcy_gate]", ("scenario.families names polcy_gate", "policy_gate")),
    ("--nosuch", ("unknown flag --nosuch",)),
    ("--config-name=nosuch", ("--config-name nosuch", "primary config 'config'")),
    ("--config-path=/no/such/dir", ("--config-path /no/such/dir: no such directory",)),
    ("scenario.transcript.turns=-1", ("scenario.transcript is null in this config", "scenario.transcript={turns:")),
    ("~probe", ("~probe: deleting a config group is not supported",)),
    ("hydra.nosuch=1", ("hydra.nosuch",)),
    ("hydra/launcher=nosuch", ("hydra/launcher/nosuch",)),
    ("hydra.run.dir=/proc/x", ("hydra.run.dir=/proc/x", "not writable")),
    ("+model.random_init.sed=1", ("unknown key 'model.random_init.sed'", "did you mean model.random_init.seed?")),
    ("probe.exactt=false", ("unknown key 'probe.exactt'",)),
    ("scenario.paths=[/no/such/dir]", ("scenario path not found", "/no/such/dir")),
    ("model.device_map=everywhere", ("model.device_map 'everywhere'", "balanced")),
    ("model.quantization=nf4", ("quantization=nf4", "CUDA")),
    ("model.quantization=int3", ("model.quantization", "'int3'")),
    ("model.dtype=float8", ("model.dtype", "'float8'")),
    ("flip_rule=synthetic", ("flip_rule=synthetic", "random-weight")),
    ("device=tpu", ("device 'tpu'",)),
])
def test_bad_input_is_one_line_before_the_model_loads(override, needles, tmp_path, monkeypatch, capsys):
    """``run.py``'s own ``main`` in this process (a subprocess per case would cost seconds each; the
    subprocess path is covered below): exit status 2, one ``kvnotes: error:`` line, nothing written
    (no out_root folder either). A key nobody reads (``+min_efect``) is refused with the nearest known key."""
    from kvnotes.cli import run as cli

    out = tmp_path / "runs" if "out_root" not in override else None
    args = ["probe=field_refresh", override] + ([f"out_root={out}"] if out else [])
    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    err = capsys.readouterr().err
    one_line_error(subprocess.CompletedProcess(args, stop.value.code, "", err), *needles)
    assert not out or not out.exists()                      # not even an empty out_root is left


def test_cache_folder_that_is_a_file_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    one_line_error(run_main(monkeypatch, capsys, f"out_root={tmp_path / 'runs'}"), "cache folder", "is a file",
                   "KVNOTES_CACHE")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(tmp_path, monkeypatch, capsys):
    one_line_error(run_main(monkeypatch, capsys, "device=cuda", f"out_root={tmp_path}"), "device=cuda", "no CUDA device")


def test_hydra_flags_with_a_value_are_not_overrides(tmp_path):
    """``--cfg job``, ``-cn config``, ``--info defaults``: the flag's value is Hydra's, not an override."""
    from kvnotes.cli import run as cli

    assert cli.overrides_of(["--cfg", "job", "-cn", "config", "seed=1", "-m", "--info=defaults"]) == ["seed=1"]
    cli.precheck(["--cfg", "job", "seed=1", f"out_root={tmp_path / 'runs'}"])


def test_bad_point_of_a_sweep_fails_the_sweep_up_front(tmp_path, monkeypatch, capsys):
    proc = run_main(monkeypatch, capsys, "-m", "min_effect=0.5,abc", f"out_root={tmp_path}")
    one_line_error(proc, "min_effect", "'abc'")
    assert not any(tmp_path.iterdir())
    one_line_error(run_main(monkeypatch, capsys, "-m", "seed=range(0,3,0)", f"out_root={tmp_path}"),
                   "seed=range(0,3,0): not a sweep Hydra can expand")
    one_line_error(run_main(monkeypatch, capsys, "-m", "hydra.sweep.dir=/proc/x", "seed=0,1", f"out_root={tmp_path}"),
                   "hydra.sweep.dir=/proc/x", "not writable")
    assert not any(tmp_path.iterdir())


def test_largest_zoo_model_offline_is_the_offline_error_and_shards(tmp_path):
    """llama-3.1-70b shards by default (device_map auto) and, without its weights, ends with the
    one-line offline error (the weights are never touched, so no memory error)."""
    from kvnotes.models.zoo import zoo_config

    assert zoo_config("llama-3.1-70b").device_map == "auto"
    proc = run("model=llama-3.1-70b", "device=cpu", f"out_root={tmp_path}", env={"HF_HOME": str(tmp_path / "hf")})
    one_line_error(proc, "llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", "hf download")


def test_architecture_without_adapter_is_one_line(tmp_path, monkeypatch, capsys):
    import transformers as T

    cfg = T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    T.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    proc = run_main(monkeypatch, capsys, f"model.path={tmp_path / 'gpt2'}", "model=qwen3-0.6b", "model.architecture=null",
                    f"out_root={tmp_path / 'runs'}")
    one_line_error(proc, "no architecture adapter", "gpt2")


# ------------------------------------------------------------------ the typed config and the identity

def test_typed_config_accepts_the_shipped_configs():
    from hydra import compose, initialize_config_dir

    import kvnotes.probes
    from kvnotes.harness.runconfig import check_run_config
    from kvnotes.models.zoo import zoo_names

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for model in zoo_names():
            check_run_config(compose("config", overrides=[f"model={model}", "device=cpu", "out_root=/tmp/kvnotes-x"]))
        for probe in kvnotes.probes.names():
            check_run_config(compose("config", overrides=[f"probe={probe}", "out_root=/tmp/kvnotes-x"]))


def test_identity_ignores_only_non_result_keys():
    from kvnotes.harness.runconfig import identity, identity_diff

    a = {"plot": True, "force": False, "out_root": "a", "min_effect": 1.0,
         "probe": {"progress": True, "ks": [1, 2]}, "scenario": {"n_instances": 2}}
    b = {"plot": False, "force": True, "out_root": "b", "min_effect": 1.0,
         "probe": {"progress": False, "ks": [1, 2]}, "scenario": {"n_instances": 2}}
    assert identity_diff(identity(a), identity(b)) == []
    c = json.loads(json.dumps(b)) | {"min_effect": 0.5}
    c["probe"]["ks"] = [1]
    c["scenario"]["n_instances"] = 4
    assert identity_diff(identity(a), identity(c)) == ["min_effect", "probe.ks", "scenario.n_instances"]


# ------------------------------------------------------------------ placement: device maps

def test_explicit_device_map_naming_unknown_module_is_refused():
    import transformers as T

    from kvnotes.models.placement import check_device_map

    cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=64)
    with torch.device("meta"):
        skeleton = T.AutoModelForCausalLM.from_config(cfg)
    check_device_map(skeleton, {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                                "model.norm": "cpu", "lm_head": "cpu"})
    with pytest.raises(KvnotesError, match="model.layers.7"):
        check_device_map(skeleton, {"model.layers.7": "cpu", "lm_head": "cpu"})


def test_placement_kwargs_refuse_bad_devices_and_quantization_on_cpu():
    from omegaconf import OmegaConf

    from kvnotes.models.placement import placement_kwargs

    cpu = torch.device("cpu")
    base = {"name": "x", "device_map": None, "max_memory": None, "offload_folder": None, "quantization": None}
    assert placement_kwargs(OmegaConf.create(base), cpu, torch.float32) == {}
    kw = placement_kwargs(OmegaConf.create(base | {"device_map": "auto", "max_memory": {0: "70GiB", "cpu": "100GiB"}}),
                          cpu, torch.float32)
    assert kw["device_map"] == "auto" and kw["max_memory"] == {0: "70GiB", "cpu": "100GiB"} and kw["offload_folder"]
    with pytest.raises(KvnotesError, match="unknown device"):
        placement_kwargs(OmegaConf.create(base | {"device_map": {"model.layers.0": "gpu7"}}), cpu, torch.float32)
    with pytest.raises(KvnotesError, match="CUDA only"):
        placement_kwargs(OmegaConf.create(base | {"quantization": "int8"}), cpu, torch.float32)


#: The tokenizer random-weight models render prompts with: the embedded SmolLM2 entry, or a directory
#: of its tokenizer files on a machine without the embedded package (a GPU node;
#: ``model.random_init.tokenizer`` takes either).
TOKENIZER = os.environ.get("KVNOTES_TEST_TOKENIZER", "smollm2-135m")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random Qwen3 checkpoint (no tied embeddings) saved with the SmolLM2 tokenizer (:data:`TOKENIZER`)."""
    from kvnotes.models.loading import random_init_tokenizer
    from kvnotes.models.zoo import Shrink, random_model, zoo_config

    tok = random_init_tokenizer(TOKENIZER)
    model = random_model(zoo_config("qwen3-8b"), Shrink(vocab_size=len(tok)))
    path = tmp_path_factory.mktemp("ckpt") / "qwen3-tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


OFFLOAD_MAP = "{model.embed_tokens:cpu,model.layers.0:cpu,model.layers.1:disk,model.layers.2:cpu,model.layers.3:disk,model.norm:cpu,model.rotary_emb:cpu,lm_head:cpu}"


def _rows(out: Path) -> tuple[dict, list[dict]]:
    rec = json.loads(next(out.rglob("record.json")).read_text())
    return rec, rec["result"]["rows"]


def _job(overrides: list[str], out: Path) -> dict:
    """``run.py``'s job path in this process (:func:`kvnotes.harness.jobs.run_job`): compose, check, load, run."""
    from hydra import compose, initialize_config_dir

    from kvnotes.harness.jobs import run_job
    from kvnotes.harness.runconfig import check_run_config

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides + [f"out_root={out}"])
    check_run_config(cfg)
    return json.loads(run_job(cfg, out, {}, log=lambda _: None).read_text())


@pytest.mark.embedded
def test_offloaded_device_map_gives_the_single_device_records(tiny_checkpoint, tmp_path):
    """Loaded with an accelerate device map that offloads half the layers to disk, a model writes the
    same records as the single-device load (fp32 tolerance), and the record names the device map:
    a checkpoint through ``from_pretrained`` (screen: every pair's scores and top-1) and a
    random-weight model through ``dispatch_model`` (field_refresh: the cache surgery)."""
    small = ["scenario=small", "scenario.ids=[favourite_colour]", "scenario.families=null", "scenario.n_instances=2",
             "plot=false", "probe.progress=false", "probe.n_boot=50", "device=cpu"]
    jobs = {"ckpt": ["model=qwen3-8b", f"model.path={tiny_checkpoint}", "probe=screen", "flip_rule=relative"],
            "random": ["model=qwen3-8b", "model.random_init.enabled=true", "probe=field_refresh",
                       "flip_rule=synthetic", "min_effect=0.005"]}
    for name, args in jobs.items():
        a = _job(args + small, tmp_path / name / "one")
        b = _job(args + small + [f"model.device_map={OFFLOAD_MAP}", f"model.offload_folder={tmp_path / name / 'disk'}"],
                 tmp_path / name / "off")
        assert a["model"]["device_map"] is None
        assert b["model"]["device_map"]["model.layers.1"] == "disk" and set(b["model"]["devices"]) == {"cpu", "disk"}
        rows_a, rows_b = a["result"]["rows"], b["result"]["rows"]
        assert len(rows_a) == len(rows_b) > 0
        keys = ("s_old", "s_new", "s_field", "s_downstream", "s_all") if name == "random" else ("s_old", "s_new")
        for ra, rb in zip(rows_a, rows_b):
            assert ra["pair"] == rb["pair"] and ra["top1_id_old"] == rb["top1_id_old"]
            for key in keys:
                assert ra[key] == pytest.approx(rb[key], abs=1e-5), key


#: fp32 scores of the same model with half its layers computed by another device's kernels (nats).
SPLIT_TOL = 1e-4
GPU_ONE = ("{model.embed_tokens:0,model.rotary_emb:0,model.layers.0:0,model.layers.1:0,model.layers.2:0,"
           "model.layers.3:0,model.norm:0,lm_head:0}")
GPU_SPLIT = ("{model.embed_tokens:0,model.rotary_emb:0,model.layers.0:0,model.layers.1:0,model.layers.2:cpu,"
             "model.layers.3:cpu,model.norm:cpu,lm_head:cpu}")


@pytest.mark.embedded
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: layers split between cuda:0 and the CPU")
def test_device_map_split_between_gpu_and_cpu_gives_the_single_device_records(tiny_checkpoint, tmp_path):
    """Issue #37: a device map that puts half the layers on ``cuda:0`` and the rest (with the final
    norm and the unembedding) on the CPU writes the records of the whole model on ``cuda:0`` (fp32,
    :data:`SPLIT_TOL`): a checkpoint (screen) and a random-weight model built once on the CPU and
    dispatched by either map (field_refresh: the cache surgery, whose K/V then live on two devices).
    Prints the largest difference per job (``pytest -s``)."""
    small = ["scenario=small", "scenario.ids=[favourite_colour]", "scenario.families=null", "scenario.n_instances=2",
             "plot=false", "probe.progress=false", "probe.n_boot=50", "device=cuda", "model.dtype=float32"]
    jobs = {"ckpt": (["model=qwen3-8b", f"model.path={tiny_checkpoint}", "probe=screen", "flip_rule=relative"], []),
            "random": (["model=qwen3-8b", "model.random_init.enabled=true", f"model.random_init.tokenizer={TOKENIZER}",
                        "probe=field_refresh", "flip_rule=synthetic", "min_effect=0.005"], [f"model.device_map={GPU_ONE}"])}
    for name, (args, one) in jobs.items():
        a = _job(args + small + one, tmp_path / name / "one")
        b = _job(args + small + [f"model.device_map={GPU_SPLIT}"], tmp_path / name / "split")
        assert set(b["model"]["devices"]) == {"0", "cpu"} and b["model"]["device_map"]["lm_head"] == "cpu"
        rows_a, rows_b = a["result"]["rows"], b["result"]["rows"]
        assert len(rows_a) == len(rows_b) > 0
        keys = ("s_old", "s_new", "s_field", "s_downstream", "s_all") if name == "random" else ("s_old", "s_new")
        for ra, rb in zip(rows_a, rows_b):
            assert ra["pair"] == rb["pair"] and ra["top1_id_old"] == rb["top1_id_old"]
        diffs = {key: max(abs(ra[key] - rb[key]) for ra, rb in zip(rows_a, rows_b)) for key in keys}
        print(f"device map cuda:0 + cpu vs one device ({name}, {len(rows_a)} pairs): largest difference (nats) "
              + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        assert max(diffs.values()) <= SPLIT_TOL, [(ra, rb) for ra, rb in zip(rows_a, rows_b)][:1]


# ------------------------------------------------------------------ records belong to their config

@pytest.fixture(scope="module")
def fruit(tmp_path_factory):
    path = fruit_scenario(tmp_path_factory.mktemp("fruit") / "fruit.yaml")
    return ["probe=screen", f"scenario.paths=[{path}]", "scenario.n_instances=2", "plot=false",
            "probe.progress=false"]


@pytest.fixture(scope="module")
def planted_screen():
    """A screen of the planted suite on a planted model (:mod:`kvnotes.models.planted`): the job
    path end to end with a model that loads in a fraction of a second."""
    return ["model=planted-notes", "scenario=planted", "scenario.n_instances=1", "probe=screen", "plot=false",
            "probe.progress=false"]


@pytest.mark.embedded
def test_sweep_over_flip_rule_and_keys_writes_one_record_per_point(planted_screen, tmp_path):
    fruit = planted_screen
    proc = run("-m", *fruit, "flip_rule=owned,relative", "probe.n_boot=100,200", f"out_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = sorted(tmp_path.rglob("record.json"))
    assert len(recs) == 4
    seen = {(r["config"]["flip_rule"], r["config"]["probe"]["n_boot"])
            for r in (json.loads(p.read_text()) for p in recs)}
    assert seen == {("owned", 100), ("owned", 200), ("relative", 100), ("relative", 200)}
    assert all("flip_rule=" in p.parent.name and "probe.n_boot=" in p.parent.name for p in recs)
    # the same settings again: skipped; other settings are never served an old record
    again = run(*fruit, "flip_rule=relative", "probe.n_boot=200", f"out_root={tmp_path}")
    assert again.returncode == 0 and "skipping" in again.stdout
    other = run(*fruit, "flip_rule=relative", "probe.n_boot=200", "scenario.n_instances=3", f"out_root={tmp_path}")
    assert other.returncode == 0 and "wrote" in other.stdout
    assert len(list(tmp_path.rglob("record.json"))) == 5

    from kvnotes.records.store import records_frame

    frame = records_frame(tmp_path)
    assert frame.groupby("overrides").ngroups == 5


@pytest.mark.embedded
def test_record_of_another_config_is_never_returned_and_a_truncated_one_is_rerun(planted_screen, tmp_path):
    fruit = planted_screen
    assert run(*fruit, f"out_root={tmp_path}").returncode == 0
    path = next(tmp_path.rglob("record.json"))
    rec = json.loads(path.read_text())
    rec["config"]["min_effect"] = 0.125                     # as if the defaults had changed since
    path.write_text(json.dumps(rec))
    one_line_error(run(*fruit, f"out_root={tmp_path}"), "different config", "min_effect", "force=true")
    path.write_text(path.read_text()[:100])                 # a truncated record is incomplete: re-run
    proc = run(*fruit, f"out_root={tmp_path}")
    assert proc.returncode == 0 and "wrote" in proc.stdout
    rec = json.loads(path.read_text())
    assert rec["status"] == "complete" and rec["config"]["min_effect"] == 1.0


def _lock_files(root: Path) -> list[Path]:
    """Record locks under ``root``, read while a job writes there: a folder it creates and removes (its
    writability probe) may vanish between listing and reading (it failed a full-suite run)."""
    try:
        return list(root.rglob("record.json.lock"))
    except FileNotFoundError:
        return []


@pytest.mark.embedded
@pytest.mark.parametrize("sig, status, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupted_job_leaves_no_record(fruit, tmp_path, sig, status, word):
    """Ctrl-C and ``kill`` (SIGTERM: a batch system's time limit, a container stop) alike leave no
    record, no lock file and no empty folder, with one line. The signal goes when the job holds its
    record's lock (an event, not a time: the test holds on a loaded machine)."""
    e = dict(os.environ, HF_HUB_OFFLINE="1")
    out = tmp_path / "runs"
    # as from a terminal: Ctrl-C's default action even where this worker ignores SIGINT (a child
    # inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt for it)
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *fruit, f"out_root={out}"], cwd=ROOT,
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + HANG_S
    while not _lock_files(out) and proc.poll() is None:
        assert time.monotonic() < deadline, "the job never took its record's lock"
        time.sleep(0.02)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == status, err[-2000:]
    assert f"kvnotes: error: {word}; no record written" in err and "Traceback" not in err
    assert not out.exists() or not list(out.rglob("*")), sorted(out.rglob("*"))     # nothing, not even folders
    assert run(*fruit, f"out_root={out}").returncode == 0      # the next run starts clean
    assert json.loads(next(out.rglob("record.json")).read_text())["status"] == "complete"


@pytest.mark.embedded
def test_two_processes_on_one_record_never_mix(fruit, tmp_path):
    e = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "run.py"), *fruit, f"out_root={tmp_path}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=HANG_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    assert sorted("skipping" in o[0] for o in outs) == [False, True]      # one ran, the other found its record
    recs = list(tmp_path.rglob("record.json"))
    assert len(recs) == 1 and json.loads(recs[0].read_text())["status"] == "complete"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_slurm_jobs_check_device_and_quantization_where_they_run(capsys, monkeypatch):
    """Submitted from a login node without GPUs, a SLURM sweep is not refused for asking for CUDA or
    nf4: each job checks its own device on the node it runs on. Locally the same request is refused;
    so is a SLURM launcher on a machine without SLURM's commands (nothing written)."""
    import shutil

    from kvnotes.cli import run as cli

    with pytest.raises(SystemExit) as stop:
        cli.precheck(["-m", "hydra/launcher=slurm", "model=smollm2-135m"])
    assert stop.value.code == 2 and "sbatch and srun are not on this machine's PATH" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "which", lambda cmd: f"/usr/bin/{cmd}")      # a login node
    cli.precheck(["-m", "hydra/launcher=slurm_multigpu", "model=llama-3.1-70b", "model.quantization=nf4", "device=cuda"])
    with pytest.raises(SystemExit):
        cli.precheck(["model=llama-3.1-70b", "model.quantization=nf4", "device=cuda"])
    assert "no CUDA device" in capsys.readouterr().err
