"""No silent wrongs on the scenario surface (issue #54): what a scenario file, a suite of them or the
``families`` / ``ids`` selection can say that ``load_suite`` would otherwise read wrong without a word.

- A key given twice in one YAML mapping (at any depth, scenario and memory suites alike) is refused,
  naming the file, the dotted key and its lines: ``yaml.safe_load`` keeps the last value, so
  ``values: {admin: allow, ..., admin: deny}`` turned the pair's expected flip false.
- Two files of one suite with identical bytes, the same scenario under another id or layout, or one
  file reached through two paths are refused, naming both: each counted as a scenario.
- ``families=[]`` / ``ids=[]`` are refused: an empty list selected every family.
- The contract, property-based (hypothesis, no model): ``load_suite`` returns scenarios that reflect
  every key the file gives, or raises a one-line :class:`ScenarioError`; never another exception.
- From ``run.py``: exit status 2, one ``kvnotes: error:`` line, nothing under ``out_root``, before any
  model loads (the job, which would load it, is stubbed in this process; one real subprocess).
"""

from __future__ import annotations

import json
import re
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yaml.representer import SafeRepresenter

from kvnotes.scenarios.errors import ScenarioError, one_line
from kvnotes.scenarios.memory import load_memory
from kvnotes.scenarios.schema import SUITES_DIR, ROOT, Variant, load_suite, read_yaml
from tests.scenarios.test_contract import run_main

REPO = Path(__file__).resolve().parents[2]
#: The known-good template: a shipped scenario with every kind of key (slots, filler, two variants,
#: polarity).
TEMPLATE_FILE = SUITES_DIR / "policy_gate" / "account_role.yaml"
TEMPLATE_TEXT = TEMPLATE_FILE.read_text(encoding="utf-8")
TEMPLATE = yaml.safe_load(TEMPLATE_TEXT)
MEMORY_FILE = ROOT / "memory" / "personas.yaml"
#: No example database, the same examples on every run, no deadline (the first example pays for imports).
COMMON = dict(deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def one_line_error(paths, families=None, ids=None) -> str:
    """The message of the ScenarioError ``load_suite`` raises (checked to be one line)."""
    with pytest.raises(ScenarioError) as err:
        load_suite([str(p) for p in paths], families, ids)
    msg = str(err.value)
    assert msg and "\n" not in msg and len(msg.splitlines()) == 1, repr(msg)
    return msg


# ====================================================================== duplicate keys (any depth)

DUP_ISSUE = TEMPLATE_TEXT.replace("  values: {admin: allow, viewer: deny}\n",
                                  "  values:\n    admin: allow\n    viewer: deny\n    admin: deny\n")


@pytest.mark.parametrize("text, message", [
    # the issue's case: the pair (viewer, admin) silently stopped being expected to flip
    (DUP_ISSUE, "key 'field.values.admin': given twice (lines 7 and 9): remove all but one (YAML would silently "
                "keep the last)"),
    (TEMPLATE_TEXT.replace("{admin: allow, viewer: deny}", "{admin: allow, viewer: deny, admin: deny}"),
     "key 'field.values.admin': given twice (line 6, columns 12 and 40): remove all but one (YAML would "
     "silently keep the last)"),
    ("family: recall\n" + TEMPLATE_TEXT, "key 'family': given twice (lines 1 and 2): remove all but one"),
    (TEMPLATE_TEXT + "n_filler: 2\nn_filler: 1\n", "key 'n_filler': given 3 times (lines 21, 30 and 31): "
                                                   "remove all but one"),
    (TEMPLATE_TEXT.replace('answer_prefix: "Answer:"}', 'answer_prefix: "Answer:", decision: "Yes?"}'),
     "key 'variants.direct.decision': given twice (line 25, columns 12 and 103)"),
    (TEMPLATE_TEXT.replace("  account_id:", "  name: [A]\n  account_id:"),
     "key 'slots.name': given twice (lines 9 and 11)"),
    # keys that read as one: Python's dict merges 1, 1.0 and true; the schema reads 1 and '1' as text
    (TEMPLATE_TEXT.replace("{admin: allow, viewer: deny}", "{1: allow, '1': deny, 2: deny}"),
     "key 'field.values.1': given twice (line 6, columns 12 and 22), as 1 and '1', which read as one key"),
    (TEMPLATE_TEXT.replace("{admin: allow, viewer: deny}", "{1: allow, 1.0: deny, 2: deny}"),
     "key 'field.values.1': given twice (line 6, columns 12 and 22), as 1 and 1.0, which read as one key"),
], ids=["issue_block", "issue_flow", "top_level", "three_times", "nested_flow", "slots", "int_and_text",
        "int_and_float"])
def test_duplicate_key_is_refused_naming_file_key_and_lines(tmp_path, text, message):
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    msg = one_line_error([path])
    assert msg.startswith(f"{path}: "), msg
    assert message in msg, msg


def test_the_issue_case_loads_as_two_flipping_values_once_fixed(tmp_path):
    """Without the duplicate the same file loads, and its pair flips (what the duplicate hid)."""
    path = tmp_path / "fixed.yaml"
    path.write_text(DUP_ISSUE.replace("    admin: deny\n", ""), encoding="utf-8")
    (s,) = load_suite([str(path)])
    assert s.values == {"admin": "allow", "viewer": "deny"} and s.expect_flip("viewer", "admin")


def test_merge_keys_may_override_what_they_bring(tmp_path):
    """``<<: *anchor`` then a key of the anchor's mapping is YAML's override, not a duplicate."""
    text = TEMPLATE_TEXT.replace(
        "variants:\n  direct: {",
        "variants:\n  base: &base {decision: \"x\", answer_prefix: \"Answer:\"}\n  direct: {<<: *base, ")
    path = tmp_path / "merge.yaml"
    path.write_text(text, encoding="utf-8")
    (s,) = load_suite([str(path)])
    assert s.variants["direct"].decision == TEMPLATE["variants"]["direct"]["decision"]
    assert s.variants["base"] == Variant("x", "Answer:")
    path.write_text(text.replace("{<<: *base, ", "{<<: *base, answer_prefix: \"A:\", "), encoding="utf-8")
    assert "key 'variants.direct.answer_prefix': given twice" in one_line_error([path])


def test_read_yaml_refuses_a_duplicate_inside_a_list(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("a:\n  - {id: x}\n  - {id: y, text: t, id: z}\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match=re.escape(f"{path}: key 'a[1].id': given twice "
                                                      "(line 3, columns 6 and 22)")):
        read_yaml(path)


def test_memory_suite_duplicate_key_is_refused(tmp_path):
    text = MEMORY_FILE.read_text(encoding="utf-8")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.strip() == "- id: maria")
    path = tmp_path / "mem.yaml"
    path.write_text(text.replace("  - id: maria\n", "  - id: maria\n    id: tom\n", 1), encoding="utf-8")
    with pytest.raises(ScenarioError) as err:
        load_memory(path)
    assert str(err.value) == (f"{path}: key 'personas[0].id': given twice (lines {line} and {line + 1}): remove all "
                              "but one (YAML would silently keep the last)")


def test_memory_suite_source_key_and_empty_personas_are_refused(tmp_path):
    """``source`` was dropped without a word (the loader sets it); ``personas=[]`` selected every persona."""
    path = tmp_path / "mem.yaml"
    path.write_text("source: elsewhere\n" + MEMORY_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ScenarioError, match=re.escape(f"{path}: key 'source': unknown key")):
        load_memory(path)
    with pytest.raises(ScenarioError, match=re.escape("personas=[] selects nothing: leave it unset (null) for every "
                                                      "persona, or name at least one")):
        load_memory(MEMORY_FILE, [])
    assert [p.id for p in load_memory(MEMORY_FILE, ["maria"]).personas] == ["maria"]


# ====================================================================== the same scenario twice

def test_identical_files_are_refused_naming_both(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_bytes(TEMPLATE_FILE.read_bytes())
    b.write_bytes(TEMPLATE_FILE.read_bytes())
    assert one_line_error([tmp_path]) == (f"{b}: identical content to {a}: the same scenario would count twice; "
                                          "remove one")


def test_same_scenario_in_another_layout_or_under_another_id_is_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(TEMPLATE_TEXT, encoding="utf-8")
    for other in ("# a copy\n" + TEMPLATE_TEXT,
                  "id: another\n" + TEMPLATE_TEXT.replace("description: An admin", "description: A copy of the admin")):
        b.write_text(other, encoding="utf-8")
        assert one_line_error([tmp_path]) == (f"{b}: the same scenario as {a} (they differ only in id, description "
                                              "or layout): it would count twice; remove one")
    b.write_text(TEMPLATE_TEXT.replace("n_filler: 3", "n_filler: 2"), encoding="utf-8")   # a real variation
    assert len(load_suite([str(tmp_path)])) == 2


def test_two_files_with_one_id_are_refused_naming_both(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("id: same\n" + TEMPLATE_TEXT, encoding="utf-8")
    b.write_text("id: same\n" + TEMPLATE_TEXT.replace("n_filler: 3", "n_filler: 2"), encoding="utf-8")
    assert one_line_error([tmp_path]) == f"{b}: key 'id': 'same' already used by {a}"


def test_one_file_reached_through_two_paths_is_refused(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text(TEMPLATE_TEXT, encoding="utf-8")
    assert one_line_error([tmp_path, a]) == (f"{a}: reached twice through the scenario paths ({tmp_path} and {a}): "
                                             "name each file once")
    (tmp_path / "link.yaml").symlink_to(a)
    assert "reached twice" in one_line_error([tmp_path])


# ====================================================================== the selection

@pytest.mark.parametrize("families, ids, message", [
    ([], None, "scenario.families=[] selects nothing: leave it unset (null) for every family, or name at least one"),
    (None, [], "scenario.ids=[] selects nothing: leave it unset (null) for every scenario, or name at least one"),
    ([], [], "scenario.families=[] selects nothing"),
], ids=["families", "ids", "both"])
def test_empty_selection_is_refused(families, ids, message):
    assert one_line_error([SUITES_DIR], families, ids).startswith(message)


def test_null_selection_keeps_every_scenario_and_a_list_keeps_what_it_names():
    every = load_suite([str(SUITES_DIR)])
    assert len(every) == len(list(SUITES_DIR.rglob("*.yaml")))
    assert {s.family for s in load_suite([str(SUITES_DIR)], ["recall"])} == {"recall"}
    assert [s.id for s in load_suite([str(SUITES_DIR)], None, ["account_role"])] == ["account_role"]


@pytest.mark.parametrize("path", [SUITES_DIR, *sorted(p for p in SUITES_DIR.iterdir() if p.is_dir()),
                                  ROOT / "planted"], ids=lambda p: p.name)
def test_shipped_suites_load(path):
    assert load_suite([str(path)])


def test_shipped_memory_suite_loads():
    assert load_memory(MEMORY_FILE).personas


# ====================================================================== through run.py

def _suite_dir(tmp_path: Path, case: str) -> tuple[Path, list[str], str]:
    """A suite directory for ``case``, the extra overrides, and a fragment of the expected error."""
    d = tmp_path / case
    d.mkdir()
    (d / "a.yaml").write_text(TEMPLATE_TEXT, encoding="utf-8")
    extra: list[str] = []
    if case == "duplicate_key":
        (d / "a.yaml").write_text(DUP_ISSUE, encoding="utf-8")
        expected = f"{d / 'a.yaml'}: key 'field.values.admin': given twice (lines 7 and 9)"
    elif case == "identical_files":
        (d / "b.yaml").write_text(TEMPLATE_TEXT, encoding="utf-8")
        expected = f"{d / 'b.yaml'}: identical content to {d / 'a.yaml'}"
    elif case == "same_id":
        (d / "a.yaml").write_text("id: same\n" + TEMPLATE_TEXT, encoding="utf-8")
        (d / "b.yaml").write_text("id: same\n" + TEMPLATE_TEXT.replace("n_filler: 3", "n_filler: 2"), encoding="utf-8")
        expected = f"{d / 'b.yaml'}: key 'id': 'same' already used by {d / 'a.yaml'}"
    elif case == "same_scenario":
        (d / "b.yaml").write_text("# copy\n" + TEMPLATE_TEXT, encoding="utf-8")
        expected = f"{d / 'b.yaml'}: the same scenario as {d / 'a.yaml'}"
    elif case == "empty_families":
        extra, expected = ["scenario.families=[]"], "scenario.families=[] selects nothing"
    else:
        extra, expected = ["scenario.ids=[]"], "scenario.ids=[] selects nothing"
    return d, extra, expected


@pytest.mark.parametrize("case", ["duplicate_key", "identical_files", "same_id", "same_scenario", "empty_families",
                                  "empty_ids"])
def test_run_py_refuses_in_one_line_before_the_model_loads(tmp_path, case):
    d, extra, expected = _suite_dir(tmp_path, case)
    out = tmp_path / "runs"
    code, err, reached = run_main(["probe=screen", f"scenario.paths=[{d}]", *extra], out)
    lines = err.strip().splitlines()
    assert not reached, err                                   # refused before the job (the model) runs
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvnotes: error: "), (code, err)
    assert expected in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


def test_run_py_subprocess_refuses_the_issue_case(tmp_path):
    """The real command line: exit 2, one stderr line, nothing written (a few seconds: no model loads)."""
    d, _, expected = _suite_dir(tmp_path, "duplicate_key")
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "run.py", f"scenario.paths=[{d}]", f"out_root={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith(f"kvnotes: error: {expected}"), lines[0]
    assert not out.exists(), sorted(out.rglob("*"))


# ====================================================================== the contract, property-based

#: Text without braces (a brace is a placeholder) or NUL; surrogates are not UTF-8.
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="{}\x00"), min_size=1, max_size=16)
WORD = st.text(st.sampled_from(string.ascii_lowercase), min_size=1, max_size=8)


@st.composite
def valid_docs(draw) -> dict:
    """Valid variations of the template: every text, the values and their outcomes, the optional keys."""
    doc = json.loads(json.dumps(TEMPLATE))
    for key in ("domain", "description", "system", "id"):
        if draw(st.booleans()):
            doc[key] = draw(TEXT)
        elif key in ("description",):
            doc.pop(key)
    doc["family"] = draw(st.sampled_from(["policy_gate", "recall", "lookup", "control"]) | TEXT)
    values = draw(st.lists(TEXT, min_size=2, max_size=4, unique=True))
    allow, deny = draw(st.lists(TEXT, min_size=2, max_size=2, unique=True))
    doc["candidates"] = {"allow": allow, "deny": deny}
    doc["field"] = {"slot": "role", "values": {v: ("allow", "deny")[i % 2] for i, v in enumerate(values)}}
    if draw(st.booleans()):
        doc["field"]["pairs"] = draw(st.lists(st.tuples(st.sampled_from(values), st.sampled_from(values)).map(list),
                                              min_size=1, max_size=3))
    doc["slots"]["name"] = draw(st.lists(TEXT, min_size=1, max_size=3))
    doc["context"] = draw(TEXT) + " {name}: {role}. " + draw(TEXT)
    doc["filler"] = draw(st.lists(TEXT, max_size=4))
    if draw(st.booleans()):
        doc["n_filler"] = draw(st.integers(0, len(doc["filler"])))
    else:
        doc.pop("n_filler")
    doc["rule"] = draw(TEXT) + " {gate} " + draw(TEXT)
    doc["polarity"]["values"] = {"normal": draw(TEXT), "inverted": draw(TEXT)}
    doc["request"] = draw(TEXT) + draw(st.sampled_from(["", " {project}?"]))
    doc["variants"]["direct"] = {"decision": draw(TEXT), "answer_prefix": draw(TEXT)}
    if draw(st.booleans()):
        doc["variants"]["cot"]["answer_marker"] = draw(TEXT)
    return doc


def reflects(doc: dict, s, path: Path) -> None:
    """Every key the file gives is in the scenario, unchanged (``description`` is documentation)."""
    values = doc["field"]["values"]
    filler = doc.get("filler", [])
    assert s.id == doc.get("id", path.stem) and s.source == str(path)
    assert (s.family, s.domain, s.system) == (doc["family"], doc["domain"], doc.get("system"))
    assert (s.context, s.rule, s.request) == (doc["context"], doc["rule"], doc["request"])
    assert s.field_slot == doc["field"]["slot"] and s.values == values and s.candidates == doc["candidates"]
    keys = list(values)
    pairs = doc["field"].get("pairs") or [[keys[i], keys[j]] for i in range(len(keys)) for j in range(i + 1, len(keys))]
    assert [list(p) for p in s.pairs] == pairs
    assert s.slots == doc["slots"] and list(s.filler) == filler
    assert s.n_filler == doc.get("n_filler", min(3, len(filler)))
    assert s.variants == {n: Variant(v["decision"], v["answer_prefix"], v.get("answer_marker", "Answer:"))
                          for n, v in doc["variants"].items()}
    assert (s.polarity_slot, s.polarity_values) == (doc["polarity"]["slot"], doc["polarity"]["values"])


def _node(doc) -> yaml.Node:
    return SafeRepresenter(default_flow_style=False, sort_keys=False).represent_data(doc)


def _mappings(node: yaml.Node, path: str = "") -> list[tuple[str, yaml.MappingNode]]:
    """Every mapping node of a document with its dotted key (the loader's spelling)."""
    out: list[tuple[str, yaml.MappingNode]] = []
    if isinstance(node, yaml.MappingNode):
        out.append((path, node))
        for k, v in node.value:
            out += _mappings(v, f"{path}.{k.value}" if path else k.value)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out += _mappings(v, f"{path}[{i}]")
    return out


REQUIRED = ["family", "domain", "field", "candidates", "context", "rule", "request", "variants", "field.slot",
            "field.values", "variants.direct", "variants.direct.decision", "variants.direct.answer_prefix",
            "polarity.slot", "polarity.values"]
WRONG_TYPE = {"family": [1], "domain": {"a": 1}, "context": True, "rule": [], "request": {"x": "y"},
              "field": "role", "field.slot": ["role"], "field.values": 3, "field.pairs": "viewer",
              "candidates": ["allow"], "slots": "name", "slots.name": {"a": "b"}, "filler": {"a": "b"},
              "n_filler": "three", "variants": ["direct"], "variants.direct": "x", "polarity": 1,
              "variants.direct.answer_prefix": False, "id": [1, 2], "system": {"a": 1}}
KNOWN = {*TEMPLATE, "id", "system", "slot", "values", "pairs", "decision", "answer_prefix", "answer_marker"}


def _walk(doc: dict, dotted: str) -> tuple[dict, str]:
    *parents, last = dotted.split(".")
    for p in parents:
        doc = doc[p]
    return doc, last


KINDS = ["valid", "duplicate", "missing", "type", "unknown", "empty_selection"]


@st.composite
def mutated(draw, kind: str) -> tuple[dict | str, str, list | None, list | None]:
    """(the document or its YAML text, a fragment the error must hold, families, ids): a valid document
    mutated by ``kind`` into an invalid one (``valid``: left valid, fragment empty, no selection)."""
    doc = draw(valid_docs())
    if kind == "duplicate":                           # a key of any mapping, at any depth, given again
        root = _node(doc)
        path, mapping = draw(st.sampled_from(_mappings(root)))
        key_node, value_node = draw(st.sampled_from(mapping.value))
        again = value_node if draw(st.booleans()) else _node(draw(TEXT | st.integers() | st.lists(WORD, max_size=2)))
        key_node = yaml.ScalarNode(key_node.tag, key_node.value, style=key_node.style)   # not an alias of it
        mapping.value.insert(draw(st.integers(0, len(mapping.value))), (key_node, again))
        key = f"{path}.{key_node.value}" if path else key_node.value
        return yaml.serialize(root, Dumper=yaml.SafeDumper), one_line(f"key '{key}': given twice ("), None, None
    if kind == "missing":
        node, last = _walk(doc, key := draw(st.sampled_from(REQUIRED)))
        del node[last]
        if key == "variants.direct":                  # variants is a mapping of any names: one is required
            return doc, "key 'variants': needs at least a 'direct' variant", None, None
        return doc, f"key '{key}': missing", None, None
    if kind == "type":
        node, last = _walk(doc, key := draw(st.sampled_from(sorted(WRONG_TYPE))))
        node[last] = WRONG_TYPE[key]
        return doc, f"key '{key}", None, None
    if kind == "unknown":
        where = draw(st.sampled_from(["", "field", "variants.direct", "polarity"]))
        node = _walk(doc, where + ".x")[0] if where else doc
        key = draw(WORD.filter(lambda k: k not in KNOWN))
        node[key] = draw(st.none() | WORD | st.integers())
        return doc, f"key '{where + '.' if where else ''}{key}': unknown key", None, None
    if kind == "empty_selection":
        families, ids = draw(st.sampled_from([([], None), (None, []), ([], []), ([], [doc.get("id", "case")]),
                                              ([doc["family"]], [])]))
        key = "families" if families == [] else "ids"
        return doc, f"scenario.{key}=[] selects nothing: leave it unset (null)", families, ids
    return doc, "", None, None


def _write(path: Path, doc) -> Path:
    """``doc`` (YAML text, or a mapping dumped without ``allow_unicode``: PyYAML's emitter writes a raw
    NEL ``\\x85`` into a quoted scalar with it, which reads back as a space) written to ``path``."""
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=15, **COMMON)
@given(data=st.data())
def test_load_suite_reflects_every_key_or_is_one_line(kind, data):
    """A valid file loads as a scenario holding every key it gives; each mutation is one line naming
    the file and the key (the selection: the empty list)."""
    doc, fragment, families, ids = data.draw(mutated(kind))
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d) / "case.yaml", doc)
        try:
            scenarios = load_suite([str(path)], families, ids)
        except ScenarioError as exc:
            msg = str(exc)
            assert "\n" not in msg and len(msg.splitlines()) == 1, repr(msg)
            assert kind != "valid", msg
            assert fragment in msg, (kind, fragment, msg)
            assert kind == "empty_selection" or msg.startswith(f"{path}: "), msg
            return
        assert kind == "valid", (kind, fragment)
        (s,) = scenarios
        reflects(doc, s, path)


@pytest.mark.parametrize("how", ["copy", "relayout", "other", "reach_twice"])
@settings(max_examples=10, **COMMON)
@given(first=valid_docs(), second=valid_docs(),
       families=st.none() | st.just([]) | st.lists(st.sampled_from(["policy_gate", "recall", "lookup"]), max_size=2),
       ids=st.none() | st.just([]))
def test_two_files_and_a_selection_load_distinct_or_are_one_line(how, first, second, families, ids):
    """Two files of one suite (a byte copy, the same mapping in flow style under a comment, another
    scenario, or one file reached through two paths) and a selection: the scenarios selected, each
    once, or one line naming both files."""
    first.pop("id", None)
    with tempfile.TemporaryDirectory() as d:
        a = _write(Path(d) / "a.yaml", first)
        text = a.read_text(encoding="utf-8")
        b = Path(d) / "b.yaml"
        if how == "copy":
            b.write_text(text, encoding="utf-8")
        elif how == "relayout":
            b.write_text("# a copy, in flow style\n" + yaml.safe_dump(first, default_flow_style=True, sort_keys=False),
                         encoding="utf-8")
        elif how == "other":
            _write(b, {**second, "id": "other"})
        paths = [str(Path(d))] + ([str(a)] if how == "reach_twice" else [])
        try:
            scenarios = load_suite(paths, families, ids)
        except ScenarioError as exc:
            msg = str(exc)
            assert "\n" not in msg and len(msg.splitlines()) == 1, repr(msg)
            expected = {"copy": "identical content to", "relayout": "the same scenario as",
                        "reach_twice": "reached twice"}.get(how)
            if families == [] or ids == []:
                assert "=[] selects nothing" in msg, msg
            elif expected is not None:
                assert expected in msg and str(a) in msg, msg
            else:
                assert "no scenarios selected" in msg or "the same scenario as" in msg, msg
            return
        assert how == "other" and families != [] and ids != [], (how, families, ids)
        assert len({s.id for s in scenarios}) == len(scenarios) <= 2
        assert all(families is None or s.family in families for s in scenarios)
