"""The bad-input contract of ``run.py``, property-based (hypothesis).

The contract: any input to ``python run.py ...`` either yields a complete record, or ends with exit
status 2, exactly one line on stderr starting ``kvnotes: error:``, and nothing written under
``out_root`` (no record, no directory, no lock file).

1. Scenario files (valid mutations of a known-valid file, invalid ones of every kind, raw YAML and
   raw bytes): :func:`kvnotes.scenarios.schema.load_suite` returns scenarios that the scenario pipeline
   (instances, pairs, rendering) can use, or raises a one-line :class:`ScenarioError` naming the
   file; never another exception.
2. Config values (run-level, scenario and probe keys, set, added, force-added or deleted; ints,
   negatives, floats, strings, lists, mappings, null): what ``run.py``'s ``main`` does before Hydra runs
   the job (``check_choices``, ``precheck``), in this process, passes or exits 2 with one stderr line
   and nothing under ``out_root``; a scenario config that passes gives a suite the scenario pipeline
   can use. ``main`` itself runs with the job replaced by a stub (no model loads) where Hydra's own
   stage matters.
3. End to end on the embedded SmolLM2 (``embedded``): a valid generated scenario file writes a complete
   record; an invalid one exits 2 with one line naming it and nothing written.

Inputs that violated the contract when these tests were written are kept below as examples
(``test_known_violations_*``, fixed since: an unresolvable interpolation, a sweep without ``-m``,
``device=mps``/``meta``, a negative seed, a deleted key, an invalid scenario file reported only after
the model loaded, a memory suite of garbage bytes); the strategies leave their classes out (``$``
interpolations, a bare ``,`` sweep, deleted keys) so that the properties test everything else.
"""

from __future__ import annotations

import contextlib
import io
import json
import string
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios.instances import build_pairs, build_polarity_pairs, render_user_text
from kvnotes.scenarios.schema import ScenarioFile, load_suite
from tests.helpers import fruit_scenario
from tests.cli.test_cli import run


def _fruit() -> dict:
    with tempfile.TemporaryDirectory() as d:
        return yaml.safe_load(fruit_scenario(Path(d) / "fruit.yaml").read_text())


#: The known-valid file every scenario strategy mutates (tests/helpers.py ``fruit_scenario``).
FRUIT = _fruit()
SLOT = FRUIT["field"]["slot"]
#: No example database (nothing written into the checkout); derandomized (the same examples on every
#: run, so CI never fails on a newly drawn one: explore with ``--hypothesis-seed=<n>`` and more
#: examples by hand); no per-example deadline (the first example pays for imports); modest example
#: counts so the fast lane stays well under 30 s.
COMMON = dict(deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# =============================================================================== 1. scenario files

#: Text without braces (a brace is a placeholder), surrogates or NUL (not writable as YAML text).
PLAIN = st.text(st.characters(codec="utf-8", exclude_characters="{}\x00"), min_size=1, max_size=24)
WORD = st.text(st.sampled_from(string.ascii_letters), min_size=1, max_size=8)
SENTENCE = st.lists(WORD, min_size=1, max_size=6).map(lambda ws: " ".join(ws) + ".")


def _write(directory: Path, name: str, doc) -> Path:
    path = directory / f"{name}.yaml"
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    elif isinstance(doc, str):
        path.write_text(doc, encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def _usable(scenarios) -> None:
    """The scenario pipeline runs on loaded scenarios: instances, pairs, rendering, polarity pairs."""
    for n, seed in ((1, 0), (3, 7)):
        for spec in build_pairs(scenarios, n, seed):
            text, (a, b), _ = render_user_text(spec.instance, spec.old, spec.variant)
            assert text[a:b] == spec.old
        for variant in ("direct", "cot"):
            build_pairs(scenarios, n, seed, variant)
        build_polarity_pairs(scenarios, n, seed)


def load_or_error(paths: list[Path], named: Path | None = None):
    """``load_suite(paths)``: the scenarios (checked usable), or the ScenarioError (checked to be one
    line naming ``named``). Any other exception propagates: a bug."""
    try:
        scenarios = load_suite([str(p) for p in paths])
    except ScenarioError as exc:
        msg = str(exc)
        assert msg and len(msg.splitlines()) == 1, repr(msg)
        if named is not None:
            assert str(named) in msg, msg
        return exc
    _usable(scenarios)
    return scenarios


@st.composite
def valid_scenarios(draw) -> dict:
    """Mutations of the fruit file that keep it valid: surface text, slots, filler, values and their
    outcomes, pairs, variants, an optional polarity block."""
    doc = json.loads(json.dumps(FRUIT))
    doc["id"] = draw(PLAIN)
    doc["family"] = draw(st.sampled_from(["recall", "policy_gate", "control", "lookup"]) | PLAIN)
    doc["domain"] = draw(PLAIN)
    if draw(st.booleans()):
        doc["description"] = draw(PLAIN)
    if draw(st.booleans()):
        doc["system"] = draw(PLAIN)
    doc["slots"] = {"name": draw(st.lists(PLAIN, min_size=1, max_size=4) | st.text("AB#-", min_size=0, max_size=6))}
    extra = draw(st.dictionaries(st.sampled_from(["city", "item", "code"]),
                                 st.lists(PLAIN, min_size=1, max_size=3) | st.text("#x", max_size=4), max_size=2))
    doc["slots"].update(extra)
    used = "".join(f" {{{k}}}" for k in extra)
    doc["context"] = draw(PLAIN) + " {name}" + draw(st.sampled_from(["", " {name}"])) + f": {{{SLOT}}}." + used
    values = draw(st.lists(PLAIN, min_size=2, max_size=4, unique=True))
    continuations = draw(st.lists(PLAIN, min_size=2, max_size=2, unique=True))
    if draw(st.booleans()):                           # a list: every value is its own outcome
        doc["field"] = {"slot": SLOT, "values": values}
        doc["candidates"] = {v: " " + v for v in values}
    else:                                             # value -> one of two outcomes, both used
        doc["field"] = {"slot": SLOT, "values": {v: ("yes" if i % 2 == 0 else "no") for i, v in enumerate(values)}}
        doc["candidates"] = {"yes": continuations[0], "no": continuations[1]}
        if draw(st.booleans()):
            doc["rule"] = draw(PLAIN) + " {gate} " + draw(PLAIN)
            doc["polarity"] = {"slot": "gate", "values": {"normal": draw(PLAIN), "inverted": draw(PLAIN)}}
    if draw(st.booleans()):
        doc["field"]["pairs"] = draw(st.lists(st.tuples(st.sampled_from(values), st.sampled_from(values)).map(list),
                                              max_size=3))
    doc["filler"] = draw(st.lists(PLAIN, max_size=5))
    doc["n_filler"] = draw(st.integers(0, len(doc["filler"])))
    doc["request"] = draw(PLAIN) + draw(st.sampled_from(["", " {name}?"]))
    if draw(st.booleans()):
        doc["variants"]["cot"] = {"decision": draw(PLAIN), "answer_prefix": draw(PLAIN),
                                  "answer_marker": draw(PLAIN)}
    return doc


@settings(max_examples=40, **COMMON)
@given(doc=valid_scenarios())
def test_valid_mutations_load_and_are_usable(doc):
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "valid", doc)
        out = load_or_error([path])
        assert not isinstance(out, ScenarioError), str(out)
        assert [s.id for s in out] == [doc["id"]]


REQUIRED = ["family", "domain", "field", "candidates", "context", "rule", "request", "variants",
            "field.slot", "field.values", "variants.direct", "variants.direct.decision",
            "variants.direct.answer_prefix"]
#: Values no coercion turns into the declared type (ints become strings: ``coerce_numbers_to_str``).
NOT_TEXT = st.lists(st.integers(), min_size=1, max_size=3) | st.dictionaries(WORD, st.integers(), min_size=1,
                                                                               max_size=2) | st.booleans()
NOT_MAPPING = st.lists(WORD, min_size=1, max_size=3) | WORD | st.integers() | st.booleans()
WRONG_TYPE = {
    "family": NOT_TEXT | st.none(), "domain": NOT_TEXT, "context": NOT_TEXT, "rule": NOT_TEXT,
    "request": NOT_TEXT, "id": NOT_TEXT, "system": NOT_TEXT,
    "field": NOT_MAPPING | st.none(), "field.slot": NOT_TEXT | st.none(), "field.values": WORD | st.integers(),
    "field.pairs": WORD | st.lists(WORD, min_size=1, max_size=2), "candidates": NOT_MAPPING,
    "slots": NOT_MAPPING, "slots.name": st.booleans() | st.dictionaries(WORD, WORD, min_size=1),
    "filler": WORD | st.dictionaries(WORD, WORD, min_size=1), "variants": NOT_MAPPING,
    "variants.direct": NOT_MAPPING, "variants.direct.answer_prefix": NOT_TEXT,
    "n_filler": st.text("abc", min_size=1) | st.floats(0.1, 0.9) | st.lists(st.integers(), min_size=1)
                | st.integers(max_value=-1) | st.integers(min_value=len(FRUIT["filler"]) + 1),
    "polarity": NOT_MAPPING,
}
#: Placeholder mistakes: undeclared, unbalanced, malformed, the field slot outside the context.
BAD_TEXT = st.sampled_from(["{nobody}", "{", "}", "{name!}", "{name!rr}", "{name:{x}", "{}", f"{{{SLOT}}}",
                            "{0}", "{name.attr}", "{name[0]}", "}{"])


def _set(doc: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = doc
    for p in parents:
        node = node[p]
    node[last] = value


def _drop(doc: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    node = doc
    for p in parents:
        node = node[p]
    del node[last]


@st.composite
def invalid_scenarios(draw):
    """A document (mapping, other YAML, raw text or raw bytes) that is not a valid scenario file."""
    doc = json.loads(json.dumps(FRUIT))
    kind = draw(st.sampled_from(["missing", "type", "unknown", "placeholder", "empty", "outcome", "n_filler",
                                 "not_mapping", "bytes", "yaml_scalar", "deep", "field_slot"]))
    if kind == "missing":
        _drop(doc, draw(st.sampled_from(REQUIRED)))
    elif kind == "type":
        key = draw(st.sampled_from(sorted(WRONG_TYPE)))
        _set(doc, key, draw(WRONG_TYPE[key]))
    elif kind == "unknown":
        where = draw(st.sampled_from(["", "field", "variants.direct", "polarity"]))
        if where == "polarity":
            doc["rule"] += " {gate}"
            doc["polarity"] = {"slot": "gate", "values": {"normal": "only", "inverted": "never"}}
        node = doc if not where else doc[where] if "." not in where else doc["variants"]["direct"]
        known = set(ScenarioFile.model_fields) | {"slot", "values", "pairs", "decision", "answer_prefix",
                                                   "answer_marker"}
        key = draw(PLAIN.filter(lambda k: k not in known))
        node[key] = draw(st.none() | WORD | st.integers())
    elif kind == "placeholder":
        key = draw(st.sampled_from(["context", "rule", "request", "filler", "variants.direct.decision",
                                    "variants.direct.answer_prefix"]))
        bad = draw(BAD_TEXT)                              # each is a mistake in each of these keys
        if key == "filler":
            doc["filler"][draw(st.integers(0, len(doc["filler"]) - 1))] += " " + bad
        else:
            node = doc["variants"]["direct"] if key.startswith("variants.") else doc
            node[key.split(".")[-1]] += " " + bad
    elif kind == "empty":
        key = draw(st.sampled_from(["field.values", "slots.name", "candidates", "variants", "field.values.one"]))
        if key == "field.values.one":
            doc["field"]["values"] = doc["field"]["values"][:1]
        elif key == "field.values" and draw(st.booleans()):
            doc["field"]["values"] = {}
        else:
            _set(doc, key, [] if key != "candidates" and key != "variants" else {})
    elif kind == "outcome":
        doc["field"]["values"] = {"apple": "apple", "grape": draw(PLAIN.filter(lambda o: o not in ("apple", "grape")))}
    elif kind == "n_filler":
        doc["n_filler"] = draw(st.integers(max_value=-1) | st.integers(min_value=len(doc["filler"]) + 1))
    elif kind == "field_slot":
        doc["context"] = doc["context"].replace(f"{{{SLOT}}}", draw(st.sampled_from(["", "{name}", "apple"])))
    elif kind == "not_mapping":
        return draw(st.lists(st.integers(), max_size=3) | WORD | st.integers() | st.none() | st.floats()
                    | st.just(""))
    elif kind == "bytes":
        return draw(st.binary(min_size=1, max_size=64)
                    | st.sampled_from([b"\xff\xfe\x80", b"a: \x00", b"a: [", b"\t- x", b"{", b"key: value: other"]))
    elif kind == "yaml_scalar":
        text = yaml.safe_dump(doc, sort_keys=False)
        key = draw(st.sampled_from(["family", "domain", "rule", "n_filler"]))
        bad = draw(st.sampled_from(["2001-02-30", "2001-13-01 10:00:00", "!!int abc", "!!float x", "!!bool maybe",
                                    "!!timestamp nope", "!!int 0x", "!!python/object:os.system x", "&a [*a]",
                                    "*undefined", "'unterminated"]))
        lines = [f"{key}: {bad}" if ln.startswith(f"{key}:") else ln for ln in text.splitlines()]
        return "\n".join(lines) + "\n"
    elif kind == "deep":
        depth = draw(st.integers(1, 300))             # deeper: the RecursionError @example below
        return "family: " + "[" * depth + "]" * depth + "\n"
    return doc


#: The fruit file with ``field.values`` as a mapping whose key ``apple`` is given twice: ``safe_load`` kept
#: the last (``apple: grape``), so the file loaded as a scenario whose pair no longer flips (issue #54).
DUPLICATE_KEY = yaml.safe_dump({**FRUIT, "field": {"slot": SLOT, "values": {"apple": "apple", "grape": "grape"}}},
                               sort_keys=False).replace("    grape: grape\n", "    grape: grape\n    apple: grape\n")


# Each bug fixed in scenarios/ (each raised another exception, or let an unusable scenario through):
@example(doc=b"\xff\xfe\x80garbage")                               # UnicodeDecodeError
@example(doc="family: " + "[" * 3000 + "]" * 3000 + "\n")          # RecursionError
@example(doc="family: 2001-02-30\n")                               # ValueError from PyYAML's constructor
@example(doc="family: !!bool maybe\n")                             # KeyError
@example(doc="family: !!timestamp nope\n")                         # AttributeError
@example(doc={**FRUIT, "n_filler": -1})                            # loaded; then ValueError drawing instances
@example(doc={**FRUIT, "unknown\nkey": 1})                         # a message of two lines
@example(doc={**FRUIT, "context": "Profile of {name}. {a\nb} {colour}."})
@example(doc={**FRUIT, "field": {"slot": SLOT, "values": ["", "grape"]}})
@example(doc=DUPLICATE_KEY)                                        # loaded; the last value silently won
@settings(max_examples=60, **COMMON)
@given(doc=invalid_scenarios())
def test_invalid_files_are_one_line_naming_the_file(doc):
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "bad", doc)
        out = load_or_error([Path(d)], named=path)
        assert isinstance(out, ScenarioError), f"loaded an invalid file: {doc!r}"


def test_lone_surrogate_is_one_line():
    """YAML's ``"\\ud800"`` escape gives a string no later step can encode (the scenario id is hashed,
    the text tokenised and written to JSON): the file is refused, naming key and file."""
    with tempfile.TemporaryDirectory() as d:
        text = yaml.safe_dump({**FRUIT, "id": "x"}, sort_keys=False).replace("id: x", 'id: "\\ud800"')
        path = _write(Path(d), "surrogate", text)
        err = load_or_error([path], named=path)
        assert isinstance(err, ScenarioError) and "key 'id'" in str(err), err


#: Arbitrary YAML data: what a hand-written file may hold anywhere.
JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
PLACES = ["id", "family", "domain", "description", "field", "field.slot", "field.values", "field.pairs",
          "candidates", "slots", "slots.name", "context", "filler", "n_filler", "rule", "request", "variants",
          "variants.direct", "variants.direct.decision", "variants.cot", "polarity", "system", "extra"]


@settings(max_examples=60, **COMMON)
@given(changes=st.lists(st.tuples(st.sampled_from(PLACES), JUNK), min_size=1, max_size=3),
       top=st.none() | JUNK)
def test_any_yaml_loads_or_is_one_line(changes, top):
    """Junk anywhere in a valid file (or as the whole document): loaded and usable, or one line."""
    doc = json.loads(json.dumps(FRUIT))
    for place, value in changes:
        parent = place.rpartition(".")[0]
        try:
            node = doc
            for p in parent.split(".") if parent else []:
                node = node[p]
            node[place.rpartition(".")[2]] = value
        except (KeyError, TypeError):
            pass                                      # the parent was replaced by junk already
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "junk", doc if top is None else top)
        out = load_or_error([path])
        if isinstance(out, ScenarioError):
            assert str(path) in str(out), str(out)


@settings(max_examples=15, **COMMON)
@given(first=valid_scenarios(), second=valid_scenarios(), by_stem=st.booleans())
def test_duplicate_ids_across_two_files_name_both(first, second, by_stem):
    """Two files of one suite with one id (explicit in both, or one file's id is the other's stem)."""
    if by_stem:
        first.pop("id")
        second["id"] = "one"
    else:
        second["id"] = first["id"]
    with tempfile.TemporaryDirectory() as d:
        a, b = _write(Path(d), "one", first), _write(Path(d), "two", second)
        err = load_or_error([Path(d)], named=b)
        assert isinstance(err, ScenarioError) and str(a) in str(err), err
        assert "key 'id'" in str(err)


@pytest.mark.parametrize("seed", [-1, -(2 ** 70)])
def test_negative_scenario_seed_is_a_scenario_error(seed):
    """``scenario.seed=-1`` passes run.py's precheck; drawing instances raised numpy's ValueError (a
    traceback after the model loaded, and the lock file left behind)."""
    with tempfile.TemporaryDirectory() as d:
        scenarios = load_suite([str(fruit_scenario(Path(d) / "fruit.yaml"))])
    with pytest.raises(ScenarioError, match="scenario.seed"):
        build_pairs(scenarios, 2, seed)


def test_memory_suite_of_garbage_bytes_is_one_line():
    from kvnotes.scenarios.memory import load_memory

    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "mem", b"\xff\xfe\x80garbage")
        with pytest.raises(ScenarioError):
            load_memory(path)


# =============================================================================== 2. config values

def run_main(args: list[str], out: Path) -> tuple[object, str, list]:
    """``run.py``'s ``main`` in this process with the job replaced by a stub (no model loads).

    Returns:
        (exit status or None, stderr, the configs the stub job received).
    """
    from kvnotes.cli import run as cli

    reached: list = []
    err = io.StringIO()
    argv = ["run.py", *args, f"out_root={out}"]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(cli, "job", reached.append), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main()
            code = None
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue(), reached


def _refused(args: list[str], code: object, err: str, out: Path) -> None:
    """Exit status 2, one stderr line ``kvnotes: error: ...``, nothing under ``out``."""
    lines = err.strip().splitlines()
    assert code == 2, (args, code, err)
    assert len(lines) == 1 and lines[0].startswith("kvnotes: error:"), (args, err)
    assert not out.exists() or not any(out.iterdir()), (args, sorted(out.rglob("*")))


def check_main(args: list[str]) -> list:
    """Run ``args`` through ``main`` (job stubbed): the job is reached, or :func:`_refused`. Returns the
    configs the job received."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "runs"
        code, err, reached = run_main(args, out)
        if reached:
            assert code in (None, 0), (args, code, err)
        else:
            _refused(args, code, err, out)
        return reached


def check_precheck(args: list[str]) -> bool:
    """What ``main`` does before Hydra runs the job (``check_choices``, ``precheck``), on ``args``: it
    passes (True), or :func:`_refused`. (A third of ``main``'s cost: Hydra's own run is left to
    :func:`check_main` in the tests that need it.)"""
    from kvnotes.cli import run as cli

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "runs"
        argv = [*args, f"out_root={out}"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                cli.check_choices(argv)
                cli.precheck(argv)
                return True
            except SystemExit as exc:
                code = exc.code
        _refused(args, code, err.getvalue(), out)
        return False


def compose(args: list[str]):
    """The run config ``args`` compose to (as ``precheck`` composes it)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from kvnotes.cli.run import CONF

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[*args, "out_root=/tmp/kvnotes-unused"])


def test_main_reaches_the_job_or_is_one_line():
    """The stubbed ``main`` that the Hydra-stage checks use: a good value reaches the job, a bad one
    is one line."""
    assert check_main(["probe=screen", "min_effect=0.5"])
    assert not check_main(["probe=screen", "min_effect=abc"])


#: Unquoted Hydra strings: no ``$`` (interpolations: see the known-violation examples), no bare ``,`` (a sweep
#: without ``-m``: likewise).
UNQUOTED = st.text(st.sampled_from(string.ascii_letters + string.digits + "_-.:/+*?%~@ =!'\"\\#&"),
                   min_size=0, max_size=10)
QUOTED = st.text(st.characters(codec="ascii", min_codepoint=32, max_codepoint=126, exclude_characters="'\\$"),
                 max_size=10).map(lambda s: f"'{s}'")
FLOATS = st.floats(allow_nan=True, allow_infinity=True).map(repr)
CHOICES = st.sampled_from(["owned", "relative", "synthetic", "first_token", "full", "cpu", "auto", "cuda", "cuda:1",
                           "direct", "cot", "recall", "policy_gate", "true", "false", "null", "[]", "[recall]",
                           "bos", "none", "attention", "decision", "field_end", "read", "nnsight"])
SCALAR = (st.integers(-3, 5).map(str) | st.integers().map(str) | FLOATS | UNQUOTED | QUOTED | CHOICES
          | st.just("null"))
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
                     | st.dictionaries(WORD, inner, max_size=2).map(
                         lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"), max_leaves=4)
PREFIX = st.sampled_from(["", "", "", "", "+", "++", "~"])

RUN_KEYS = ["min_effect", "budget_mb", "seed", "flip_rule", "readout", "device"]
SCENARIO_KEYS = ["scenario.n_instances", "scenario.variant", "scenario.families", "scenario.seed"]


def _override(prefix: str, key: str, value: str) -> str:
    return f"~{key}" if prefix == "~" and value == "" else f"{prefix}{key}={value}"


@settings(max_examples=30, **COMMON)
@given(overrides=st.lists(st.tuples(PREFIX, st.sampled_from(RUN_KEYS), VALUE), min_size=1, max_size=2))
def test_run_level_values_pass_or_are_one_line(overrides):
    check_precheck(["probe=screen"] + [_override(p, k, v) for p, k, v in overrides])


@example(overrides=[("", "scenario.seed", "-1")])
@example(overrides=[("", "scenario.families", "[nosuch]")])
@settings(max_examples=25, **COMMON)
@given(overrides=st.lists(st.tuples(PREFIX, st.sampled_from(SCENARIO_KEYS), VALUE), min_size=1, max_size=2))
def test_scenario_values_pass_or_are_one_line(overrides):
    """And a config the precheck passes gives a suite the scenario pipeline can use, or a ScenarioError
    (what the job does after the model loads, without the model)."""
    args = ["probe=screen"] + [_override(p, k, v) for p, k, v in overrides]
    deleted = any(p == "~" for p, _, _ in overrides)   # a deleted key: see test_known_violations_end_to_end
    if check_precheck(args) and not deleted:
        sc = compose(args).scenario
        try:
            scenarios = load_suite(list(sc.paths), sc.get("families"), sc.get("ids"))
            build_pairs(scenarios, min(int(sc.n_instances), 2), int(sc.seed), str(sc.variant))
        except ScenarioError as exc:
            assert len(str(exc).splitlines()) == 1


def _leaves(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _leaves(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def _probe_keys() -> list[tuple[str, str]]:
    from omegaconf import OmegaConf

    from kvnotes.harness import registry

    out = []
    for name in ("screen", "field_refresh", "edit", "suffix_recovery", "compose", "heads", "read_location",
                 "agent", "memory_placement"):
        tree = OmegaConf.to_container(OmegaConf.structured(registry.load_config(name)), resolve=False)
        out += [(name, key) for key in _leaves({k: v for k, v in tree.items() if k not in ("name", "_target_")})]
    return sorted(out)


PROBE_KEYS = _probe_keys()


@settings(max_examples=30, **COMMON)
@given(probe_key=st.sampled_from(PROBE_KEYS), prefix=PREFIX, value=VALUE)
def test_probe_values_pass_or_are_one_line(probe_key, prefix, value):
    probe, key = probe_key
    check_precheck([f"probe={probe}", _override(prefix, f"probe.{key}", value)])


@pytest.mark.parametrize("args", [
    ["min_effect=${nope}"],
    ["seed=${oc.env:KVNOTES_NO_SUCH_VARIABLE}"],
    ["readout=${readout}"],
    ["scenario.seed=1,2"],
])
def test_known_violations_before_the_job(args):
    check_main(["probe=screen", *args])


# =============================================================================== 3. end to end

SCREEN = ["probe=screen", "plot=false", "probe.progress=false", "scenario.n_instances=2"]


def _complete_record(proc, out: Path) -> None:
    from kvnotes.records.store import is_complete, load_record

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvnotes: error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    records = sorted(out.rglob("record.json"))
    assert len(records) == 1 and is_complete(records[0]), records
    assert load_record(records[0])["status"] == "complete"


#: No shrinking for the end-to-end properties (each example is a run.py process: shrinking would take
#: minutes); a failure is reported as generated.
E2E = dict(COMMON, max_examples=3, phases=[Phase.explicit, Phase.generate])


def _one_line_nothing_written(proc, out: Path) -> None:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("kvnotes: error:"), proc.stderr[-3000:]
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


@st.composite
def fruit_surfaces(draw) -> dict:
    """The fruit scenario with generated surface text (names, filler, rule, request, domain); the field,
    its context and the candidates stay, so its pairs stay token-aligned."""
    doc = json.loads(json.dumps(FRUIT))
    doc["domain"] = " ".join(draw(st.lists(WORD, min_size=1, max_size=3)))
    doc["slots"] = {"name": draw(st.lists(WORD.map(str.capitalize), min_size=1, max_size=4))}
    doc["filler"] = draw(st.lists(SENTENCE, min_size=1, max_size=4))
    doc["n_filler"] = draw(st.integers(0, len(doc["filler"])))
    doc["rule"] = draw(SENTENCE)
    doc["request"] = draw(SENTENCE)[:-1] + "?"
    return doc


@pytest.mark.embedded
@settings(**E2E)
@given(doc=fruit_surfaces())
def test_valid_generated_scenario_writes_a_complete_record(doc):
    with tempfile.TemporaryDirectory() as d:
        path, out = _write(Path(d), "fruit", doc), Path(d) / "runs"
        _complete_record(run(*SCREEN, f"scenario.paths=[{path}]", f"out_root={out}"), out)


@example(doc={**FRUIT, "n_filler": -1})        # was: a traceback drawing instances, and the lock file left
@settings(**E2E)
@given(doc=invalid_scenarios())
def test_invalid_generated_scenario_is_one_line_and_writes_nothing(doc):
    """Exit 2, one ``kvnotes: error:`` line naming the file (the only line on stderr: the files are
    checked before the model loads, so ``run.py``'s main runs in this process and the job, which
    would load the model, is never reached), no traceback, nothing under out_root."""
    with tempfile.TemporaryDirectory() as d:
        path, out = _write(Path(d), "bad", doc), Path(d) / "runs"
        code, err, reached = run_main([*SCREEN, f"scenario.paths=[{path}]"], out)
        assert not reached, err
        _refused(SCREEN, code, err, out)
        assert str(path) in err, err


def test_invalid_scenario_is_the_only_stderr_line():
    with tempfile.TemporaryDirectory() as d:
        path, out = _write(Path(d), "bad", {k: v for k, v in FRUIT.items() if k != "family"}), Path(d) / "runs"
        code, err, reached = run_main([*SCREEN, f"scenario.paths=[{path}]"], out)
        assert not reached and "key 'family'" in err, err
        _refused(SCREEN, code, err, out)


@pytest.mark.parametrize("args", [
    ["device=mps"],
    ["device=meta"],
    ["seed=-1", "flip_rule=relative", "min_effect=0"],
    ["scenario.seed=-1"],
    ["~scenario.n_instances"],
    ["~seed"],
])
def test_known_violations_are_refused_before_loading(args):
    """Each once ended in a traceback after the model loaded and left its lock file; now the precheck
    refuses it in one line and the job (which would load the model) is never reached."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "runs"
        path = fruit_scenario(Path(d) / "fruit.yaml")
        code, err, reached = run_main([*SCREEN, f"scenario.paths=[{path}]", *args], out)
        assert not reached, (args, err)
        _refused(args, code, err, out)
