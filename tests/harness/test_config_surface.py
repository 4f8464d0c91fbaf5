"""Every key is read or refused (issue #54): property-based tests over the run config's surface.

The contract, for any command line built from the keys kvnotes declares (run-level, ``model.*``,
``scenario.*``, ``probe.*``) and from near misses of them (a letter dropped, doubled or swapped; a
key added with ``+``): ``run.py`` either reaches the job with a config in which every given key holds
the given value, or exits 2 with one ``kvnotes: error:`` line and nothing written. A key no config
reads never reaches the job. The job is stubbed (no model loads): what it would do with the config is
the probes' own tests' subject.
"""

from __future__ import annotations

import functools
import string

import yaml

from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.scenarios.test_contract import COMMON, check_main


@functools.cache
def _screen_config():
    """The screen probe's composed run config (composed once: the examples only read it)."""
    from tests.scenarios.test_contract import compose

    return compose(["probe=screen"])


def _declared_keys() -> list[str]:
    """Dotted leaf keys of the screen probe's composed run config (every config group's declared keys)."""
    tree = OmegaConf.to_container(_screen_config(), resolve=False)

    def leaves(node, prefix=""):
        if isinstance(node, dict) and node:
            return [k for key, v in node.items() for k in leaves(v, f"{prefix}{key}.")]
        return [prefix.rstrip(".")]

    skip = ("model.architecture.", "model.embedded.", "out_root", "probe._target_", "probe.name", "model.name",
            "scenario.name", "scenario.paths")
    return sorted(k for k in leaves(tree) if not k.startswith(skip))


DECLARED = _declared_keys()
#: Values every key of a kind accepts, so a reached job can be held to the value given.
GOOD = {bool: ["true", "false"], int: ["0", "1", "3"], float: ["0.5", "2.0"], str: None}


@st.composite
def near_miss(draw) -> str:
    """A declared key with one letter of its last part dropped, doubled or swapped for another."""
    key = draw(st.sampled_from(DECLARED))
    parent, _, last = key.rpartition(".")
    i = draw(st.integers(0, len(last) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap"]))
    if how == "drop" and len(last) > 1:
        last = last[:i] + last[i + 1:]
    elif how == "double":
        last = last[:i] + last[i] + last[i:]
    else:
        last = last[:i] + draw(st.sampled_from(string.ascii_lowercase.replace(last[i], ""))) + last[i + 1:]
    miss = f"{parent}.{last}" if parent else last
    return miss if miss not in DECLARED else miss + "x"


def _declared_value(key: str):
    return OmegaConf.select(_screen_config(), key)


@settings(max_examples=15, **COMMON)
@given(key=near_miss(), plus=st.booleans(), value=st.sampled_from(["1", "true", "x", "0.5"]))
def test_a_key_no_config_reads_never_reaches_the_job(key, plus, value):
    """``min_efect=2`` and ``+min_efect=2`` alike: one line naming the key, exit 2, nothing written."""
    assert not check_main(["probe=screen", f"{'+' if plus else ''}{key}={value}"])


@settings(max_examples=15, **COMMON)
@given(keys=st.lists(st.sampled_from(DECLARED), min_size=1, max_size=3, unique=True), data=st.data())
def test_a_declared_key_reaches_the_job_with_its_value_or_is_one_line(keys, data):
    """Declared keys set to values of their own type: the job gets each value as given, or the
    combination is refused in one line (a constraint between keys, a device this machine lacks)."""
    given_values = {}
    for key in keys:
        current = _declared_value(key)
        choices = GOOD.get(type(current)) or ([str(current)] if current is not None else ["null"])
        given_values[key] = data.draw(st.sampled_from(choices), label=key)
    reached = check_main(["probe=screen", *(f"{k}={v}" for k, v in given_values.items())])
    for cfg in reached:
        for key, value in given_values.items():
            got, want = OmegaConf.select(cfg, key), yaml.safe_load(value)
            assert got == want or str(got) == value, (key, value, got)
