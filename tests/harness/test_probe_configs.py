"""The typed probe configs are the one source of keys, defaults and allowed values: each YAML file
sets only what differs from its probe's ``Config`` dataclass, which Hydra composes it from, and
values outside the declared constraints are one line naming the key, for every sweep point, before
any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from kvnotes.errors import KvnotesError
from kvnotes.harness import registry
from tests.cli.test_cli import one_line_error


def _yaml_values(name: str) -> dict:
    raw = OmegaConf.load(registry.CONF_DIR / f"{name}.yaml")
    return {k: v for k, v in OmegaConf.to_container(raw, resolve=False).items()
            if k not in ("defaults", "name", "_target_")}


@pytest.mark.parametrize("name", registry.names())
def test_yaml_holds_only_what_differs_from_the_config_dataclass(name):
    """The ``Config`` dataclass is the one source of a probe's keys and defaults (issue #51): its YAML
    starts from it (``schema@_here_: <name>``, :func:`kvnotes.harness.registry.register_schemas`)
    and sets only keys it declares, each to a value other than its default (an interpolation such
    as ``${oc.select:scenario.memory,...}`` binds another group)."""
    raw = OmegaConf.load(registry.CONF_DIR / f"{name}.yaml")
    assert list(raw.defaults) == [{"schema@_here_": name}, "_self_"]
    schema = registry.module(registry.load_config(name)).Config
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    for key, value in _yaml_values(name).items():
        assert key in defaults, f"{name}: {key} is not declared on {schema.__module__}.Config"
        if isinstance(value, str) and value.startswith("${"):
            continue
        assert value != defaults[key], f"{name}.{key}: the YAML repeats the Config default {value!r}"


def test_hydra_composes_a_probe_from_its_dataclass():
    """Every key the ``Config`` declares is in the composed run config with its default and can be
    overridden without ``+``, though the YAML does not list it; an undeclared key is refused."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from kvnotes.harness.registry import register_schemas
    register_schemas()
    with initialize_config_dir(str(registry.CONF_DIR.parent), version_base="1.3"):
        cfg = compose("config", overrides=["probe=field_refresh", "probe.cot_max_pairs=1"])
        assert "cot_max_pairs" not in _yaml_values("field_refresh")
        assert cfg.probe.cot_max_pairs == 1 and cfg.probe.cot_max_new_tokens == 40 and cfg.probe.n_boot == 2000
        heads = compose("config", overrides=["probe=heads"]).probe
        expected = OmegaConf.to_container(OmegaConf.structured(registry.module(registry.load_config("heads")).Config))
        assert OmegaConf.to_container(heads) == expected | {"name": "heads", "_target_": "kvnotes.circuits.heads.run"}
        with pytest.raises(ConfigCompositionException):
            compose("config", overrides=["probe=field_refresh", "probe.cot_max_pair=1"])


@pytest.mark.parametrize("name, override, needles", [
    ("field_refresh", {"n_boot": -5}, ("probe.n_boot", "greater than or equal to 1", "-5")),
    ("field_refresh", {"cot_max_pairs": 0}, ("probe.cot_max_pairs", "greater than or equal to 1")),
    ("edit", {"selection_fraction": -0.5}, ("probe.selection_fraction", "greater than 0", "-0.5")),
    ("edit", {"selection_fraction": 1.0}, ("probe.selection_fraction", "less than 1")),
    ("edit", {"rankings": ["attention", "bogus"]}, ("probe.rankings.1", "'kv_deviation'", "'bogus'")),
    ("edit", {"placement": "nowhere"}, ("probe.placement", "'before_request'")),
    ("suffix_recovery", {"grid": {"counts": [0, -2]}}, ("probe.grid.counts.0", "greater than or equal to 1", "(and 1 more)")),
    ("suffix_recovery", {"topk_anchor": "middle"}, ("probe.topk_anchor", "'field_end'")),
    ("compose", {"sinks": ["bos", "eos"]}, ("probe.sinks.1", "'prefix'")),
    ("compose", {"image_grid": [1, 4]}, ("probe.image_grid", "at least 3")),
    ("agent", {"turns": 0}, ("probe.turns", "greater than or equal to 1")),
    ("read_location", {"knockout_groups": [["field", "elsewhere"]]}, ("probe.knockout_groups", "'downstream'",
                                                                         "got ['field', 'elsewhere']")),
    ("heads", {"modes": []}, ("probe.modes", "at least 1")),
    ("direction", {"fit_scope": "galaxy"}, ("probe.fit_scope", "'scenario'")),
    ("direction", {"layers": [-1]}, ("probe.layers.0", "greater than or equal to 0", "-1")),
    ("direction", {"layers": []}, ("probe.layers", "at least 1")),
    ("suffix_recovery", {"layer_bands": [[1]]}, ("probe.layer_bands", "band [1] is not [lo, hi]", "got [[1]]")),
    ("suffix_recovery", {"layer_bands": [[0.5, 2]]}, ("probe.layer_bands", "layer indices 0 <= lo < hi")),
    ("suffix_recovery", {"layer_bands": 0}, ("probe.layer_bands", "a number of bands >= 1", "got 0")),
    ("read_location", {"bands": 5}, ("probe.bands", "non-empty list of [lo, hi] bands", "got 5")),
    ("read_location", {"bands": [[-0.25, 0.5]]}, ("probe.bands", "band [-0.25, 0.5] is not [lo, hi]")),
    ("memory_edits", {"lengths": [1024, 0]}, ("probe.lengths.1", "greater than or equal to 1")),
    ("memory_placement", {"alpha": 1.5}, ("probe.alpha", "less than 1")),
])
def test_values_outside_their_constraints_are_one_line(name, override, needles):
    with pytest.raises(KvnotesError) as err:
        registry.load_config(name, override)
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_defaults_meet_their_own_constraints():
    for name in registry.names():
        registry.load_config(name)                      # raises on a default outside its constraints


@pytest.mark.parametrize("args, needles", [
    (["probe=suffix_recovery", "probe.grid.counts=[0,-2]"], ("probe.grid.counts.0", "greater than or equal to 1")),
    (["probe=edit", "probe.selection_fraction=-0.5"], ("probe.selection_fraction", "greater than 0")),
    (["scenario.n_instances=0"], ("scenario.n_instances", "greater than or equal to 1", "got 0")),
    (["scenario.n_instances=-3"], ("scenario.n_instances", "greater than or equal to 1", "got -3")),
    (["scenario.variant=bogus"], ("scenario.variant", "'direct' or 'cot'", "'bogus'")),
    (["-m", "probe=field_refresh", "probe.n_boot=100,-5"], ("probe.n_boot", "-5")),
])
def test_run_py_refuses_bad_values_before_loading(args, needles, tmp_path, monkeypatch, capsys):
    """Through ``run.py``'s own checks: exit 2, one line, no directory written (the model never loads)."""
    from kvnotes.cli import run as cli

    monkeypatch.setattr(sys, "argv", ["run.py", *args, f"out_root={tmp_path / 'runs'}"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    one_line_error(subprocess.CompletedProcess(args, stop.value.code, "", capsys.readouterr().err), *needles)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))


def test_a_probe_sweep_registers_the_default_probe_too():
    """Hydra's multirun composes the primary config, with the default probe, before the sweep's
    points: its schema must be registered too (``python run.py -m probe=field_refresh,suffix_recovery``
    used to stop on "Could not find 'probe/schema/blast_radius'")."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvnotes.cli.run import probe_choices

    default = next(str(d["probe"]) for d in OmegaConf.to_container(OmegaConf.load(registry.CONF_DIR.parent / "config.yaml"))["defaults"]
                   if isinstance(d, dict) and "probe" in d)
    named = probe_choices(["-m", "probe=field_refresh,suffix_recovery"])
    assert named == {"field_refresh", "suffix_recovery", default}
    GlobalHydra.instance().clear()
    registry.register_schemas((), named)
    with initialize_config_dir(str(registry.CONF_DIR.parent), version_base="1.3"):
        assert compose("config").probe.name == default


def test_probe_interpolations_resolve_against_the_run_config():
    """``scenario.memory`` reaches a memory probe's ``suite`` (it fell back to the default suite
    when the probe node was typed apart from the run config)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(registry.CONF_DIR.parent), version_base="1.3"):
        cfg = compose("config", overrides=["probe=memory_edits", "scenario=memory", "scenario.memory=/tmp/other.yaml"])
    assert registry.typed_config(cfg.probe).suite == "/tmp/other.yaml"


#: What a probe that needs a selection / held-out split says to ``scenario.n_instances=1``.
SPLIT_REFUSALS = {
    "suffix_recovery": "suffix_recovery ranks positions on selection instances and tests them on held-out ones",
    "heads": "heads ranks heads on selection instances and patches them on held-out ones",
    "direction": "direction fits the direction and chooses its layer on selection instances",
}


@pytest.mark.parametrize("name", sorted(SPLIT_REFUSALS))
def test_a_probe_whose_point_is_the_split_refuses_one_instance_before_loading(name, tmp_path, monkeypatch, capsys):
    """``scenario.n_instances=1`` leaves every instance held out: a probe whose numbers are all
    chosen on selection instances and reported on held-out ones says so in one line, exit 2, before
    the model loads (``Config.check_run``), and leaves nothing under ``out_root``."""
    from kvnotes.cli import run as cli
    from kvnotes.harness import jobs

    def no_load(cfg):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(jobs, "load_bundle", no_load)
    args = [f"probe={name}", "scenario.n_instances=1", f"out_root={tmp_path / 'runs'}"]
    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    one_line_error(subprocess.CompletedProcess(args, stop.value.code, "", capsys.readouterr().err),
                   "scenario.n_instances=1", SPLIT_REFUSALS[name], "it needs scenario.n_instances >= 2")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))


@pytest.mark.parametrize("args, needles", [
    (["probe=compose", "scenario.field_placement=after_filler"],
     ("scenario.field_placement=after_filler", "compose orders the prompt's lines into its own chunks")),
    (["probe=agent", "scenario.field_placement=before_request"],
     ("scenario.field_placement=before_request", "agent lays out its transcript")),
    (["probe=field_refresh", "scenario.field_placement=middle"], ("scenario.field_placement", "'middle'")),
])
def test_a_field_placement_a_probe_cannot_honour_is_one_line_before_loading(args, needles, tmp_path, monkeypatch,
                                                                             capsys):
    """``scenario.field_placement`` moves the field's line (issue #52); the probes that lay out the
    prompt's lines themselves refuse it rather than leave it unread, and an unknown placement is
    refused, each in one line before the model loads."""
    from kvnotes.cli import run as cli
    from kvnotes.harness import jobs

    def no_load(cfg):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(jobs, "load_bundle", no_load)
    args = [*args, f"out_root={tmp_path / 'runs'}"]
    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    one_line_error(subprocess.CompletedProcess(args, stop.value.code, "", capsys.readouterr().err), *needles)


def test_run_checks_see_the_run_settings():
    """``registry.check_run``: the probe's ``Config.check_run`` against the typed run settings; a
    probe whose split is not its point (edit, components) runs with one instance and says so in its
    record, and suffix_recovery's chain-of-thought curves have no split."""
    from kvnotes.harness.runconfig import RunSettings

    def settings(**scenario):
        return RunSettings.model_validate({"out_root": "runs", "model": {"name": "m"}, "scenario": scenario})

    for name in ("edit", "components", "screen"):
        registry.check_run(registry.load_config(name), settings(n_instances=1))
    registry.check_run(registry.load_config("suffix_recovery"), settings(n_instances=1, variant="cot"))
    registry.check_run(registry.load_config("suffix_recovery"), settings(n_instances=2))
    with pytest.raises(KvnotesError, match="scenario.n_instances=1: heads"):
        registry.check_run(registry.load_config("heads"), settings(n_instances=1))
