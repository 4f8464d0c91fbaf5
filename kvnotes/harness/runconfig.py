"""The typed run configuration and a record's identity.

:class:`RunSettings` (pydantic) types every top-level key of ``conf/config.yaml``, the model keys
of ``conf/model/_base.yaml`` and the scenario keys (:class:`ScenarioSettings`); :func:`check_run_config` validates a composed config with it and with
the probe's own ``Config`` dataclass, and checks what can be checked before a model loads (the
device exists, the device map and quantization can run here, ``out_root`` is writable, the scenario
paths exist). Every failure is a :class:`kvnotes.errors.KvnotesError` with a one-line message.

A record belongs to the config that produced it: :func:`identity` is the resolved config minus the
keys that cannot change a result (:data:`NON_RESULT_KEYS`), and :func:`identity_diff` names the
keys in which two configs differ. ``run.py`` reuses a complete record only when its identity equals
the requested one (docs/design.md, "Records").
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvnotes import existing_ancestor, try_new_entry
from kvnotes.errors import KvnotesError
from kvnotes.records.store import NON_RESULT_KEYS
from kvnotes.scenarios.errors import ScenarioError

#: Exceptions reported as ``kvnotes: error: <message>`` with exit status 2.
USER_ERRORS = (KvnotesError, ScenarioError)


Dtype = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
Attention = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]


class RandomInit(BaseModel):
    """``model.random_init``: random weights from the config's ``architecture`` block."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    shrink: bool = True
    seed: int = 0
    tokenizer: str = "smollm2-135m"


class ModelSettings(BaseModel):
    """The model keys (``conf/model/_base.yaml``); entry-specific blocks (``embedded``,
    ``architecture``, ``planted``) are kept as they are. A key no loader reads is refused."""

    model_config = ConfigDict(extra="forbid")
    name: str
    hf_id: str | None = None
    revision: str | None = None
    path: str | None = None
    dtype: Dtype = "auto"
    attn_implementation: Attention = "sdpa"
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | None = None
    device_map: str | dict[str, int | str] | None = None
    max_memory: dict[str | int, str | int] | None = None
    offload_folder: str | None = None
    quantization: Literal["nf4", "int8"] | None = None
    cpu_linear: Literal["onednn", "torch"] = "onednn"
    random_init: RandomInit = Field(default_factory=RandomInit)
    #: the published config.json of the entry (:mod:`kvnotes.models.zoo`), as data
    architecture: dict[str, Any] | None = None
    #: an embedded model's packaged weights (:mod:`kvnotes.models.loading`)
    embedded: dict[str, Any] | None = None
    #: a planted model's construction (:mod:`kvnotes.models.planted`)
    planted: dict[str, Any] | None = None


class Transcript(BaseModel):
    """``scenario.transcript``: render every scenario as a multi-turn agent transcript
    (:mod:`kvnotes.scenarios.transcript`) with ``turns`` unrelated exchanges (about 120 tokens each)."""

    model_config = ConfigDict(extra="forbid")
    turns: int = Field(ge=0, le=1000)


class ScenarioSettings(BaseModel):
    """The scenario keys (``conf/scenario/default.yaml``): the one place their defaults and allowed
    values are declared (:attr:`kvnotes.harness.registry.ProbeContext.scenario` reads them). A key
    nobody reads is refused."""

    model_config = ConfigDict(extra="forbid")
    name: str = "default"
    paths: list[str] = Field(default_factory=list)
    families: list[str] | None = None
    ids: list[str] | None = None
    n_instances: int = Field(default=4, ge=1)
    seed: int = Field(default=0, ge=0)
    variant: Literal["direct", "cot"] = "direct"
    field_placement: Literal["first", "after_filler", "before_request"] = "first"
    chat_template: bool = True
    transcript: Transcript | None = None
    memory: str | None = None
    locomo: str | None = None


class RunSettings(BaseModel):
    """The top-level keys of ``conf/config.yaml`` (the ``probe`` group is typed by the probe's
    ``Config``, the scenario files by the scenario loader). A key nobody reads (``+min_efect=2``) is
    refused, naming the nearest known key."""

    model_config = ConfigDict(extra="forbid")
    out_root: str
    device: str = "auto"
    seed: int = Field(default=0, ge=0)
    force: bool = False
    plot: bool = True
    readout: Literal["first_token", "full"] = "first_token"
    flip_rule: Literal["owned", "relative", "synthetic"] = "owned"
    min_effect: float = Field(1.0, ge=0.0)
    budget_mb: float | Literal["auto"] = "auto"
    model: ModelSettings
    scenario: ScenarioSettings = Field(default_factory=ScenarioSettings)
    #: typed by the probe's own ``Config`` (:func:`kvnotes.harness.registry.typed_config`)
    probe: dict[str, Any] = Field(default_factory=dict)

    @field_validator("min_effect")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("budget_mb", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> float | str:
        if v == "auto":
            return v
        try:
            mb = float(v)
        except (TypeError, ValueError):
            mb = float("nan")
        if not (math.isfinite(mb) and mb > 0):
            raise ValueError("must be auto or a positive number of MiB (greater than 0)")
        return mb


def nearest_key(key: str, known: list[str]) -> str | None:
    """The known key closest in spelling to ``key`` (:func:`difflib.get_close_matches`), or None."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return close[0] if close else None


def known_keys(loc: tuple) -> list[str]:
    """The declared keys of the settings model at ``loc`` (the path of an unknown key's parent)."""
    model: Any = RunSettings
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, BaseModel) else None
        ann = getattr(field, "annotation", None)
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)),
                     None)
        if model is None:
            return []
    return list(model.model_fields)


def _one_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    got = err.get("input")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    if err["type"] == "extra_forbidden":
        parent = err["loc"][:-1]
        near = nearest_key(str(err["loc"][-1]), known_keys(parent))
        prefix = ".".join(str(p) for p in parent)
        hint = f"; did you mean {prefix + '.' if prefix else ''}{near}?" if near else ""
        return f"unknown key '{key}': no part of kvnotes reads it{hint}{more}"
    shown = repr(got) if len(repr(got)) <= 80 else f"{repr(got)[:77]}..."     # not a whole config group
    return f"{key}: {err['msg'].rstrip('.')}, got {shown}{more}"


def typed(cfg: Any) -> RunSettings:
    """The run config as :class:`RunSettings`.

    Raises:
        KvnotesError: a value of the wrong type or outside its allowed values (the first error,
            with its dotted key and the given value).
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    except OmegaConfBaseException as exc:                 # an interpolation that does not resolve
        key = getattr(exc, "full_key", None)
        raise KvnotesError(f"{key + ': ' if key else ''}cannot resolve the config: "
                           f"{str(exc).splitlines()[0]}") from None
    try:
        return RunSettings.model_validate(data)
    except ValidationError as exc:
        raise KvnotesError(_one_line(exc)) from None


def check_out_root(out_root: str) -> None:
    """``out_root`` can hold records: it is a folder, or can be made one, in which a file can be
    written. Nothing is created: the write test runs in the nearest folder that exists (a refused
    run leaves no empty ``out_root`` behind).

    Raises:
        KvnotesError: empty, the file system's root, an existing file, under a file, or not writable.
    """
    if not str(out_root).strip():
        raise KvnotesError("out_root is empty: name the folder the records go to (e.g. out_root=runs)")
    root = Path(os.path.abspath(os.path.expanduser(str(out_root))))
    if root == root.parent:
        raise KvnotesError(f"out_root={out_root} is the file system's root: name a folder for the records "
                           f"(e.g. out_root=runs)")
    base = existing_ancestor(root)
    if not base.is_dir():
        where = "is a file" if base == root else f"is under a file ({base})"
        raise KvnotesError(f"out_root={out_root} {where}: name a folder for the records")
    try:
        try_new_entry(base, directory=True)         # the folders a job makes
    except OSError as exc:
        raise KvnotesError(f"out_root={out_root} is not writable ({exc.strerror or type(exc).__name__})") from None


def check_model_path(model: ModelSettings) -> None:
    """``model.path``, when set, is a checkpoint directory the model is loaded from (an embedded
    entry's own weights are then not used) and cannot be combined with random weights.

    Raises:
        KvnotesError: random weights asked for too, the path has no ``config.json``, or its
            ``model_type`` (or its ``text_config``'s) is not the entry's ``architecture.model_type``
            (a record named after one model computed on another).
    """
    if not model.path:
        return
    if model.random_init.enabled:
        raise KvnotesError(f"model.path={model.path} and model.random_init.enabled=true exclude each other "
                           f"(a checkpoint or random weights)")
    path = Path(os.path.expanduser(model.path))
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise KvnotesError(f"model.path={model.path} {what}: give a checkpoint directory (config.json, "
                           f"weights, tokenizer)")
    expected = (model.architecture or {}).get("model_type")
    if not expected:                      # an entry without a published architecture: nothing to hold it to
        return
    try:
        found = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise KvnotesError(f"model.path={model.path}: config.json is not readable JSON ({exc})") from None
    types = {found.get("model_type"), (found.get("text_config") or {}).get("model_type")} - {None}
    if expected not in types:
        raise KvnotesError(f"model.path={model.path} holds a {found.get('model_type') or 'checkpoint without model_type'} "
                           f"checkpoint, but model={model.name} is {expected}: the record would carry the wrong "
                           f"name; choose the model entry of that architecture, write your own conf/model entry, or add "
                           f"model.architecture=null to run it under this entry's name")


def check_run_config(cfg: Any, machine: bool = True) -> RunSettings:
    """Everything about a composed run config that can be checked before a model loads.

    Checks: :func:`typed` (and ``flip_rule=synthetic`` only with ``model.random_init``); ``model.path``
    (:func:`check_model_path`); the probe's
    keys, types and allowed values (``registry.typed_config``), that it can read the prompt variant
    (``registry.check_variant``), its own checks of the run settings (``registry.check_run``: a split
    needs two instances), that a pair probe has scenario paths; every scenario file is valid (:func:`check_scenario_files`); the device exists
    (:func:`kvnotes.models.loading.resolve_device`); the model's device map and quantization can run on it
    (:func:`kvnotes.models.placement.placement_kwargs`); ``out_root`` is writable; every scenario path exists.
    With ``machine=False`` (a job that will run elsewhere, e.g. submitted to SLURM from a login node
    without GPUs) the device and quantization checks are left to the job itself.

    Raises:
        KvnotesError, ScenarioError: the first problem, in one line.
    """
    from kvnotes.harness import registry
    from kvnotes.models.loading import cache_dir, resolve_device, resolve_dtype
    from kvnotes.models.placement import placement_kwargs
    from kvnotes.harness.readout import check_flip_rule
    from kvnotes.scenarios.schema import resolve_path

    settings = typed(cfg)
    cache_dir()                              # a KVNOTES_CACHE that names a file, before anything is cached
    check_flip_rule(settings.flip_rule, settings.model.random_init.enabled, settings.model.name)
    check_model_path(settings.model)
    probe_cfg = registry.typed_config(cfg.probe)
    registry.check_variant(probe_cfg, settings.scenario.variant, bool(settings.model.thinking))
    registry.check_run(probe_cfg, settings)              # the probe's own checks of the run (its split's instances)
    if probe_cfg.pairs != "none" and not settings.scenario.paths:
        raise ScenarioError(f"scenario.paths is empty: probe {probe_cfg.name} runs on a scenario suite's pairs; "
                            f"name at least one suite folder or file (e.g. scenario=default)")
    if machine:
        dev = resolve_device(settings.device)
        placement_kwargs(cfg.model, dev, resolve_dtype(settings.model.dtype, dev))
    check_out_root(settings.out_root)
    for entry in cfg.scenario.get("paths") or ():
        if not resolve_path(str(entry)).exists():
            raise ScenarioError(f"scenario path not found: {entry}")
    check_scenario_files(settings.scenario)
    return settings


def check_scenario_files(scenario: ScenarioSettings) -> None:
    """Every scenario file the run reads is valid, before any model loads: the suite under
    ``scenario.paths`` (with its ``families`` / ``ids`` selection), the memory suite
    ``scenario.memory`` and the LoCoMo file ``scenario.locomo``.

    Raises:
        ScenarioError: the first invalid file, naming file and key (or an empty selection).
    """
    from kvnotes.scenarios.memory import load_memory
    from kvnotes.scenarios.schema import load_suite

    from kvnotes.harness.inputs import scenario_files

    files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for _, p in scenario_files(scenario.model_dump()))
    key = (files, tuple(scenario.paths), None if scenario.families is None else tuple(scenario.families),
           None if scenario.ids is None else tuple(scenario.ids), scenario.memory,
           scenario.locomo)
    if key in _CHECKED_SCENARIOS:            # a sweep's points share their files: each set is read once
        check_pair_count(scenario, _CHECKED_SCENARIOS[key])
        return
    per_instance = 0
    if scenario.paths:
        per_instance = sum(len(sc.pairs) for sc in load_suite(scenario.paths, scenario.families, scenario.ids))
        check_pair_count(scenario, per_instance)
    if scenario.memory:
        load_memory(scenario.memory)
    if scenario.locomo:
        from kvnotes.scenarios.locomo import load_locomo
        from kvnotes.scenarios.schema import resolve_path

        load_locomo(resolve_path(scenario.locomo))
    _CHECKED_SCENARIOS[key] = per_instance


#: Memory one prepared pair holds (token ids, spans, texts of both prompts): 10.6 KB measured on the
#: default suite with the SmolLM2 tokenizer (``prepare_for_probe``, 2,200 pairs), with headroom for
#: longer prompts. The probe's own buffers come on top.
PAIR_BYTES = 16 * 1024


def check_pair_count(scenario: ScenarioSettings, per_instance: int) -> int:
    """The number of pairs ``scenario.n_instances`` instances make (``per_instance`` pairs an
    instance, over the selected scenarios), refused when
    preparing them alone could not fit in this machine's available memory (:data:`PAIR_BYTES` a
    pair), before a model loads.

    Raises:
        KvnotesError: the estimate exceeds the available memory (the message gives both).
    """
    import psutil

    n_pairs = scenario.n_instances * per_instance
    need, have = n_pairs * PAIR_BYTES, psutil.virtual_memory().available
    if need > have:
        raise KvnotesError(f"scenario.n_instances={scenario.n_instances} makes {n_pairs:,} pairs "
                           f"({per_instance} an instance): preparing them needs about {need / 2**30:,.1f} GiB "
                           f"({PAIR_BYTES // 1024} KiB a pair) and this machine has {have / 2**30:.1f} GiB available; "
                           f"lower scenario.n_instances")
    return n_pairs


#: Scenario file sets :func:`check_scenario_files` found valid in this process, keyed by each file's
#: path, size and modification time (an edited file is checked again), with their pairs an instance
#: (the instance count is checked on every call: it is not part of the key).
_CHECKED_SCENARIOS: dict[tuple, int] = {}


def _drop(tree: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for p in parents:
        node = node.get(p)
        if not isinstance(node, dict):
            return
    node.pop(last, None)


def identity(config: dict) -> dict:
    """A resolved config (as a JSON-able dict, e.g. a record's ``config``) without
    :data:`NON_RESULT_KEYS`, normalised through JSON."""
    out = json.loads(json.dumps(config, sort_keys=True, default=str))
    for key in NON_RESULT_KEYS:
        _drop(out, key)
    return out


def identity_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys in which two identities differ (missing on one side counts), sorted."""
    out = []
    for key in sorted(set(a) | set(b)):
        path = f"{prefix}{key}"
        va, vb = a.get(key, "<missing>"), b.get(key, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += identity_diff(va, vb, path + ".")
        elif va != vb:
            out.append(path)
    return out
