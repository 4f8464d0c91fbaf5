"""The probe registry and the context a probe gets: probes are found from their config.

A probe is one module with ``run(ctx: ProbeContext) -> dict`` and a ``Config`` dataclass of its
keys (a subclass of :class:`kvnotes.harness.kit.ProbeConfig`), plus one config file
``conf/probe/<name>.yaml`` whose ``_target_`` names the run function (``probes.<name>.run``, or
any importable module: ``circuits.<name>.run``, ``mypackage.myprobe.run``). The ``Config`` holds
the keys' defaults (shared keys ``progress``, ``n_boot``, ``pairs`` on ``ProbeConfig``); Hydra composes
a run from it (:func:`register_schemas`) and the YAML sets only what differs. Probes never load models
or write files: ``run.py`` hands them a loaded model and token-aligned pairs and serialises the
returned result (``rows``, ``aggregates``, ``exclusions`` and probe-specific keys) into a record.
See ``docs/adding_a_probe.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from kvnotes import CONF_DIR as _CONF
from kvnotes.kv.cache import DEFAULT_BUDGET_BYTES
from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import check_values
from kvnotes.harness.kit import CleanRuns, ProbeConfig, config_value
from kvnotes.models.loading import ModelBundle
from kvnotes.harness.pairs import PairSet
from kvnotes.harness.readout import check_flip_rule
from kvnotes.harness.runconfig import RunSettings, ScenarioSettings, typed
from kvnotes.records.store import Timer

#: The probe config group.
CONF_DIR = _CONF / "probe"


def names() -> list[str]:
    """Registered probe names: the config files of ``conf/probe`` (``_base`` excluded)."""
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def load_config(name: str, overrides: dict | None = None) -> ProbeConfig:
    """The typed config of probe ``name``: its ``Config`` dataclass's defaults, then what
    ``conf/probe/<name>.yaml`` sets, then ``overrides`` (:func:`typed_config`).

    Raises:
        KvnotesError: no probe of that name, or a key the probe does not declare.
    """
    path = CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise KvnotesError(f"unknown probe '{name}' (known: {', '.join(names())})")
    return typed_config(OmegaConf.merge(OmegaConf.load(path), overrides or {}))


#: The ConfigStore group of the probes' schemas: a probe's YAML starts from its ``Config`` with
#: ``defaults: [schema@_here_: <name>, _self_]`` and sets only what differs (:func:`register_schemas`).
SCHEMA_GROUP = "probe/schema"


#: The schemas :func:`register_schemas` gave Hydra, by probe name.
_REGISTERED: dict[str, type] = {}


def _with_bases(names: set[str], folders: Sequence[Path]) -> set[str]:
    """``names`` and every probe config their YAMLs build on through ``defaults`` (a user's
    ``my_screen.yaml`` may start from ``screen``, whose own YAML starts from its schema), transitively."""
    todo, out = list(names), set(names)
    while todo:
        name = todo.pop()
        for folder in folders:
            path = Path(folder) / f"{name}.yaml"
            if not path.is_file():
                continue
            for entry in OmegaConf.load(path).get("defaults", []):
                if isinstance(entry, str) and entry not in ("_self_", *out) and not entry.startswith("_"):
                    out.add(entry)
                    todo.append(entry)
    return out


def declared_probe_keys() -> list[str]:
    """Every top-level key any registered probe ``Config`` declares (:func:`register_schemas`),
    sorted: what an unknown ``probe.<key>`` is matched against for a suggestion."""
    return sorted({f.name for schema in _REGISTERED.values() for f in dataclasses.fields(schema)})


def register_schemas(config_dirs: Sequence[str | Path] = (), names: Collection[str] | None = None) -> list[str]:
    """Register each probe's ``Config`` dataclass with Hydra's ConfigStore, as ``probe/schema/<name>``
    (and :class:`kvnotes.harness.kit.ProbeConfig` as ``probe/_base``, the shared keys), so the
    dataclass is the one source of a probe's keys and defaults when Hydra composes a run: the YAML
    holds only what differs, and every declared key can be overridden (``probe.cot_max_pairs=1``)
    although the YAML does not list it. Covers the probes of ``conf/probe`` and of each user config
    folder's ``probe/`` (``--config-dir``), or only ``names`` (importing every probe module costs
    seconds; a command composes the probes it names); a probe whose module cannot be imported is
    skipped (its own config then fails to compose, naming it). Call before composing.

    Returns:
        the names registered.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    # the shared keys as a plain node: a user's YAML that starts from ``_base`` adds keys of its own
    store.store(group="probe", name="_base", node=OmegaConf.to_container(OmegaConf.structured(ProbeConfig)))
    folders = [CONF_DIR, *(Path(d) / "probe" for d in config_dirs)]
    if names is not None:
        names = _with_bases(set(names), folders)
    done = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.yaml")):
            if path.stem.startswith("_") or (names is not None and path.stem not in names):
                continue
            try:
                schema = getattr(module(OmegaConf.load(path)), "Config", ProbeConfig)
            except Exception:  # noqa: BLE001 (an unreadable YAML or module: composing it names the problem)
                continue
            store.store(group=SCHEMA_GROUP, name=path.stem, node=schema)
            _REGISTERED[path.stem] = schema
            done.append(path.stem)
    return done


def module(cfg_or_name):
    """The module of a probe, from its config's ``_target_`` (``module.run``) or its name.

    Raises:
        KvnotesError: no such probe, or a ``_target_`` that cannot be imported or has no ``run``.
    """
    cfg = load_config(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name
    target, name = config_value(cfg, "_target_"), config_value(cfg, "name")
    if not target:
        raise KvnotesError(f"probe config '{name}' has no _target_ (module.run of the probe)")
    mod_name, _, fn = str(target).rpartition(".")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise KvnotesError(f"probe '{name}': cannot import {mod_name} ({exc})") from None
    if fn != "run" or not hasattr(mod, "run"):
        raise KvnotesError(f"probe '{name}': _target_ {target} is not a module's run function")
    return mod


def typed_config(cfg) -> ProbeConfig:
    """``cfg`` merged into its probe module's ``Config`` dataclass (``ProbeConfig`` when the module
    declares none): values are type-checked, every key must be declared, and the values must meet
    the constraints declared on the fields (:func:`kvnotes.harness.constraints.check_values`).

    Returns:
        an instance of the probe's ``Config`` (what :class:`ProbeContext` hands the probe); a config
        that is one already is returned as it is.

    Raises:
        KvnotesError: an unknown (e.g. misspelt) key, a value of the wrong type or outside its
            allowed values, in one line naming the key.
    """
    if isinstance(cfg, ProbeConfig):
        return cfg
    # Interpolations (``${oc.select:scenario.memory,...}``) resolve against the run config the probe
    # node belongs to, before the node is merged into a config of its own (where they would fall
    # back to their defaults).
    raw = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg)
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "defaults"])
    schema = getattr(module(raw), "Config", ProbeConfig)
    try:
        out = OmegaConf.merge(OmegaConf.structured(schema), raw)
    except (ConfigKeyError, ValidationError) as exc:
        known = sorted(k for k in OmegaConf.structured(schema).keys())
        msg = str(exc).splitlines()[0]
        raise KvnotesError(f"probe '{raw.get('name')}': {msg} (declared keys: {', '.join(known)})") from None
    check_values(schema, cast(dict, OmegaConf.to_container(out, resolve=True)))
    return cast(ProbeConfig, OmegaConf.to_object(out))


#: Recovery units: how far a conformance invariant's recovery may sit from its construction's value
#: on random weights (fp32 quotients of score differences of ~0.01 nats; :class:`Conformance`).
RECOVERY_TOL = 2e-3


@dataclass
class Invariants:
    """What a probe's record held on one model (:attr:`Conformance.invariants`).

    Attributes:
        what: the invariant in a few words (``"field+downstream=1"``).
        n: rows checked (0: the record had none to check).
        violations: one line per row that broke it (empty: it held).
    """

    what: str
    n: int
    violations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Conformance:
    """How the zoo conformance lane (``pytest -m zoo``: every ``conf/model`` entry on its shrunk
    random-weight model through ``run.py``'s job path) runs a probe: declared by the probe module as
    ``CONFORMANCE``; a module without one runs on every entry as configured and checks nothing of
    its own beyond its record's schema. The lane discovers these; it names no probe.

    Attributes:
        bounds: overrides bounding the probe's work there (fewer random draws, sweep points,
            seams); every method and arm still runs.
        shapes: ``"every"`` entry; ``"two"``: the lane's two cache shapes only (the Llama shape and
            Gemma-3's one KV head with sliding windows), for a probe whose own machinery other
            entries or the tiny-architecture tests already exercise (its module says which);
            ``"none"``: its data is a file the lane does not ship.
        mrope: overrides on multimodal (M-RoPE) entries, or None: not run there (their text decoder
            is one the other entries cover; what is theirs is the 3-D position bookkeeping).
        transformer_lens: also run on the TransformerLens backend (``probe.backend=transformer_lens``)
            on ``"every"`` entry that has an adapter, on the ``"two"`` shapes, or ``"none"``.
        invariants: ``record -> Invariants``: what the probe's record holds by construction on any
            architecture and any weights (recovery identities, sums that must add up).
    """

    bounds: tuple[str, ...] = ()
    shapes: Literal["every", "two", "none"] = "every"
    mrope: tuple[str, ...] | None = None
    transformer_lens: Literal["every", "two", "none"] = "none"
    invariants: Callable[[dict], Invariants] | None = None


def conformance(name: str) -> Conformance:
    """Probe ``name``'s :class:`Conformance` (its module's ``CONFORMANCE``, or the default)."""
    return getattr(module(name), "CONFORMANCE", None) or Conformance()


def flipping_rows(rec: dict) -> list[dict]:
    """The rows of a record's result whose pair flips."""
    return [r for r in rec["result"]["rows"] if r.get("flips")]


#: A probe's ``Config`` class.
C = TypeVar("C")


@dataclass
class ProbeContext(Generic[C]):
    """What a probe gets: the model, the pairs, its config, the readout definition (mode, the flip
    rule ``owned``/``relative`` and its ``min_effect`` margin; ``docs/design.md``), a seed, a stage
    timer and the memory budget (bytes) for one chunk of batched variant caches (``budget_mb`` of
    the run config). ``clean_runs`` is a :class:`kvnotes.harness.kit.CleanRuns` store shared by the
    probes of one job (``kvnotes battery``), or None: every probe prefills its pairs itself."""

    bundle: ModelBundle
    pairs: PairSet
    #: the probe's ``Config`` instance (:func:`typed_config`: a YAML node with a ``_target_`` given
    #: here is typed on construction); a probe annotates ``ctx: ProbeContext[Config]``.
    cfg: C
    readout: str = "first_token"
    min_effect: float = 1.0
    flip_rule: str = "owned"
    seed: int = 0
    timer: Timer = field(default_factory=Timer)
    scenario_cfg: Any = None
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    clean_runs: CleanRuns | None = None
    #: the model's chat-template arguments with its ``thinking`` switch applied
    #: (:func:`kvnotes.harness.pairs.template_kwargs`); what the pairs were rendered with.
    template_kwargs: dict = field(default_factory=dict)

    @property
    def scenario(self) -> ScenarioSettings:
        """The scenario keys, typed, with their declared defaults where the context has no scenario
        config (:class:`kvnotes.harness.runconfig.ScenarioSettings`): ``variant``, ``chat_template``, ..."""
        if self.scenario_cfg is None:
            return ScenarioSettings()
        data = OmegaConf.to_container(self.scenario_cfg, resolve=True) if isinstance(self.scenario_cfg, DictConfig) \
            else dict(self.scenario_cfg)
        return ScenarioSettings.model_validate(data)

    @property
    def thinking(self) -> bool:
        """Whether prompts open a think block (the model reasons before answering)."""
        return bool(self.template_kwargs.get("enable_thinking"))

    def __post_init__(self) -> None:
        if self.cfg is not None and config_value(self.cfg, "_target_"):
            self.cfg = typed_config(self.cfg)

    @classmethod
    def from_run_config(cls, cfg, probe_cfg, bundle: ModelBundle, pairs: PairSet, timer: Timer,
                        clean_runs: CleanRuns | None = None) -> ProbeContext:
        """The context ``run.py`` (and ``kvnotes battery``) hand a probe: readout, flip rule,
        ``min_effect``, seed, scenario config and memory budget from the composed run config
        ``cfg`` (``conf/config.yaml``); ``probe_cfg`` is the typed probe config; ``clean_runs``
        the job's shared clean-run store, if any."""
        from kvnotes.harness.pairs import template_kwargs
        from kvnotes.kv.cache import budget_bytes as resolve_budget

        check_flip_rule(str(cfg.flip_rule), bundle.info.get("source") == "random", bundle.name)
        return cls(bundle=bundle, pairs=pairs, cfg=probe_cfg, readout=cfg.readout, min_effect=float(cfg.min_effect),
                   flip_rule=str(cfg.flip_rule), seed=int(cfg.seed), timer=timer, scenario_cfg=cfg.scenario,
                   budget_bytes=resolve_budget(cfg.budget_mb, bundle.device), clean_runs=clean_runs,
                   template_kwargs=template_kwargs(cfg.model))


def get(cfg_or_name) -> Callable[[ProbeContext], dict]:
    """The ``run`` function of a probe, from its config or its name (see :func:`module`)."""
    return module(cfg_or_name).run


def check_run(probe_cfg, run_cfg) -> None:
    """The checks a probe declares against the run's settings, before any model loads: its
    ``Config.check_run`` (:meth:`kvnotes.harness.kit.ProbeConfig.check_run`), e.g. a probe whose
    selection / held-out split needs ``scenario.n_instances >= 2``, called on the config as the
    run's readout reads it (:func:`kvnotes.harness.protocol.config_for`: a ``cot_<k>`` key stands in
    for ``<k>`` under ``scenario.variant=cot``).

    Args:
        probe_cfg: the typed probe config (:func:`typed_config`).
        run_cfg: the composed run config (``conf/config.yaml``), or its :class:`RunSettings`.

    Raises:
        KvnotesError: a run setting the probe cannot work with (one line), or a run config of the
            wrong type (:func:`kvnotes.harness.runconfig.typed`).
    """
    from kvnotes.harness.protocol import config_for, readout_of_variant     # the protocol imports the kit

    settings = run_cfg if isinstance(run_cfg, RunSettings) else typed(run_cfg)
    cfg = config_for(typed_config(probe_cfg), readout_of_variant(settings.scenario.variant))
    check = getattr(cfg, "check_run", None)
    if check is not None:
        check(settings)


def check_variant(cfg_or_name, variant: str, thinking: bool | None = None) -> None:
    """Refuse a chain-of-thought prompt variant for a probe that would score the decision right
    after the reasoning opener, with no reasoning generated, and a thinking model
    (``model.thinking: true``) without the chain-of-thought variant (its decision comes after a
    think block that only generation produces).

    Raises:
        KvnotesError: ``variant == "cot"`` and the probe does not declare ``SUPPORTS_COT``, or
            ``thinking`` with another variant.
    """
    if thinking and variant != "cot":
        raise KvnotesError("model.thinking=true: the decision follows a generated think block; run with "
                           "scenario.variant=cot (or set model.thinking=false)")
    if variant == "cot" and not getattr(module(cfg_or_name), "SUPPORTS_COT", False):
        able = [n for n in names() if getattr(module(n), "SUPPORTS_COT", False)]
        name = cfg_or_name if isinstance(cfg_or_name, str) else config_value(cfg_or_name, "name")
        raise KvnotesError(f"probe '{name}' reads the decision right after the answer prefix and generates no "
                           f"reasoning, so it does not support scenario.variant=cot"
                           f" (probes that do: {', '.join(able) or 'none'})")
