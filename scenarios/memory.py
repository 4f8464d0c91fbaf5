"""User-memory suites (issue #21, part 2): personas of facts, queries about them, filler, edits.

A memory suite is one YAML file (``scenarios/memory/*.yaml``; kept out of ``scenarios/suites``,
whose files are gated-decision scenarios)::

    id: personas                     # optional, defaults to the file name
    header: "Notes about the user:"  # the line before the memory (live, never precompiled)
    question: "Question: {question} Answer with one word."   # how a query is asked
    answer_prefix: "Answer:"         # starts the assistant's reply; candidates continue it
    filler:                          # neutral diary lines padding the memory to a length
      template: "Day {day}: {time}, I {activity}."   # {day} is the running line number
      slots: {time: [in the morning, ...], activity: [watered the plants, ...]}
    candidate_sets:                  # answer key -> continuation of the answer prefix
      language: {Spanish: " Spanish", French: " French"}
    personas:
      - id: maria
        facts:
          - {id: language, text: "Profile: replies in {value}.", value: Spanish, label: the reply language}
          - {id: sister, text: "Profile: the user's sister is called Ana."}
          - {id: sister_city, text: "Ana lives in Rome.", after: sister}   # placed right after 'sister'
        queries:
          - {id: language, question: "...?", candidates: language, answer: Spanish, uses: [language]}
        edits:                       # a fact's value changes mid-session (E3, E4)
          - {fact: language, value: French, query: language, answer: French}

The memory of a persona is a list of lines (:func:`memory_lines`): filler lines with the persona's
facts spread evenly among them (a fact with ``after`` directly follows its anchor). A query is
*cross-referential* when it uses two or more facts. Rendering to tokens and lengths is the
harness's job (:mod:`kvnotes.harness.memory`); this module only validates and writes text.

Every problem raises a one-line :class:`kvnotes.scenarios.errors.ScenarioError` naming the file and key.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios.schema import read_yaml, resolve_path

#: The filler slot that numbers the lines (filled by :func:`filler_lines`, never declared).
DAY_SLOT = "day"


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


class Fact(_File):
    """A memory entry of the persona; ``text`` may hold ``{value}`` (then ``value`` is required);
    ``label`` names the fact in an erratum (default: its id)."""

    id: str
    text: str
    value: str | None = None
    after: str | None = None
    label: str | None = None

    def render(self, value: str | None = None) -> str:
        """The fact's line with ``value`` (default: its own value)."""
        return self.text.replace("{value}", value if value is not None else (self.value or ""))


class Query(_File):
    """A question whose answer needs the facts ``uses``; ``answer`` is a key of its candidate set."""

    id: str
    question: str
    candidates: str
    answer: str
    uses: list[str] = Field(min_length=1)

    @property
    def cross(self) -> bool:
        return len(self.uses) > 1


class Edit(_File):
    """Fact ``fact`` takes ``value``; query ``query`` should then answer ``answer``."""

    fact: str
    value: str
    query: str
    answer: str


class Persona(_File):
    id: str
    facts: list[Fact] = Field(min_length=1)
    queries: list[Query] = Field(min_length=1)
    edits: list[Edit] = Field(default_factory=list)

    def fact(self, fid: str) -> Fact:
        return next(f for f in self.facts if f.id == fid)

    def query(self, qid: str) -> Query:
        return next(q for q in self.queries if q.id == qid)


class Filler(_File):
    template: str
    slots: dict[str, list[str]]


class MemorySuite(_File):
    """A validated memory suite file (module docstring); ``source`` is its path."""

    id: str | None = None
    header: str
    question: str
    answer_prefix: str
    filler: Filler
    candidate_sets: dict[str, dict[str, str]]
    personas: list[Persona] = Field(min_length=1)
    source: str = ""

    def candidates(self, query: Query) -> dict[str, str]:
        return self.candidate_sets[query.candidates]


def _fields(text: str) -> list[str]:
    return [n for _, n, _, _ in string.Formatter().parse(text) if n is not None]


def _check(suite: MemorySuite) -> None:
    """The checks that relate keys to each other; raises ValueError ``key: message``."""
    if _fields(suite.question) != ["question"]:
        raise ValueError("question: must hold the slot {question} once and no other slot")
    names = set(_fields(suite.filler.template))
    if DAY_SLOT not in names:
        raise ValueError(f"filler.template: must hold the slot {{{DAY_SLOT}}}")
    for n in names - {DAY_SLOT}:
        if not suite.filler.slots.get(n):
            raise ValueError(f"filler.template: slot {{{n}}} has no non-empty list in filler.slots")
    for name, cands in suite.candidate_sets.items():
        if len(cands) < 2:
            raise ValueError(f"candidate_sets.{name}: needs at least two answers")
        if len(set(cands.values())) != len(cands):
            raise ValueError(f"candidate_sets.{name}: two answers share one continuation")
    seen = set()
    for i, p in enumerate(suite.personas):
        at = f"personas[{i}]"
        if p.id in seen:
            raise ValueError(f"{at}.id: '{p.id}' is used twice")
        seen.add(p.id)
        fids = [f.id for f in p.facts]
        if len(set(fids)) != len(fids):
            raise ValueError(f"{at}.facts: two facts share an id")
        for j, f in enumerate(p.facts):
            slots = _fields(f.text)
            if set(slots) - {"value"}:
                raise ValueError(f"{at}.facts[{j}].text: only {{value}} may appear")
            if "value" in slots and not f.value:
                raise ValueError(f"{at}.facts[{j}]: text holds {{value}} but no value is given")
            if f.after is not None and (f.after not in fids or f.after == f.id):
                raise ValueError(f"{at}.facts[{j}].after: '{f.after}' is not another fact of the persona")
            if f.after is not None and p.fact(f.after).after is not None:
                raise ValueError(f"{at}.facts[{j}].after: '{f.after}' follows a fact itself (one level only)")
        qids = [q.id for q in p.queries]
        if len(set(qids)) != len(qids):
            raise ValueError(f"{at}.queries: two queries share an id")
        for j, q in enumerate(p.queries):
            if q.candidates not in suite.candidate_sets:
                raise ValueError(f"{at}.queries[{j}].candidates: no candidate set '{q.candidates}'")
            if q.answer not in suite.candidate_sets[q.candidates]:
                raise ValueError(f"{at}.queries[{j}].answer: '{q.answer}' is not in candidate set '{q.candidates}'")
            for u in q.uses:
                if u not in fids:
                    raise ValueError(f"{at}.queries[{j}].uses: no fact '{u}'")
        for j, e in enumerate(p.edits):
            if e.fact not in fids or "value" not in _fields(p.fact(e.fact).text):
                raise ValueError(f"{at}.edits[{j}].fact: '{e.fact}' is not a fact with a {{value}}")
            if e.value == p.fact(e.fact).value:
                raise ValueError(f"{at}.edits[{j}].value: equals the fact's current value")
            if e.query not in qids or e.fact not in p.query(e.query).uses:
                raise ValueError(f"{at}.edits[{j}].query: '{e.query}' is not a query that uses '{e.fact}'")
            q = p.query(e.query)
            if e.answer not in suite.candidate_sets[q.candidates]:
                raise ValueError(f"{at}.edits[{j}].answer: '{e.answer}' is not in candidate set '{q.candidates}'")


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate_memory(raw, source: str) -> MemorySuite:
    """A parsed memory-suite mapping as a :class:`MemorySuite`.

    Raises:
        ScenarioError: ``<source>: key '<dotted key>': <problem>`` (the first problem, one line).
    """
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: a memory suite file must be a mapping")
    if "source" in raw:                       # the loader sets it (the file's path): never the file
        raise ScenarioError(f"{source}: key 'source': unknown key (the loader records the file's path there)")
    try:
        suite = MemorySuite.model_validate({str(k): v for k, v in raw.items()})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p in {"str", "list", "dict", "none"}))
        msg = "missing" if err["type"] == "missing" else ("unknown key" if err["type"] == "extra_forbidden"
                                                         else err["msg"])
        raise ScenarioError(f"{source}: key '{_where(loc)}': {msg}") from None
    try:
        _check(suite)
    except ValueError as exc:
        key, _, msg = str(exc).partition(": ")
        raise ScenarioError(f"{source}: key '{key}': {msg}") from None
    return suite.model_copy(update={"id": suite.id or Path(source).stem, "source": source})


def load_memory(path: str | Path, personas: list[str] | None = None) -> MemorySuite:
    """Read and validate a memory suite file (a path relative to the project root is accepted),
    keeping only the personas ``personas`` when given.

    Raises:
        ScenarioError: unreadable YAML, a key given twice in one mapping (at any depth:
            :func:`kvnotes.scenarios.schema.read_yaml`), a schema violation, or a persona id not in the
            file, or ``personas`` is an empty list (it selects nothing; None keeps every persona).
    """
    if personas is not None and len(personas) == 0:
        raise ScenarioError(f"{path}: personas=[] selects nothing: leave it unset (null) for every persona, "
                            "or name at least one")
    p = resolve_path(path)
    if p.is_dir():
        files = sorted(p.glob("*.yaml"))
        if len(files) != 1:
            raise ScenarioError(f"{path}: a memory suite is one file; found {len(files)} YAML files (name one)")
        p = files[0]
    raw = read_yaml(p, "memory suite")
    suite = validate_memory(raw, str(p))
    if personas is not None:
        known = {x.id for x in suite.personas}
        missing = [x for x in personas if x not in known]
        if missing:
            raise ScenarioError(f"{p}: key 'personas': no persona {missing[0]!r} (known: {', '.join(sorted(known))})")
        suite = suite.model_copy(update={"personas": [x for x in suite.personas if x.id in set(personas)]})
    return suite


def filler_lines(suite: MemorySuite, persona: str, n: int, seed: int = 0) -> list[str]:
    """``n`` filler lines for ``persona``: the template with ``{day}`` = 1, 2, ... and the other
    slots drawn with a ``random.Random`` seeded from ``seed`` and the persona id (the same lines
    for every length: a longer memory extends a shorter one's filler)."""
    rng = random.Random(f"{seed}:{persona}")
    out = []
    for day in range(1, n + 1):
        values = {k: rng.choice(v) for k, v in sorted(suite.filler.slots.items())}
        out.append(suite.filler.template.format(**values, **{DAY_SLOT: day}))
    return out


def memory_lines(persona: Persona, filler: list[str], values: dict[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The persona's memory: ``(line, fact id or None)`` in order, the fact groups (a fact and the
    facts ``after`` it) spread evenly among ``filler`` — group ``g`` of ``G`` goes after filler line
    ``round((g + 0.5) * len(filler) / G)`` — in the order the file lists them.

    Args:
        values: fact id -> value overriding the file's (an edit).
    """
    values = values or {}
    groups = [[f] + [x for x in persona.facts if x.after == f.id] for f in persona.facts if f.after is None]
    G, n = len(groups), len(filler)
    at = [round((g + 0.5) * n / G) for g in range(G)]
    out: list[tuple[str, str | None]] = []
    for i in range(n + 1):
        for g in (g for g in range(G) if at[g] == i):
            out += [(f.render(values.get(f.id)), f.id) for f in groups[g]]
        if i < n:
            out.append((filler[i], None))
    return out
