"""Scenario validation names file and key; the shipped suite is valid and meets its design."""

from __future__ import annotations

import pytest
import yaml

from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios import load_scenario, load_suite
from tests.harness.test_tokens import BASE


def write(tmp_path, name, raw):
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("change, key", [
    ({"context": "Profile of {name}."}, "context"),                              # field slot missing
    ({"rule": "Colour {colour} matters."}, "rule"),                              # field after the rule
    ({"candidates": {"red": " red"}}, "candidates"),
    ({"field": {"slot": "colour", "values": {"red": "red", "blue": "green"}}}, "field.values.blue"),
    ({"request": "Ask {nobody}."}, "request"),
    ({"variants": {"cot": {"decision": "x", "answer_prefix": "y"}}}, "variants"),
    ({"n_filler": 9}, "n_filler"),
    ({"colour": "x"}, "colour"),                                                 # unknown key
])
def test_validation_errors_name_file_and_key(tmp_path, change, key):
    p = write(tmp_path, "bad", {**BASE, **change})
    with pytest.raises(ScenarioError) as err:
        load_scenario(p)
    msg = str(err.value)
    assert str(p) in msg and f"key '{key}'" in msg and "\n" not in msg


def test_missing_family_is_named(tmp_path):
    raw = {k: v for k, v in BASE.items() if k != "family"}
    with pytest.raises(ScenarioError, match="key 'family': missing"):
        load_scenario(write(tmp_path, "nofam", raw))


def test_shipped_suite_is_valid_and_covers_the_design():
    suite = load_suite(["scenarios/suites"])
    fams = {}
    for s in suite:
        fams.setdefault(s.family, []).append(s)
    assert len({s.domain for s in fams["policy_gate"]}) >= 10
    assert all(s.polarity_slot for s in fams["policy_gate"])
    assert fams["control"] and all(not s.expect_flip(*p) for s in fams["control"] for p in s.pairs)
    for fam in ("recall", "lookup", "language"):
        assert fams.get(fam), fam
    assert all("cot" in s.variants for s in suite)


def test_polarity_inverts_outcomes():
    s = next(s for s in load_suite(["scenarios/suites"], families=["policy_gate"]))
    v0, v1 = list(s.values)[:2]
    assert s.outcome(v0, "inverted") == s.outcome(v1, "normal") != s.outcome(v0, "normal")
