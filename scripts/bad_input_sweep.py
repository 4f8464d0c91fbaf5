#!/usr/bin/env python
"""A reproducible sweep of bad inputs across every kvnotes entry point, as a new user would try them.

Project rule: bad input at any entry point is ONE line on stderr, ``kvnotes: error: <message>``, and
exit status 2; never a traceback, never a silently wrong result, and nothing left behind (no record,
no empty out_root folder, no lock file, no multirun.yaml, no half-written output).

Each case runs in a fresh temporary directory (the subprocess's working directory, so relative
outputs land there; ``TMPDIR`` points at a sibling folder that must stay empty), after an optional
setup that creates the files the case needs, with ``HF_HUB_OFFLINE=1``. A case passes when:

* the exit status is 2;
* stderr holds exactly one line starting ``kvnotes: error:`` and nothing else (progress-bar lines
  such as ``Loading weights ... 100%|...`` are ignored), and no ``Traceback``;
* the working directory holds exactly what setup created (a recursive listing of files and
  folders, with file sizes and modification times, compared before and after) and ``TMPDIR`` is
  empty (torch's ``torchinductor_<user>`` compile cache, made on import, excepted).

    .venv/bin/python scripts/bad_input_sweep.py                 # every case, one line each, a summary
    .venv/bin/python scripts/bad_input_sweep.py --only battery  # the cases whose name or command has it
    .venv/bin/python scripts/bad_input_sweep.py --list          # the cases, not run
    .venv/bin/python scripts/bad_input_sweep.py --argparse-ok   # accept argparse's usage + 'prog: error:'

Exit status 1 when any case fails. argparse's own flag errors are one ``kvnotes: error:`` line too
(:func:`kvnotes.cli.errors.argparse_error`); ``--argparse-ok`` also accepts argparse's plain form (its
usage lines, then ``<prog>: error: <message>``, exit 2), for a kvnotes from before that.

The few cases that load a model use ``model=planted-notes scenario=planted`` (built in
``$KVNOTES_CACHE/planted``, loads in a second); the cases that need a valid record (``plot -o``,
``report -o``, ``table --results``) copy one fixture record, made once per sweep by such a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "run.py"
TIMEOUT_S = 600          # only to catch hangs

Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    """One bad input: ``argv`` starts with ``run.py`` (``python run.py``) or ``kvnotes`` (``python -m
    kvnotes``); ``{cwd}`` in an argument or an env value is the case's working directory."""

    name: str
    argv: tuple[str, ...]
    setup: Setup | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: bare ``kvnotes`` / ``kvnotes bench``: exit 2 with the usage text (stdout) is the expected answer
    usage_ok: bool = False
    #: the case loads a model before it can refuse the input (informational)
    loads_model: bool = False

    def command(self) -> str:
        return " ".join(_shell_word(a) for a in self.argv)


def _shell_word(a: str) -> str:
    return a if a and re.fullmatch(r"[\w@%+=:,./{}\[\]-]+", a) else "'" + a.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------------------------- setup helpers

def mkfile(rel: str, content: str | bytes = "x\n") -> Setup:
    """Write ``rel`` (its folders made) under the case directory."""
    def setup(cwd: Path) -> None:
        p = cwd / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)  # type: ignore[operator]
    return setup


def mkdir(rel: str) -> Setup:
    def setup(cwd: Path) -> None:
        (cwd / rel).mkdir(parents=True, exist_ok=True)
    return setup


def chain(*steps: Setup) -> Setup:
    def setup(cwd: Path) -> None:
        for s in steps:
            s(cwd)
    return setup


_FIXTURE: dict[str, Path] = {}
_FIXTURE_LOCK = threading.Lock()


def fixture_record() -> Path:
    """A valid ``probe=screen`` record (planted-notes, one instance), made once per sweep in a folder
    of its own (outside every case's directory)."""
    with _FIXTURE_LOCK:
        if "path" in _FIXTURE:
            return _FIXTURE["path"]
        root = Path(tempfile.mkdtemp(prefix="kvnotes-sweep-fixture-"))
        proc = subprocess.run([sys.executable, str(RUN_PY), "model=planted-notes", "scenario=planted",
                               "scenario.n_instances=1", "probe=screen", "plot=false", "probe.progress=false",
                               f"out_root={root}"], cwd=root, capture_output=True, text=True,
                              env=os.environ | {"HF_HUB_OFFLINE": "1"}, timeout=TIMEOUT_S)
        found = sorted(root.rglob("record.json"))
        if proc.returncode != 0 or not found:
            sys.exit(f"bad_input_sweep: could not make the fixture record (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        _FIXTURE["path"] = found[0]
        _FIXTURE["root"] = root
        return found[0]


def record(rel: str, mutate: Callable[[dict], None] | None = None, truncate: bool = False) -> Setup:
    """Copy the fixture record to ``rel`` (a file path), changed by ``mutate`` or cut in half."""
    def setup(cwd: Path) -> None:
        text = fixture_record().read_text()
        if mutate is not None:
            rec = json.loads(text)
            mutate(rec)
            text = json.dumps(rec)
        if truncate:
            text = text[: len(text) // 2]
        mkfile(rel, text)(cwd)
    return setup


def _drop_aggregates(rec: dict) -> None:
    """A screen record whose result lacks ``aggregates`` (what its table, figure and page read)."""
    rec["result"].pop("aggregates", None)


def _drop_result(rec: dict) -> None:
    rec.pop("result", None)


def _aggregates_mistyped(rec: dict) -> None:
    """A screen record whose per-family counts are words, not numbers."""
    for fam in rec["result"]["aggregates"]["by_family"].values():
        fam["n_pairs"] = "twelve"
        fam["n_flip"] = "many"


# A valid scenario file (the shipped recall/favourite_colour one), and its broken variants.
SCENARIO = """\
family: recall
domain: customer profile colour
field:
  slot: colour
  values: [red, blue, green]
candidates: {red: " red", blue: " blue", green: " green"}
slots:
  name: [Ana Ruiz, Kenji Sato, Priya Nair, Tom Becker]
  customer_id: "C-#####"
context: "Customer profile for {name} (id {customer_id}). Favourite colour: {colour}."
filler:
  - "The profile was created last spring."
  - "The customer prefers email over phone calls."
  - "Their last order shipped on time."
n_filler: 2
rule: "Staff must repeat profile details exactly as recorded."
request: "A clerk asks for the customer's favourite colour."
variants:
  direct: {decision: "Reply with the colour only.", answer_prefix: "The favourite colour is"}
"""


def suite(**files: str | bytes) -> Setup:
    """A suite folder ``suite/`` holding ``files`` (name -> content)."""
    return chain(mkdir("suite"), *(mkfile(f"suite/{name}", body) for name, body in files.items()))


def _replace(old: str, new: str) -> str:
    assert old in SCENARIO, old
    return SCENARIO.replace(old, new)


LOCOMO_OK_SHAPE = json.dumps([{"sample_id": "s1", "qa": [{"question": "q?", "category": 1}],
                               "conversation": {"speaker_a": "A", "speaker_b": "B"}}])
AUTO_JSON_BAD_ROWS = json.dumps({"rows": [{"bogus": 1}], "checks_run": ["field_plus_erratum"], "model": "smollm2-135m",
                                 "scenario": "small", "threads": 1, "wall_seconds": 1.0, "load_average": [0, 0, 0]})
LLAMA_CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# --------------------------------------------------------------------------------------------- the cases

def R(name: str, *args: str, setup: Setup | None = None, env: dict | None = None, loads_model: bool = False) -> Case:
    """A ``python run.py`` case; ``out_root=runs`` (inside the case directory) unless the case sets it."""
    if not any(a.lstrip("+~").startswith("out_root") for a in args):
        args = (*args, "out_root=runs")
    return Case(name, ("run.py", *args), setup, env or {}, loads_model=loads_model)


def K(name: str, *args: str, setup: Setup | None = None, env: dict | None = None, usage_ok: bool = False,
      loads_model: bool = False) -> Case:
    """A ``python -m kvnotes`` case."""
    return Case(name, ("kvnotes", *args), setup, env or {}, usage_ok=usage_ok, loads_model=loads_model)


PLANTED = ("model=planted-notes", "scenario=planted")
REC = "rec/record.json"

CASES: list[Case] = [
    # ------------------------------------------------------------------ run.py: config-group choices
    R("run/unknown-model", "model=nosuch"),
    R("run/unknown-model-case", "model=SmolLM2-135M"),
    R("run/unknown-probe", "probe=nosuch"),
    R("run/unknown-scenario", "scenario=nosuch"),
    R("run/unknown-probe-in-sweep", "-m", "probe=screen,nosuch"),
    R("run/empty-model-choice", "model="),
    # ------------------------------------------------------------------ run.py: misspelt keys
    R("run/misspelt-top", "min_efect=2"),
    R("run/misspelt-top-plus", "+min_efect=2"),
    R("run/plus-foo", "+foo=bar"),
    R("run/misspelt-out_root", "out_roots=x"),
    R("run/misspelt-model-key", "model.dtyp=float32"),
    R("run/plus-model-xyz", "+model.xyz=1"),
    R("run/misspelt-scenario-key", "scenario.n_instance=2"),
    R("run/misspelt-scenario-key-plus", "+scenario.n_instance=2"),
    R("run/misspelt-probe-key", "probe.n_bot=10"),
    R("run/misspelt-probe-key-plus", "+probe.n_bot=10"),
    R("run/misspelt-heads-key", "probe=heads", "probe.chunk_head=4"),
    R("run/misspelt-nested-random-key", "probe=heads", "+probe.random.n_draw=2"),
    # ------------------------------------------------------------------ run.py: run-level values
    R("run/min_effect-abc", "min_effect=abc"),
    R("run/min_effect-negative", "min_effect=-1"),
    R("run/min_effect-nan", "min_effect=nan"),
    R("run/min_effect-inf", "min_effect=inf"),
    R("run/min_effect-overflow", "min_effect=1e400"),
    R("run/budget_mb-zero", "budget_mb=0"),
    R("run/budget_mb-negative", "budget_mb=-5"),
    R("run/budget_mb-word", "budget_mb=lots"),
    R("run/seed-negative", "seed=-1"),
    R("run/seed-word", "seed=abc"),
    R("run/seed-fraction", "seed=1.5"),
    R("run/flip_rule-unknown", "flip_rule=strict"),
    R("run/flip_rule-synthetic-real-model", "flip_rule=synthetic"),
    R("run/readout-unknown", "readout=last"),
    R("run/device-tpu", "device=tpu"),
    R("run/device-cuda-absent", "device=cuda"),
    R("run/device-cuda7", "device=cuda:7"),
    R("run/device-mps", "device=mps"),
    R("run/device-list", "device=[cpu]"),
    R("run/plot-maybe", "plot=maybe"),
    R("run/force-maybe", "force=maybe"),
    R("run/force-2", "force=2"),
    # ------------------------------------------------------------------ run.py: model keys
    R("run/model-dtype", "model.dtype=int8"),
    R("run/model-attn", "model.attn_implementation=magic"),
    R("run/model-quantization-unknown", "model.quantization=nf3"),
    R("run/model-quantization-cpu", "model.quantization=nf4"),
    R("run/model-device_map-unknown", "model.device_map=nonsense"),
    R("run/model-cpu_linear", "model.cpu_linear=mkl"),
    R("run/model-random_init-maybe", "model.random_init.enabled=maybe"),
    R("run/model-thinking-maybe", "model.thinking=maybe"),
    R("run/model-thinking-direct", "model.thinking=true"),
    R("run/model-path-missing", "model.path=/no/such/checkpoint"),
    R("run/model-path-no-config", "model.path=ckpt", setup=mkdir("ckpt")),
    R("run/model-path-is-file", "model.path=ckpt", setup=mkfile("ckpt")),
    R("run/model-path-other-arch", "model=gemma-3-270m", "model.path=ckpt",
      setup=mkfile("ckpt/config.json", LLAMA_CONFIG)),
    R("run/model-path-config-not-json", "model=gemma-3-270m", "model.path=ckpt",
      setup=mkfile("ckpt/config.json", "{not json")),
    R("run/model-path-and-random-init", "model.path=ckpt", "model.random_init.enabled=true",
      setup=mkfile("ckpt/config.json", LLAMA_CONFIG)),
    # ------------------------------------------------------------------ run.py: scenario keys
    R("run/n_instances-zero", "scenario.n_instances=0"),
    R("run/n_instances-negative", "scenario.n_instances=-1"),
    R("run/n_instances-word", "scenario.n_instances=abc"),
    R("run/n_instances-20-digits", "scenario.n_instances=99999999999999999999"),
    R("run/n_instances-billion", "scenario.n_instances=1000000000"),
    R("run/scenario-seed-negative", "scenario.seed=-1"),
    R("run/scenario-variant-unknown", "scenario.variant=foo"),
    R("run/scenario-variant-cot-unsupported", "scenario.variant=cot"),
    R("run/scenario-families-empty", "scenario.families=[]"),
    R("run/scenario-families-unknown", "scenario.families=[nosuch]"),
    R("run/scenario-families-string", "scenario.families=recall"),
    R("run/scenario-ids-empty", "scenario.ids=[]"),
    R("run/scenario-ids-unknown", "scenario.ids=[nosuch]"),
    R("run/scenario-paths-empty", "scenario.paths=[]"),
    R("run/scenario-paths-missing", "scenario.paths=[/no/such]"),
    R("run/scenario-transcript-turns", "scenario.transcript.turns=-1"),
    R("run/scenario-transcript-dict", "scenario.transcript={turns:-1}"),
    R("run/scenario-transcript-word", "scenario.transcript={turns:abc}"),
    R("run/scenario-chat_template-maybe", "scenario.chat_template=maybe"),
    R("run/scenario-memory-missing", "scenario=memory", "probe=memory_placement", "scenario.memory=/no/such.yaml"),
    R("run/scenario-memory-not-yaml", "scenario=memory", "probe=memory_placement", "scenario.memory=mem.yaml",
      setup=mkfile("mem.yaml", "personas: [unclosed\n")),
    R("run/scenario-locomo-missing", "probe=locomo", "scenario=locomo", "scenario.locomo=/no/such.json"),
    R("run/scenario-locomo-unset", "probe=locomo", "scenario=locomo"),
    # ------------------------------------------------------------------ run.py: out_root
    R("run/out_root-empty", "out_root="),
    R("run/out_root-slash", "out_root=/"),
    R("run/out_root-file", "out_root=afile", setup=mkfile("afile")),
    R("run/out_root-under-file", "out_root=afile/sub", setup=mkfile("afile")),
    R("run/out_root-proc", "out_root=/proc/x"),
    # ------------------------------------------------------------------ run.py: environment
    R("run/KVNOTES_CACHE-file", setup=mkfile("afile"), env={"KVNOTES_CACHE": "{cwd}/afile"}),
    R("run/KVNOTES_CACHE-under-file", setup=mkfile("afile"), env={"KVNOTES_CACHE": "{cwd}/afile/cache"}),
    # ------------------------------------------------------------------ run.py: sweeps, deletion, syntax
    R("run/sweep-bad-point", "-m", "min_effect=0.5,abc"),
    R("run/sweep-without-m", "min_effect=0.5,1"),
    R("run/sweep-bad-seed-point", "-m", "seed=0,-1"),
    R("run/sweep-bad-n_instances-point", "-m", "scenario.n_instances=1,0"),
    R("run/sweep-range-bad", "-m", "seed=range(0,3,0)"),
    R("run/delete-key", "~min_effect"),
    R("run/delete-scenario-key", "~scenario.seed"),
    R("run/delete-group", "~probe"),
    R("run/delete-model-group", "~model"),
    R("run/delete-scenario-group", "~scenario"),
    R("run/unparseable-bracket", "min_effect=[1,"),
    R("run/unparseable-no-key", "=5"),
    R("run/unparseable-bare-word", "min_effect"),
    R("run/interpolation-missing", "min_effect=${nope}"),
    R("run/interpolation-env-unset", "scenario.seed=${oc.env:KVNOTES_SWEEP_NOT_SET}"),
    R("run/interpolation-unterminated", "min_effect=${seed"),
    R("run/launcher-slurm", "-m", "hydra/launcher=slurm"),
    R("run/launcher-unknown", "-m", "hydra/launcher=nosuch"),
    R("run/config-dir-missing", "--config-dir", "/no/such/dir"),
    R("run/config-dir-no-value", "out_root=runs", "--config-dir"),
    R("run/unknown-flag", "--nosuch"),
    R("run/hydra-unknown-key", "hydra.nosuch=1"),
    R("run/hydra-run-dir-proc", "hydra.run.dir=/proc/x"),
    R("run/hydra-run-dir-file", "hydra.run.dir=afile", setup=mkfile("afile")),
    R("run/hydra-sweep-dir-proc", "-m", "hydra.sweep.dir=/proc/x", "seed=0,1"),
    R("run/config-name-unknown", "--config-name", "nosuch"),
    R("run/config-path-missing", "--config-path", "/no/such/dir"),
    # ------------------------------------------------------------------ run.py: probe values
    R("probe/screen-n_boot-zero", "probe=screen", "probe.n_boot=0"),
    R("probe/screen-n_boot-negative", "probe=screen", "probe.n_boot=-1"),
    R("probe/screen-progress-maybe", "probe=screen", "probe.progress=maybe"),
    R("probe/blast_radius-thresholds-negative", "probe.thresholds=[-1]"),
    R("probe/blast_radius-thresholds-empty", "probe.thresholds=[]"),
    R("probe/field_refresh-exact-maybe", "probe=field_refresh", "probe.exact=maybe"),
    R("probe/field_refresh-cot_max_new_tokens", "probe=field_refresh", "probe.cot_max_new_tokens=-1"),
    R("probe/field_refresh-cot_max_pairs-zero", "probe=field_refresh", "probe.cot_max_pairs=0"),
    R("probe/suffix_recovery-selection_fraction-zero", "probe=suffix_recovery", "probe.selection_fraction=0"),
    R("probe/suffix_recovery-selection_fraction-big", "probe=suffix_recovery", "probe.selection_fraction=1.5"),
    R("probe/suffix_recovery-topk_anchor", "probe=suffix_recovery", "probe.topk_anchor=middle"),
    R("probe/suffix_recovery-layer_bands-zero", "probe=suffix_recovery", "probe.layer_bands=0"),
    R("probe/suffix_recovery-layer_bands-reversed", "probe=suffix_recovery", "probe.layer_bands=[[5,2]]"),
    R("probe/suffix_recovery-grid-counts", "probe=suffix_recovery", "probe.grid.counts=[-1]"),
    R("probe/suffix_recovery-random-n_draws", "probe=suffix_recovery", "probe.random.n_draws=-1"),
    R("probe/suffix_recovery-cot_families", "probe=suffix_recovery", "scenario.variant=cot", "probe.cot_families=[nosuch]"),
    R("probe/suffix_recovery-one-instance", "probe=suffix_recovery", "scenario.n_instances=1"),
    R("probe/suffix_recovery-families", "probe=suffix_recovery", "probe.families=[nosuch]"),
    R("probe/suffix_recovery-topk-without-single", "probe=suffix_recovery", "probe.single=false"),
    R("probe/suffix_recovery-topk-without-random", "probe=suffix_recovery", "probe.families=[suffix,topk]"),
    R("probe/compose-image_chunk-cot", "probe=compose", "scenario.variant=cot", "probe.image_chunk=true"),
    R("probe/read_location-n_sinks", "probe=read_location", "probe.n_sinks=-1"),
    R("probe/read_location-band_units", "probe=read_location", "probe.band_units=tokens"),
    R("probe/read_location-bands-reversed", "probe=read_location", "probe.bands=[[0.5,0.25]]"),
    R("probe/read_location-knockout-groups", "probe=read_location", "probe.knockout_groups=[[nosuch]]"),
    R("probe/read_location-collapse-top_k", "probe=read_location", "probe.collapse.top_k=0"),
    R("probe/heads-ks-negative", "probe=heads", "probe.ks=[-1]"),
    R("probe/heads-ks-empty", "probe=heads", "probe.ks=[]"),
    R("probe/heads-modes", "probe=heads", "probe.modes=[both]"),
    R("probe/heads-backend", "probe=heads", "probe.backend=tl"),
    R("probe/heads-chunk_heads-zero", "probe=heads", "probe.chunk_heads=0"),
    R("probe/heads-one-instance", "probe=heads", "scenario.n_instances=1"),
    R("probe/heads-one-instance-sweep", "-m", "probe=heads,direction", "scenario.n_instances=1"),
    R("probe/components-backend", "probe=components", "probe.backend=foo"),
    R("probe/components-selection_fraction", "probe=components", "probe.selection_fraction=2"),
    R("probe/components-topk_anchor", "probe=components", "probe.topk_anchor=x"),
    R("probe/direction-layers-negative", "probe=direction", "probe.layers=[-1]"),
    R("probe/direction-n_layers_scan-zero", "probe=direction", "probe.n_layers_scan=0"),
    R("probe/direction-fit_scope", "probe=direction", "probe.fit_scope=global"),
    R("probe/direction-ablate_to", "probe=direction", "probe.ablate_to=zero"),
    R("probe/direction-one-instance", "probe=direction", "scenario.n_instances=1"),
    R("probe/edit-rankings", "probe=edit", "probe.rankings=[magic]"),
    R("probe/edit-ks-negative", "probe=edit", "probe.ks=[-1]"),
    R("probe/edit-placement", "probe=edit", "probe.placement=nowhere"),
    R("probe/edit-max_pairs-zero", "probe=edit", "probe.max_pairs=0"),
    R("probe/edit-oracle_ranking", "probe=edit", "probe.oracle_ranking=foo"),
    R("probe/compose-seams-negative", "probe=compose", "probe.seams=[-1]"),
    R("probe/compose-sinks-empty", "probe=compose", "probe.sinks=[]"),
    R("probe/compose-sinks-unknown", "probe=compose", "probe.sinks=[top]"),
    R("probe/compose-image_grid-short", "probe=compose", "probe.image_grid=[1,4]"),
    R("probe/compose-image_grid-zero", "probe=compose", "probe.image_grid=[0,4,4]"),
    R("probe/agent-turns-zero", "probe=agent", "probe.turns=0"),
    R("probe/agent-seam-negative", "probe=agent", "probe.seam=-1"),
    R("probe/agent-sink", "probe=agent", "probe.sink=end"),
    R("probe/memory_placement-document-zero", "probe=memory_placement", "probe.document=0"),
    R("probe/memory_placement-lengths-zero", "probe=memory_placement", "probe.lengths=[0]"),
    R("probe/memory_placement-lengths-empty", "probe=memory_placement", "probe.lengths=[]"),
    R("probe/memory_placement-alpha-zero", "probe=memory_placement", "probe.alpha=0"),
    R("probe/memory_placement-alpha-big", "probe=memory_placement", "probe.alpha=1.5"),
    R("probe/memory_placement-margin_kl-zero", "probe=memory_placement", "probe.margin_kl=0"),
    R("probe/memory_agent-arms", "probe=memory_agent", "probe.arms=[nosuch]"),
    R("probe/memory_edits-ks-zero", "probe=memory_edits", "probe.ks=[0]"),
    R("probe/locomo-max_questions-zero", "probe=locomo", "scenario=locomo", "scenario.locomo=lc.json",
      "probe.max_questions=0", setup=mkfile("lc.json", LOCOMO_OK_SHAPE)),
    # ------------------------------------------------------------------ run.py: a user's scenario files
    R("scen/duplicate-key", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": SCENARIO + "family: recall\n"})),
    R("scen/identical-files", "scenario.paths=[suite]", setup=suite(**{"a.yaml": SCENARIO, "b.yaml": SCENARIO})),
    R("scen/same-path-twice", "scenario.paths=[suite,suite/a.yaml]", setup=suite(**{"a.yaml": SCENARIO})),
    R("scen/duplicate-id", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": "id: same\n" + SCENARIO,
                     "b.yaml": "id: same\n" + _replace("Favourite colour:", "Preferred colour:")})),
    R("scen/missing-required-key", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace('rule: "Staff must repeat profile details exactly as recorded."\n', "")})),
    R("scen/not-yaml", "scenario.paths=[suite]", setup=suite(**{"a.yaml": "family: [unclosed\n  domain: x\n"})),
    R("scen/binary-garbage", "scenario.paths=[suite]", setup=suite(**{"a.yaml": bytes(range(256)) * 4})),
    R("scen/empty-file", "scenario.paths=[suite]", setup=suite(**{"a.yaml": ""})),
    R("scen/a-list", "scenario.paths=[suite]", setup=suite(**{"a.yaml": "- family: recall\n"})),
    R("scen/unknown-key", "scenario.paths=[suite]", setup=suite(**{"a.yaml": SCENARIO + "colour_hint: red\n"})),
    R("scen/field-slot-missing", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace("Favourite colour: {colour}.", "Favourite colour: unknown.")})),
    R("scen/field-slot-twice", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace("Favourite colour: {colour}.", "Favourite colour: {colour}, {colour}.")})),
    R("scen/undeclared-slot", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace("(id {customer_id})", "(id {customer_id}, {nosuch})")})),
    R("scen/one-value", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace("values: [red, blue, green]", "values: [red]")})),
    R("scen/outcome-not-candidate", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace("values: [red, blue, green]", "values: [red, blue, purple]")})),
    R("scen/n_filler-too-many", "scenario.paths=[suite]", setup=suite(**{"a.yaml": _replace("n_filler: 2", "n_filler: 9")})),
    R("scen/no-direct-variant", "scenario.paths=[suite]", setup=suite(**{"a.yaml": _replace("  direct: {", "  other: {")})),
    R("scen/lone-surrogate", "scenario.paths=[suite]",
      setup=suite(**{"a.yaml": _replace('domain: customer profile colour', 'domain: "bad \\ud800 text"')})),
    R("scen/no-yaml-in-folder", "scenario.paths=[suite]", setup=suite(**{"notes.txt": "hello\n"})),
    R("scen/empty-folder", "scenario.paths=[suite]", setup=mkdir("suite")),
    # ------------------------------------------------------------------ run.py: refused only once the model is loaded
    R("load/direction-layers-out-of-range", *PLANTED, "scenario.n_instances=2", "probe=direction", "probe.layers=[99]",
      loads_model=True),
    R("load/suffix_recovery-layer_bands-out-of-range", *PLANTED, "scenario.n_instances=2", "probe=suffix_recovery",
      "probe.layer_bands=[[0,99]]", loads_model=True),
    R("load/read_location-layer-bands-out-of-range", *PLANTED, "scenario.n_instances=1", "probe=read_location",
      "probe.band_units=layer", "probe.bands=[[0,99]]", loads_model=True),
    R("load/dissociation-no-polarity-scenarios", *PLANTED, "scenario.n_instances=1", "probe=dissociation",
      loads_model=True),
    R("load/compose-image_chunk-not-a-vlm", *PLANTED, "scenario.n_instances=1", "probe=compose",
      "probe.image_chunk=true", loads_model=True),
    R("load/memory_agent-lengths-zero", "probe=memory_agent", "probe.lengths=[0]", loads_model=True),
    R("load/memory_placement-suite-missing", "probe=memory_placement", "probe.suite=/no/such.yaml", loads_model=True),
    # ------------------------------------------------------------------ kvnotes: the dispatcher and `kvnotes run`
    K("kvnotes/no-subcommand", usage_ok=True),
    K("kvnotes/unknown-subcommand", "frobnicate"),
    K("kvnotes/subcommand-case", "Run"),
    K("kvnotes/version-flag", "--version"),
    K("kvnotes/bench-no-name", "bench", usage_ok=True),
    K("kvnotes/bench-unknown", "bench", "nosuch"),
    K("kvnotes/run-unknown-model", "run", "model=nosuch", "out_root=runs"),
    K("kvnotes/run-misspelt-key", "run", "min_efect=1", "out_root=runs"),
    K("kvnotes/run-n_instances-zero", "run", "scenario.n_instances=0", "out_root=runs"),
    K("kvnotes/run-out_root-proc", "run", "out_root=/proc/x"),
    K("kvnotes/run-config-dir-missing", "run", "--config-dir", "/no/such/dir", "out_root=runs"),
    # ------------------------------------------------------------------ kvnotes table
    K("table/missing-path", "table", "/no/such/record.json"),
    K("table/truncated-record", "table", REC, setup=record(REC, truncate=True)),
    K("table/json-not-record", "table", REC, setup=mkfile(REC, '{"a": 1}')),
    K("table/json-list", "table", REC, setup=mkfile(REC, "[1, 2]")),
    K("table/binary-file", "table", REC, setup=mkfile(REC, bytes(range(256)))),
    K("table/record-without-result", "table", REC, setup=record(REC, _drop_result)),
    K("table/record-without-aggregates", "table", REC, setup=record(REC, _drop_aggregates)),
    K("table/record-mistyped-counts", "table", REC, setup=record(REC, _aggregates_mistyped)),
    K("table/empty-folder", "table", "empty", setup=mkdir("empty")),
    K("table/no-args", "table"),
    K("table/unknown-flag", "table", "--nosuch", REC, setup=record(REC)),
    K("table/bad-by", "table", "--by", "probe", REC, setup=record(REC)),
    K("table/results-missing", "table", "--results", "/no/such/dir"),
    K("table/results-file", "table", "--results", "afile", setup=mkfile("afile")),
    K("table/results-empty-folder", "table", "--results", "empty", setup=mkdir("empty")),
    K("table/results-unknown-suite", "table", "--results", "runs/planted-notes", "--suite", "nosuch",
      setup=record("runs/planted-notes/screen/planted/record.json")),
    K("table/results-truncated", "table", "--results", "runs/planted-notes", "--suite", "planted",
      setup=record("runs/planted-notes/screen/planted/record.json", truncate=True)),
    # ------------------------------------------------------------------ kvnotes plot
    K("plot/missing-path", "plot", "/no/such/record.json"),
    K("plot/truncated-record", "plot", REC, setup=record(REC, truncate=True)),
    K("plot/json-not-record", "plot", REC, setup=mkfile(REC, '{"a": 1}')),
    K("plot/record-without-aggregates", "plot", REC, setup=record(REC, _drop_aggregates)),
    K("plot/record-mistyped-counts", "plot", REC, setup=record(REC, _aggregates_mistyped)),
    K("plot/empty-folder", "plot", "empty", setup=mkdir("empty")),
    K("plot/out-is-file", "plot", REC, "-o", "afile", setup=chain(record(REC), mkfile("afile"))),
    K("plot/out-under-file", "plot", REC, "-o", "afile/figs", setup=chain(record(REC), mkfile("afile"))),
    K("plot/out-proc", "plot", REC, "-o", "/proc/x", setup=record(REC)),
    K("plot/unknown-flag", "plot", "--nosuch", REC, setup=record(REC)),
    K("plot/no-args", "plot"),
    # ------------------------------------------------------------------ kvnotes report
    K("report/missing-root", "report", "/no/such/runs", "-o", "site"),
    K("report/empty-root", "report", "empty", "-o", "site", setup=mkdir("empty")),
    K("report/root-is-file", "report", "afile", "-o", "site", setup=mkfile("afile")),
    K("report/truncated-record", "report", "runs", "-o", "site", setup=record("runs/x/record.json", truncate=True)),
    K("report/json-not-record", "report", "runs", "-o", "site", setup=mkfile("runs/x/record.json", '{"a": 1}')),
    K("report/record-without-aggregates", "report", "runs", "-o", "site", setup=record("runs/x/record.json", _drop_aggregates)),
    K("report/record-mistyped-counts", "report", "runs", "-o", "site",
      setup=record("runs/x/record.json", _aggregates_mistyped)),
    K("report/out-is-file", "report", "runs", "-o", "afile",
      setup=chain(record("runs/x/record.json"), mkfile("afile"))),
    K("report/out-under-file", "report", "runs", "-o", "afile/site",
      setup=chain(record("runs/x/record.json"), mkfile("afile"))),
    K("report/out-proc", "report", "runs", "-o", "/proc/x", setup=record("runs/x/record.json")),
    K("report/unknown-flag", "report", "--nosuch", "runs", setup=record("runs/x/record.json")),
    K("report/no-args", "report"),
    # ------------------------------------------------------------------ kvnotes battery
    K("battery/unknown-model", "battery", "--model", "nosuch"),
    K("battery/unknown-scenario", "battery", "--scenario", "nosuch"),
    K("battery/unknown-probe", "battery", "--probes", "nosuch"),
    K("battery/override-in-probes", "battery", "--probes", "screen", "min_effect=2"),
    K("battery/unknown-probe-prefix", "battery", "nosuch:probe.ks=[1]"),
    K("battery/misspelt-override", "battery", "min_efect=2"),
    K("battery/bad-override-value", "battery", "scenario.n_instances=0"),
    K("battery/json-proc", "battery", "--json", "/proc/x.json"),
    K("battery/json-under-file", "battery", "--json", "afile/x.json", setup=mkfile("afile")),
    K("battery/json-is-dir", "battery", "--json", "adir", setup=mkdir("adir")),
    K("battery/records-is-file", "battery", "--records", "afile", setup=mkfile("afile")),
    K("battery/records-under-file", "battery", "--records", "afile/runs", setup=mkfile("afile")),
    K("battery/compare-missing", "battery", "--records", "runs", "--compare", "/no/such/dir"),
    K("battery/compare-without-records", "battery", "--compare", "old", setup=mkdir("old")),
    K("battery/compare-with-lengths", "battery", "--records", "runs", "--compare", "old", "--lengths", "256,512",
      setup=mkdir("old")),
    K("battery/threads-zero", "battery", "--threads", "0"),
    K("battery/threads-word", "battery", "--threads", "two"),
    K("battery/lengths-word", "battery", "--lengths", "abc"),
    K("battery/lengths-small", "battery", "--lengths", "8"),
    K("battery/lengths-empty", "battery", "--lengths", ","),
    K("battery/clean-runs-mb-negative", "battery", "--clean-runs-mb", "-1"),
    K("battery/device-tpu", "battery", "--device", "tpu"),
    K("battery/config-dir-missing", "battery", "--config-dir", "/no/such/dir"),
    K("battery/KVNOTES_CACHE-file", "battery", setup=mkfile("afile"), env={"KVNOTES_CACHE": "{cwd}/afile"}),
    # ------------------------------------------------------------------ kvnotes bench NAME
    K("bench/probes-n-pairs-zero", "bench", "probes", "--n-pairs", "0"),
    K("bench/probes-budget-zero", "bench", "probes", "--budget-mb", "0"),
    K("bench/probes-min-time-negative", "bench", "probes", "--min-time", "-1"),
    K("bench/probes-model-unknown", "bench", "probes", "--model", "nosuch"),
    K("bench/probes-dtype", "bench", "probes", "--dtype", "int4"),
    K("bench/probes-prompt-len", "bench", "probes", "--prompt-len", "1"),
    K("bench/probes-turns-negative", "bench", "probes", "--turns", "-1"),
    K("bench/probes-random-init-unknown", "bench", "probes", "--random-init", "nosuch"),
    K("bench/probes-turns-and-random-init", "bench", "probes", "--turns", "2", "--random-init", "smollm2-135m"),
    K("bench/probes-threads-zero", "bench", "probes", "--threads", "0"),
    K("bench/probes-device-tpu", "bench", "probes", "--device", "tpu"),
    K("bench/probes-json-proc", "bench", "probes", "--json", "/proc/x.json"),
    K("bench/circuits-repeats-zero", "bench", "circuits", "--repeats", "0"),
    K("bench/circuits-chunk-word", "bench", "circuits", "--chunk", "abc"),
    K("bench/circuits-model-unknown", "bench", "circuits", "--model", "nosuch"),
    K("bench/circuits-json-under-file", "bench", "circuits", "--json", "afile/x.json", setup=mkfile("afile")),
    K("bench/edit-lengths-zero", "bench", "edit", "--lengths", "0"),
    K("bench/edit-ks-zero", "bench", "edit", "--ks", "0"),
    K("bench/edit-rankings", "bench", "edit", "--rankings", "magic"),
    K("bench/edit-trials-zero", "bench", "edit", "--trials", "0"),
    K("bench/edit-warmup-negative", "bench", "edit", "--warmup", "-1"),
    K("bench/edit-device-cuda", "bench", "edit", "--device", "cuda"),
    K("bench/compose-lengths-short", "bench", "compose", "--lengths", "50"),
    K("bench/compose-prefix-zero", "bench", "compose", "--prefix", "0"),
    K("bench/compose-seam-negative", "bench", "compose", "--seam", "-1"),
    K("bench/compose-grids", "bench", "compose", "--image", "--grids", "1x2"),
    K("bench/compose-vlm-unknown", "bench", "compose", "--image", "--vlm", "nosuch"),
    K("bench/compose-json-dir", "bench", "compose", "--json", "adir", setup=mkdir("adir")),
    K("bench/compose-plot-no-out", "bench", "compose-plot", "in.json", setup=mkfile("in.json", "{}")),
    K("bench/compose-plot-out-proc", "bench", "compose-plot", "--out", "/proc/x.png", "in.json",
      setup=mkfile("in.json", "{}")),
    K("bench/compose-plot-input-missing", "bench", "compose-plot", "--out", "fig.png", "/no/such.json"),
    K("bench/compose-plot-input-not-json", "bench", "compose-plot", "--out", "fig.png", "in.json",
      setup=mkfile("in.json", "not json")),
    K("bench/compose-plot-input-wrong-json", "bench", "compose-plot", "--out", "fig.png", "in.json",
      setup=mkfile("in.json", '{"header": "x", "rows": []}')),
    K("bench/compose-gpu-no-cuda", "bench", "compose-gpu"),
    K("bench/compose-gpu-lengths-short", "bench", "compose-gpu", "--lengths", "10"),
    K("bench/generate-prompt-len", "bench", "generate", "--prompt-len", "1"),
    K("bench/generate-variants-zero", "bench", "generate", "--variants", "0"),
    K("bench/generate-new-tokens-zero", "bench", "generate", "--new-tokens", "0"),
    K("bench/generate-dtype", "bench", "generate", "--dtype", "int4"),
    K("bench/generate-random-init-unknown", "bench", "generate", "--random-init", "nosuch"),
    K("bench/linear-rows-zero", "bench", "linear", "--rows", "0"),
    K("bench/linear-min-run-time-zero", "bench", "linear", "--min-run-time", "0"),
    K("bench/linear-device-cuda", "bench", "linear", "--device", "cuda"),
    K("bench/auto-checks", "bench", "auto", "--checks", "bogus"),
    K("bench/auto-from-json-missing", "bench", "auto", "--from-json", "/no/such.json"),
    K("bench/auto-from-json-not-json", "bench", "auto", "--from-json", "in.json", setup=mkfile("in.json", "nope")),
    K("bench/auto-from-json-empty-object", "bench", "auto", "--from-json", "in.json", setup=mkfile("in.json", "{}")),
    K("bench/auto-from-json-bad-rows", "bench", "auto", "--from-json", "in.json", setup=mkfile("in.json", AUTO_JSON_BAD_ROWS)),
    K("bench/auto-n-instances-zero", "bench", "auto", "--n-instances", "0"),
    K("bench/auto-max-pairs-zero", "bench", "auto", "--max-pairs", "0"),
    K("bench/auto-scenario-unknown", "bench", "auto", "--scenario", "nosuch"),
    K("bench/auto-scenario-transcript", "bench", "auto", "--scenario", "long"),
    K("bench/auto-alphas-not-planted", "bench", "auto", "--alphas", "0.3"),
    K("bench/auto-alphas-half", "bench", "auto", "--model", "planted-mixed", "--alphas", "0.5"),
    K("bench/auto-alphas-out-of-range", "bench", "auto", "--model", "planted-mixed", "--alphas", "1.5"),
    K("bench/auto-margins-word", "bench", "auto", "--margins", "abc"),
    K("bench/auto-json-proc", "bench", "auto", "--json", "/proc/x.json"),
    # ------------------------------------------------------------------ kvnotes ownership-scan
    K("ownership/missing-path", "ownership-scan", "/no/such/suite"),
    K("ownership/model-unknown", "ownership-scan", "--model", "nosuch", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/json-proc", "ownership-scan", "--json", "/proc/x.json", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/n-instances-zero", "ownership-scan", "--n-instances", "0", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/seed-negative", "ownership-scan", "--seed", "-1", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/variant-unknown", "ownership-scan", "--variant", "foo", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/variant-cot-absent", "ownership-scan", "--variant", "cot", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/min-effect-negative", "ownership-scan", "--min-effect", "-1", "suite", setup=suite(**{"a.yaml": SCENARIO})),
    K("ownership/out-root-file", "ownership-scan", "--out-root", "afile", "suite",
      setup=chain(mkfile("afile"), suite(**{"a.yaml": SCENARIO}))),
    K("ownership/bad-scenario-file", "ownership-scan", "suite", setup=suite(**{"a.yaml": SCENARIO + "family: x\n"})),
    K("ownership/no-args", "ownership-scan"),
    K("ownership/KVNOTES_CACHE-file", "ownership-scan", "suite", setup=chain(mkfile("afile"), suite(**{"a.yaml": SCENARIO})),
      env={"KVNOTES_CACHE": "{cwd}/afile"}),
    # ------------------------------------------------------------------ kvnotes locomo
    K("locomo/no-data", "locomo"),
    K("locomo/data-missing", "locomo", "--data", "/no/such.json"),
    K("locomo/data-not-json", "locomo", "--data", "lc.json", setup=mkfile("lc.json", "not json")),
    K("locomo/data-object", "locomo", "--data", "lc.json", setup=mkfile("lc.json", '{"a": 1}')),
    K("locomo/data-empty-list", "locomo", "--data", "lc.json", setup=mkfile("lc.json", "[]")),
    K("locomo/data-no-sessions", "locomo", "--data", "lc.json", setup=mkfile("lc.json", LOCOMO_OK_SHAPE)),
    K("locomo/data-is-dir", "locomo", "--data", "adir", setup=mkdir("adir")),
    K("locomo/model-unknown", "locomo", "--data", "lc.json", "--model", "nosuch", setup=mkfile("lc.json", "[]")),
    K("locomo/max-questions-zero", "locomo", "--data", "lc.json", "--max-questions", "0", setup=mkfile("lc.json", "[]")),
    K("locomo/categories-words", "locomo", "--data", "lc.json", "--categories", "a,b", setup=mkfile("lc.json", "[]")),
    K("locomo/margin-zero", "locomo", "--data", "lc.json", "--margin", "0", setup=mkfile("lc.json", "[]")),
    K("locomo/seam-negative", "locomo", "--data", "lc.json", "--seam", "-1", setup=mkfile("lc.json", "[]")),
    K("locomo/out-root-file", "locomo", "--data", "lc.json", "--out-root", "afile",
      setup=chain(mkfile("afile"), mkfile("lc.json", "[]"))),
    K("locomo/json-proc", "locomo", "--data", "lc.json", "--json", "/proc/x.json", setup=mkfile("lc.json", "[]")),
    # ------------------------------------------------------------------ kvnotes serve-bench
    K("serve/out-root-under-file", "serve-bench", "--out-root", "afile/serving", setup=mkfile("afile")),
    K("serve/store-file", "serve-bench", "--store", "afile", setup=mkfile("afile")),
    K("serve/sessions-zero", "serve-bench", "--sessions", "0"),
    K("serve/time-limit-zero", "serve-bench", "--time-limit", "0"),
    K("serve/chunk-tokens-small", "serve-bench", "--chunk-tokens", "4"),
    K("serve/reference-unknown", "serve-bench", "--reference", "foo"),
    K("serve/model-unknown", "serve-bench", "--model", "nosuch"),
]


# --------------------------------------------------------------------------------------------- running a case

#: stderr lines that are progress bars (tqdm, transformers' ``Loading weights``), not messages
PROGRESS = re.compile(r"\d+%\|.*\||^Loading (weights|checkpoint shards)\b|\[\d+:\d+<[\d:?]+")
ARGPARSE_ERROR = re.compile(r"^\S.*: error: ")
#: third-party caches a library makes in TMPDIR on import (torch's compile cache), not outputs of the command
TMP_CACHES = re.compile(r"^torchinductor_[^/]*(/|$)")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under ``root`` (relative path -> kind, and a file's size and mtime)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = Path(dirpath, d)
            out[str(p.relative_to(root)) + "/"] = ("link",) if p.is_symlink() else ("dir",)
        for f in filenames:
            p = Path(dirpath, f)
            st = p.lstat()
            out[str(p.relative_to(root))] = ("file", st.st_size, st.st_mtime_ns)
    return out


@dataclass
class Outcome:
    case: Case
    ok: bool
    argparse_form: bool          # failed the one-line rule only by argparse's usage + 'prog: error:' form
    rc: int | None
    first: str
    problems: list[str]
    stderr_lines: list[str]
    seconds: float


def stderr_lines(text: str) -> list[str]:
    """stderr split on newlines and carriage returns, blank lines and progress bars dropped."""
    return [ln.rstrip() for ln in re.split(r"[\r\n]+", text) if ln.strip() and not PROGRESS.search(ln)]


def run_case(case: Case) -> Outcome:
    root = Path(tempfile.mkdtemp(prefix="kvnotes-sweep-"))
    cwd, tmp = root / "work", root / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    if case.setup is not None:
        case.setup(cwd)
    before = snapshot(cwd)
    argv = [a.replace("{cwd}", str(cwd)) for a in case.argv]
    head = [sys.executable, str(RUN_PY)] if argv[0] == "run.py" else [sys.executable, "-m", "kvnotes"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"} \
        | {k: v.replace("{cwd}", str(cwd)) for k, v in case.env.items()}
    t0 = time.perf_counter()
    proc = subprocess.Popen([*head, *argv[1:]], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)        # the process group this case started
        stdout, stderr = proc.communicate()
        rc = None
    seconds = time.perf_counter() - t0
    after = snapshot(cwd)
    left_tmp = sorted(k for k in snapshot(tmp) if not TMP_CACHES.match(k))
    problems: list[str] = []
    lines = stderr_lines(stderr)
    errors = [ln for ln in lines if ln.startswith("kvnotes: error:")]
    others = [ln for ln in lines if not ln.startswith("kvnotes: error:")]
    if rc is None:
        problems.append(f"timed out after {TIMEOUT_S} s")
    elif rc != 2:
        problems.append(f"exit status {rc}, not 2")
    if "Traceback" in stderr:
        problems.append("a traceback on stderr")
    usage_only = case.usage_ok and not lines and stdout.lstrip().startswith("usage:")
    if not usage_only:
        if len(errors) != 1:
            problems.append(f"{len(errors)} 'kvnotes: error:' lines, not 1")
        if others:
            problems.append(f"{len(others)} other stderr line(s)")
    new = sorted(set(after) - set(before))
    gone = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    if new:
        problems.append(f"left behind: {', '.join(new[:6])}{' ...' if len(new) > 6 else ''}")
    if changed:
        problems.append(f"changed: {', '.join(changed[:6])}")
    if gone:
        problems.append(f"removed setup entries: {', '.join(gone[:6])}")
    if left_tmp:
        problems.append(f"left in TMPDIR: {', '.join(left_tmp[:6])}{' ...' if len(left_tmp) > 6 else ''}")
    # argparse's own error form: usage lines, then '<prog>: error: <message>', exit 2, nothing else wrong
    argparse_form = (bool(problems) and rc == 2 and not errors and bool(lines)
                     and ARGPARSE_ERROR.match(lines[-1]) is not None and lines[0].startswith("usage:")
                     and "Traceback" not in stderr and not (new or changed or gone or left_tmp))
    shutil.rmtree(root, ignore_errors=True)
    first = lines[0] if lines else ("(usage on stdout)" if usage_only else "(no stderr)")
    if argparse_form:
        first = lines[-1]
    return Outcome(case, not problems, argparse_form, rc, first, problems, lines, seconds)


def entry_point(case: Case) -> str:
    if case.argv[0] == "run.py":
        return "run.py"
    if len(case.argv) < 2:
        return "kvnotes"
    if case.argv[1] == "bench":
        return f"kvnotes bench {case.argv[2]}" if len(case.argv) > 2 and not case.argv[2].startswith("-") \
            and case.argv[2] in BENCH_NAMES else "kvnotes"
    known = {"run", "table", "plot", "report", "battery", "serve-bench", "ownership-scan", "locomo"}
    return f"kvnotes {case.argv[1]}" if case.argv[1] in known else "kvnotes"


BENCH_NAMES = ("probes", "circuits", "edit", "compose", "compose-plot", "compose-gpu", "generate", "linear", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="SUBSTRING", help="run the cases whose name or command contains this")
    ap.add_argument("--list", action="store_true", help="list the cases (name, command) and exit")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1: sequential)")
    ap.add_argument("--argparse-ok", action="store_true",
                    help="accept argparse's own flag errors (usage lines + '<prog>: error: ...', exit 2)")
    ap.add_argument("--verbose", action="store_true", help="every stderr line of a failing case")
    args = ap.parse_args()
    names = [c.name for c in CASES]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        sys.exit(f"bad_input_sweep: duplicate case names: {', '.join(sorted(dup))}")
    cases = [c for c in CASES if not args.only or args.only in c.name or args.only in c.command()]
    if args.list:
        counts: dict[str, int] = {}
        for c in cases:
            print(f"{c.name:50s} {c.command()}{'   [loads a model]' if c.loads_model else ''}")
            counts[entry_point(c)] = counts.get(entry_point(c), 0) + 1
        print(f"\n{len(cases)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return
    if not cases:
        sys.exit(f"bad_input_sweep: no case matches '{args.only}'")
    t0 = time.perf_counter()
    results: list[Outcome] = []

    def report(o: Outcome) -> None:
        passed = o.ok or (args.argparse_ok and o.argparse_form)
        tag = "ok" if o.ok else ("ok (argparse)" if passed else "FAIL")
        print(f"{tag:4s} {o.case.name}: {o.case.command()}  [{o.seconds:.1f}s]\n     {o.first}", flush=True)
        if not passed:
            print(f"     rc={o.rc}; " + "; ".join(o.problems), flush=True)
            shown = o.stderr_lines if args.verbose else o.stderr_lines[-4:]
            for ln in shown:
                print(f"     | {ln[:300]}", flush=True)

    if args.jobs <= 1:
        for c in cases:
            o = run_case(c)
            results.append(o)
            report(o)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for o in pool.map(run_case, cases):
                results.append(o)
                report(o)
    if "root" in _FIXTURE:
        shutil.rmtree(_FIXTURE["root"], ignore_errors=True)
    passed = [o for o in results if o.ok or (args.argparse_ok and o.argparse_form)]
    failed = [o for o in results if o not in passed]
    print()
    if failed:
        print("failed:")
        for o in failed:
            print(f"  {o.case.name}: {o.case.command()}" + ("   (argparse's usage + error form)" if o.argparse_form else ""))
    print(f"{len(passed)} passed, {len(failed)} failed ({time.perf_counter() - t0:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
