"""The scenario schema and its validation (docs/design.md §3).

A scenario file is YAML with these keys (see ``scenarios/suites/*/*.yaml`` for examples)::

    id: account_role                 # optional, defaults to the file name
    family: policy_gate              # policy_gate | recall | lookup | language | control | ...
    domain: account role
    field:
      slot: role                     # the slot in `context` that holds the field
      values: {admin: allow, viewer: deny}   # value -> outcome (a key of `candidates`);
                                             # a list means each value is its own outcome
      pairs: [[viewer, admin]]       # optional (old, new) pairs; default: every unordered pair
    candidates: {allow: " Yes", deny: " No"}   # outcome -> continuation compared at the decision
    slots: {name: [Ana Ruiz, ...], account_id: "AC-#####"}   # surface details: a list is drawn
                                     # from; a string is a pattern whose '#' become random digits
    context: "Account {account_id} ... Role: {role}."   # must hold the field slot exactly once
    filler: [sentence, ...]          # n_filler of them, in a random order, after the context
    n_filler: 3
    rule: "Only admins may ..."      # the gate; placed after the field, must not hold the field
    request: "{name} asks to ..."
    variants:
      direct: {decision: "Answer Yes or No.", answer_prefix: "Answer:"}
      cot: {decision: "Think step by step, then answer.", answer_prefix: "Reasoning:",
            answer_marker: "Answer:"}  # answer_marker (cot): the decision is read after it
    polarity:                        # optional: the rule's trigger word flipped, field fixed
      slot: gate                     # a slot used in `rule`
      values: {normal: "only", inverted: "never"}   # inverted swaps the two outcomes

Pairs whose two values have different outcomes are expected to flip; a scenario whose values all
share one outcome (family ``control``) is expected not to.

Nothing is read silently wrong (issue #54): a key given twice in one mapping, two files with one id,
identical bytes or the same scenario, and an empty ``families`` / ``ids`` list are each an error.
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic import Field as PydField

from kvnotes.scenarios.errors import ScenarioError

#: The scenarios package (``kvnotes/scenarios``); a relative suite path not found from the working
#: directory is looked up beside it, in the ``kvnotes`` package (``scenarios/suites``).
ROOT = Path(__file__).parent
#: The suites that ship with kvnotes (``scenario=default`` reads them all).
SUITES_DIR = ROOT / "suites"


@dataclass(frozen=True)
class Variant:
    """How the decision is asked: the last user line and the assistant's answer prefix."""

    decision: str
    answer_prefix: str
    #: chain-of-thought variants: the decision is read after this marker in the generated text
    answer_marker: str = "Answer:"


@dataclass(frozen=True)
class Scenario:
    """A validated scenario (see the module docstring for the meaning of each field)."""

    id: str
    family: str
    domain: str
    source: str
    field_slot: str
    values: dict[str, str]
    pairs: tuple[tuple[str, str], ...]
    candidates: dict[str, str]
    slots: dict[str, Any]
    context: str
    filler: tuple[str, ...]
    n_filler: int
    rule: str
    request: str
    variants: dict[str, Variant]
    polarity_slot: str | None = None
    polarity_values: dict[str, str] = field(default_factory=dict)
    system: str | None = None

    def outcome(self, value: str, polarity: str = "normal") -> str:
        """The outcome (candidate key) the scenario's gate implies for ``value``."""
        out = self.values[value]
        if polarity == "inverted":
            a, b = sorted(set(self.values.values()))
            out = b if out == a else a
        return out

    def expect_flip(self, old: str, new: str) -> bool:
        """True when the two values imply different outcomes."""
        return self.values[old] != self.values[new]


def _placeholders(text: str) -> list[str]:
    try:
        return [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"malformed braces ({exc})") from None


def _fail(source: str, key: str, msg: str) -> None:
    raise ScenarioError(f"{source}: key '{key}': {msg}")


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


class FieldFile(_File):
    """``field:`` of a scenario file."""

    slot: str
    values: dict[str, str] | list[str] = PydField(description="value -> outcome, or values that are their own outcomes")
    pairs: list[tuple[str, str]] | None = None


class VariantFile(_File):
    """One entry of ``variants:``."""

    decision: str
    answer_prefix: str
    answer_marker: str = "Answer:"


class PolarityFile(_File):
    """``polarity:`` of a scenario file."""

    slot: str
    values: dict[Literal["normal", "inverted"], str]


class ScenarioFile(_File):
    """A scenario file as written (the module docstring gives each key's meaning); :func:`validate`
    adds the checks that relate keys to each other."""

    id: str | None = None
    family: str
    domain: str
    description: str | None = None
    field: FieldFile
    candidates: dict[str, str]
    slots: dict[str, str | list[str]] = PydField(default_factory=dict)
    context: str
    filler: list[str] = PydField(default_factory=list)
    n_filler: int | None = PydField(default=None, ge=0)
    rule: str
    request: str
    variants: dict[str, VariantFile]
    polarity: PolarityFile | None = None
    system: str | None = None


def _key(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parse(raw: Any, source: str) -> ScenarioFile:
    """The file's mapping as a :class:`ScenarioFile` (pydantic), or one line naming file and key."""
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: a scenario file must be a mapping")
    bad = _unencodable(raw)
    if bad is not None:
        _fail(source, bad, "not valid UTF-8 text (a lone surrogate such as '\\ud800')")
    try:
        return ScenarioFile.model_validate({k if isinstance(k, str) else str(k): v for k, v in raw.items()})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
        key = _key(loc)
        if err["type"] == "missing":
            _fail(source, key, "missing")
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(ScenarioFile.model_fields if len(loc) == 1 else []))
            _fail(source, key, "unknown key" + (f" (known: {known})" if known else ""))
        _fail(source, key, err["msg"])
    raise AssertionError("unreachable")


#: Union-branch names pydantic puts in error locations (not keys of the file).
_UNION_TAGS = {"str", "list", "dict", "none"}


def _unencodable(raw: Any) -> str | None:
    """The dotted key of the first string (a key or a value) in ``raw`` that cannot be written as
    UTF-8 (a lone surrogate, e.g. YAML's ``"\\ud800"``: every later step that encodes it would fail),
    or None. Walks without recursion and visits each container once (YAML aliases may make a
    structure refer to itself)."""
    stack: list[tuple[str, Any]] = [("", raw)]
    seen: set[int] = set()
    while stack:
        key, node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                where = key or "(top level)"       # the key may hold the surrogate: shown escaped
                return where.encode("utf-8", "backslashreplace").decode("utf-8")
        elif isinstance(node, (dict, list, tuple, set, frozenset)) and id(node) not in seen:
            seen.add(id(node))
            if isinstance(node, dict):
                children = [(f"{key}.{k}" if key else str(k), x) for k, v in node.items() for x in (k, v)]
            else:
                children = [(f"{key}[{i}]", v) for i, v in enumerate(node)]
            stack.extend(reversed(children))
    return None


def validate(raw: Any, source: str) -> Scenario:
    """Validate a parsed scenario mapping and return a :class:`Scenario`: the file's shape and types
    with pydantic (:class:`ScenarioFile`), then the checks that relate keys to each other (outcomes
    are candidates, slots are declared, the field slot appears once, in the context).

    Raises:
        ScenarioError: naming the file and the key at fault, in one line.
    """
    f = _parse(raw, source)
    slot = f.field.slot
    values = {v: v for v in f.field.values} if isinstance(f.field.values, list) else dict(f.field.values)
    if len(values) < 2:
        _fail(source, "field.values", "needs at least two values")
    if "" in values:
        _fail(source, "field.values", "a value is empty (the field must have a token to change)")
    candidates = dict(f.candidates)
    if len(candidates) < 2:
        _fail(source, "candidates", "needs at least two outcome -> continuation entries")
    for value, outcome in values.items():
        if outcome not in candidates:
            _fail(source, f"field.values.{value}", f"outcome '{outcome}' is not a key of 'candidates'")
    if len(set(candidates.values())) != len(candidates):
        _fail(source, "candidates", "two outcomes share one continuation")
    keys = list(values)
    pairs = f.field.pairs if f.field.pairs is not None else \
        [(keys[i], keys[j]) for i in range(len(keys)) for j in range(i + 1, len(keys))]
    for i, pair in enumerate(pairs):
        if not all(v in values for v in pair):
            _fail(source, f"field.pairs[{i}]", f"must be [old, new] with both in field.values, got {list(pair)!r}")
    pairs = tuple((a, b) for a, b in pairs)
    slots = dict(f.slots)
    for name, opts in slots.items():
        if isinstance(opts, list) and not opts:
            _fail(source, f"slots.{name}", "must be a non-empty list or a pattern string")
    pol_slot, pol_values = None, {}
    if f.polarity is not None:
        if set(f.polarity.values) != {"normal", "inverted"}:
            _fail(source, "polarity", "needs slot and values {normal, inverted}")
        if len(set(candidates)) != 2 or len(set(values.values())) != 2:
            _fail(source, "polarity", "needs exactly two outcomes, both used by field.values, to invert")
        pol_slot, pol_values = f.polarity.slot, dict(f.polarity.values)
    if "direct" not in f.variants:
        _fail(source, "variants", "needs at least a 'direct' variant")
    parsed_variants = {}
    for name, var in f.variants.items():
        if "{" in var.answer_prefix or "}" in var.answer_prefix:
            _fail(source, f"variants.{name}.answer_prefix", "takes no slots (braces are not filled here)")
        parsed_variants[name] = Variant(var.decision, var.answer_prefix, var.answer_marker)
    filler = f.filler
    texts = {"context": f.context, "rule": f.rule, "request": f.request}
    texts.update({f"variants.{n}.decision": v.decision for n, v in parsed_variants.items()})
    texts.update({f"filler[{i}]": sentence for i, sentence in enumerate(filler)})
    allowed = set(slots) | {slot} | ({pol_slot} if pol_slot else set())
    field_uses = 0
    for key, text in texts.items():
        try:
            names = _placeholders(text)
        except ValueError as exc:
            _fail(source, key, str(exc))
        for name in names:
            if name not in allowed:
                _fail(source, key, f"slot '{{{name}}}' is not declared in 'slots'")
        field_uses += names.count(slot)
        if key != "context" and slot in names:
            _fail(source, key, f"the field slot '{{{slot}}}' may appear only in 'context' (the rule comes after the field)")
    if field_uses != 1:
        _fail(source, "context", f"must contain the field slot '{{{slot}}}' exactly once (found {field_uses})")
    if pol_slot and pol_slot not in _placeholders(f.rule):
        _fail(source, "polarity.slot", f"slot '{{{pol_slot}}}' is not used in 'rule'")
    n_filler = f.n_filler if f.n_filler is not None else min(3, len(filler))
    if n_filler > len(filler):
        _fail(source, "n_filler", f"{n_filler} exceeds the {len(filler)} filler sentences")
    return Scenario(
        id=f.id or Path(source).stem, family=f.family, domain=f.domain,
        source=source, field_slot=slot, values=values, pairs=pairs, candidates=candidates, slots=slots,
        context=f.context, filler=tuple(filler), n_filler=n_filler, rule=f.rule,
        request=f.request, variants=parsed_variants, polarity_slot=pol_slot,
        polarity_values=pol_values, system=f.system,
    )


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate one scenario YAML file.

    Raises:
        ScenarioError: unreadable YAML or a schema violation (the message names file and key).
    """
    path = Path(path)
    return validate(read_yaml(path, "scenario"), str(path))


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives one key more than once (raised by :class:`UniqueKeyLoader`).

    Attributes:
        key: the dotted key (``field.values.admin``, ``personas[0].id``) as the file writes it.
        problem: what is wrong and where, e.g. ``given twice (lines 7 and 9)``.
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"key '{key}': {problem}")
        self.key, self.problem = key, problem


def _times(n: int) -> str:
    """``twice``, ``3 times``, ..."""
    return "twice" if n == 2 else f"{n} times"


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _positions(nodes: list[yaml.Node]) -> str:
    """Where the key nodes stand: ``lines 7 and 9``, or ``line 7, columns 3 and 20`` (one line), or
    ``7:3, 7:20 and 9:1 (line:column)``."""
    marks = [(n.start_mark.line + 1, n.start_mark.column + 1) for n in nodes]
    lines = [ln for ln, _ in marks]
    if len(set(lines)) == len(lines):
        return "lines " + _and([str(ln) for ln in lines])
    if len(set(lines)) == 1:
        return f"line {lines[0]}, columns " + _and([str(c) for _, c in marks])
    return _and([f"{ln}:{c}" for ln, c in marks]) + " (line:column)"


def _as_written(node: yaml.ScalarNode) -> str:
    """A key scalar as the file writes it: quoted when the file quotes it (``'1'`` is not ``1``)."""
    quote = node.style if node.style in ("'", '"') else ""
    return f"{quote}{node.value}{quote}"


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice, at any depth (a plain ``safe_load``
    keeps the last value and drops the other without a word).

    Keys are one key when Python's dict would merge them (``1``, ``1.0``, ``true``) or when they read
    as the same text (``1`` and ``'1'``: the scenario and memory schemas read every key as text). The
    keys a merge (``<<: *anchor``) brings in may be overridden, as YAML intends; only the keys a
    mapping writes itself must be unique. Each node's dotted key is recorded as the constructor
    reaches it, so the error names where the mapping sits.
    """

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._paths: dict[yaml.Node, str] = {}
        self._own: dict[yaml.Node, list] = {}

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Record the mapping's own pairs, then merge ``<<`` keys into it (PyYAML)."""
        self._own.setdefault(node, [pair for pair in node.value if pair[0].tag != _MERGE])
        super().flatten_mapping(node)

    def construct_sequence(self, node: yaml.Node, deep: bool = False) -> list:
        """The sequence's items (PyYAML), each item's dotted key recorded (``<key>[i]``)."""
        if isinstance(node, yaml.SequenceNode):
            base = self._paths.get(node, "")
            for i, child in enumerate(node.value):
                self._paths.setdefault(child, f"{base}[{i}]")
        return super().construct_sequence(node, deep=deep)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        """The mapping (PyYAML), after checking that no key is given twice.

        Raises:
            DuplicateKeyError: naming the dotted key and the lines (and columns) of its occurrences.
        """
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)        # records the mapping's own pairs first (idempotent)
            own = self._own[node]
            base = self._paths.get(node, "")
            for key_node, value_node in own:
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                self._paths.setdefault(value_node, f"{base}.{name}" if base else str(name))
            self._check_unique(base, [k for k, _ in own])
        return super().construct_mapping(node, deep=deep)

    def _check_unique(self, base: str, keys: list[yaml.Node]) -> None:
        """The scalar keys ``keys`` of the mapping at ``base`` are distinct (the rules of the class docstring).

        Raises:
            DuplicateKeyError: for the first key given more than once, with all its occurrences.
        """
        groups: list[list[yaml.Node]] = []
        by_value: dict[Any, int] = {}
        by_text: dict[str, int] = {}
        for key_node in keys:
            if not isinstance(key_node, yaml.ScalarNode):
                continue                      # a list or mapping key: PyYAML refuses it (unhashable)
            key = self.construct_object(key_node)
            at = by_value.get(key, by_text.get(str(key)))
            if at is None:
                at = len(groups)
                groups.append([])
                by_value.setdefault(key, at)
                by_text.setdefault(str(key), at)
            groups[at].append(key_node)
        for group in groups:
            if len(group) > 1:
                first = group[0].value
                where = f"{base}.{first}" if base else str(first)
                written = list(dict.fromkeys(_as_written(n) for n in group))
                problem = f"given {_times(len(group))} ({_positions(group)})"
                if len(written) > 1:
                    problem += ", as " + _and(written) + ", which read as one key"
                raise DuplicateKeyError(where, problem + ": remove all but one (YAML would silently keep the last)")


def read_yaml(path: Path, what: str = "scenario") -> Any:
    """The parsed content of a YAML file (``yaml.safe_load``'s, through :class:`UniqueKeyLoader`: a key
    given twice in one mapping is an error, not a silently dropped value).

    Raises:
        ScenarioError: ``<path>: key '<dotted key>': given twice (lines 7 and 9): remove all but one ...``
            in one line when a mapping repeats a key. ``<path>: cannot read <what> (<reason>)`` in one line when the file
            cannot be read (missing, a directory, no permission), is not UTF-8 text, or is not YAML that
            ``safe_load`` can build. PyYAML's constructors raise more than ``YAMLError`` on text that
            scans (an impossible date ``2001-02-30`` or ``!!int abc``: ``ValueError``; ``!!bool maybe``:
            ``KeyError``; ``!!timestamp x``: ``AttributeError``) and deep nesting exhausts the stack
            (``RecursionError``); ``safe_load`` runs no code of the file's, so every failure is the
            file's fault and this error.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read {what} ({_first_line(exc)})") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- safe_load builds plain data only: any failure is the text's
        raise ScenarioError(f"{path}: cannot read {what} ({_first_line(exc)})") from None


def resolve_path(path: str | Path) -> Path:
    """A suite path: absolute, relative to the working directory, or relative to the installed
    ``kvnotes`` package (``scenarios/suites``: the suites that ship with it)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return ROOT.parent / p


def _suite_files(paths: list[str]) -> list[Path]:
    """Every ``*.yaml`` under the given files/directories, each directory's sorted by path.

    Raises:
        ScenarioError: a path does not exist, or two paths reach one file (``[suites, suites/recall]``,
            or a link to a file listed already).
    """
    files: list[Path] = []
    reached: dict[Path, str] = {}
    for entry in paths:
        p = resolve_path(entry)
        if p.is_dir():
            found = sorted(p.rglob("*.yaml"))
        elif p.is_file():
            found = [p]
        else:
            raise ScenarioError(f"scenario path not found: {entry}")
        for f in found:
            real = f.resolve()
            if real in reached:
                raise ScenarioError(f"{f}: reached twice through the scenario paths ({reached[real]} and {entry}): "
                                    "name each file once")
            reached[real] = str(entry)
            files.append(f)
    return files


def _check_distinct_content(files: list[Path]) -> None:
    """No two files hold the same bytes (each would count as a scenario: the same one, twice).

    Raises:
        ScenarioError: ``<second>: identical content to <first>: ...``, in one line (a file that cannot
            be read is skipped: :func:`read_yaml` reports it).
    """
    first: dict[bytes, Path] = {}
    for f in files:
        try:
            digest = hashlib.sha256(f.read_bytes()).digest()
        except OSError:
            continue
        if digest in first:
            raise ScenarioError(f"{f}: identical content to {first[digest]}: the same scenario would count twice; "
                                "remove one")
        first[digest] = f


def _check_distinct_scenarios(scenarios: list[Scenario]) -> None:
    """No two scenarios are the same apart from their id (and the file's comments, layout and
    ``description``): a copy under another name counts one scenario twice.

    Raises:
        ScenarioError: naming both files, in one line.
    """
    bare = [replace(s, id="", source="") for s in scenarios]
    for j in range(len(bare)):
        for i in range(j):
            if bare[i] == bare[j]:
                raise ScenarioError(f"{scenarios[j].source}: the same scenario as {scenarios[i].source} (they differ "
                                    "only in id, description or layout): it would count twice; remove one")


def _check_selection(families: list[str] | None, ids: list[str] | None) -> None:
    """An empty ``families`` or ``ids`` list selects nothing (it is not "every").

    Raises:
        ScenarioError: ``scenario.families=[] selects nothing: ...`` (or ``ids``), in one line.
    """
    for key, chosen, every in (("families", families, "family"), ("ids", ids, "scenario")):
        if chosen is not None and len(chosen) == 0:
            raise ScenarioError(f"scenario.{key}=[] selects nothing: leave it unset (null) for every {every}, "
                                "or name at least one")


def load_suite(paths: list[str], families: list[str] | None = None, ids: list[str] | None = None) -> list[Scenario]:
    """Load every ``*.yaml`` under the given files/directories, sorted by path, optionally filtered
    (``families`` / ``ids``: None keeps every scenario; a list keeps those it names).

    Raises:
        ScenarioError: in one line, the first of: ``families`` or ``ids`` is an empty list, a path does
            not exist, two paths reach one file, a file is invalid (a key given twice in a mapping
            included), two files share an id, two files hold identical bytes, two files hold the same
            scenario under different ids (or layouts), the filter leaves nothing.
    """
    _check_selection(families, ids)
    files = _suite_files(paths)
    scenarios = [load_scenario(f) for f in files]
    seen: dict[str, str] = {}
    for s in scenarios:
        if s.id in seen:
            raise ScenarioError(f"{s.source}: key 'id': '{s.id}' already used by {seen[s.id]}")
        seen[s.id] = s.source
    _check_distinct_content(files)
    _check_distinct_scenarios(scenarios)
    everything = scenarios
    for key, asked, of in (("families", families, lambda s: s.family), ("ids", ids, lambda s: s.id)):
        if asked is None:
            continue
        have = {of(s) for s in everything}
        missing = [str(x) for x in asked if x not in have]
        if missing:                       # a misspelt family would otherwise drop out without a word
            raise ScenarioError(f"scenario.{key} names {', '.join(missing)}, which no scenario under {paths} has "
                                f"({key} there: {', '.join(sorted(have))}); name those, or leave scenario.{key} "
                                f"unset (null) for all")
        scenarios = [s for s in scenarios if of(s) in set(asked)]
    if not scenarios:
        raise ScenarioError(f"no scenarios selected from {paths} (families={families}, ids={ids})")
    return scenarios
