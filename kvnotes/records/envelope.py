"""The record envelope as a pydantic model: what every record file holds around its probe's result.

:class:`Record` is the published contract (its JSON Schema is ``docs/record.schema.json``, written
by ``python -m kvnotes.records.envelope``); the result itself is checked against its probe's own
``Result`` (:mod:`kvnotes.records.schema`). Extra keys are allowed everywhere (a serving record adds
its engine, a newer writer may add provenance); missing or mistyped required keys are errors.

The readers (``kvnotes table``, ``kvnotes plot``, ``kvnotes report``) read records with
:func:`read_record` and make their output under :func:`reading`: a bad record is one
:class:`kvnotes.errors.KvnotesError` naming the file and the key.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvnotes.errors import KvnotesError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ModelInfo(_Open):
    """The model as loaded (:func:`kvnotes.models.loading.load_model`'s ``info``)."""

    name: str = Field(description="the conf/model entry")
    source: str = Field(description="embedded, local, hub or random")
    dtype: str | None = None
    attn_implementation: str | None = Field(None, description="as used at the end of the probe")
    model_type: str | None = None


class Host(_Open):
    platform: str
    torch_threads: int
    cuda: str | None = Field(description="CUDA device name, or null on CPU")


class ScenarioInfo(_Open):
    """The scenario suite the pairs came from (serving records: the sessions' scenarios)."""

    name: str | None = None
    n_scenarios: int
    n_pairs_aligned: int | None = None
    n_excluded: int | None = None
    families: list[str]
    rendering: str | None = Field(None, description="chat_template or plain")


class PromptTokens(BaseModel):
    """One aligned pair, decoded so a reader needs no tokenizer."""

    tokens: list[str] = Field(description="the old prompt's tokens, decoded one by one")
    new_field: list[str] = Field(description="the new value's field tokens")
    field: tuple[int, int] = Field(description="the field span [a, b) in token positions")
    decision: int = Field(description="the decision position (token index)")
    cand_old: str
    cand_new: str


class Record(_Open):
    """One job's record (``record.json``), schema version 2."""

    schema_: Literal["kvnotes.record"] = Field(alias="schema")
    schema_version: Literal[1, 2]
    status: Literal["running", "complete"]
    probe: str
    created: str = Field(description="local time, ISO 8601")
    config: dict[str, Any] = Field(description="the resolved run config")
    hydra: dict[str, Any] = Field(description="Hydra choices, overrides and output directory")
    model: ModelInfo
    seed: int
    packages: dict[str, str | None]
    git: dict[str, Any]
    host: Host
    scenario: ScenarioInfo | None = None
    prompts: dict[str, PromptTokens] = Field(default_factory=dict, description="pair id -> its tokens")
    vocab: dict[str, str] = Field(default_factory=dict, description="token id -> text of every top-1 the rows name")
    result: dict[str, Any] = Field(default_factory=dict, description="the probe's result (its own Result schema)")
    timing: dict[str, float] = Field(default_factory=dict, description="wall seconds per stage")
    inputs: dict[str, Any] | None = Field(None, description="what decides the numbers besides the config: scenario "
                                          "files' sha256, the weights' identity, the kvnotes version "
                                          "(kvnotes.harness.inputs)")


def check_record(record: dict) -> Record:
    """Validate a record's envelope.

    Raises:
        KvnotesError: the first missing or mistyped key, with its path, in one line.
    """
    try:
        return Record.model_validate(record)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise KvnotesError(f"record.{where}: {err['msg']}") from None


def read_record(path: str | Path) -> dict:
    """Read a record file (or the ``record.json`` of a directory) for a reader (table, figures,
    report) and check it: JSON, an object, the envelope (:func:`check_record`) and a ``result``.

    Raises:
        KvnotesError: one line naming ``path`` and what is wrong (unreadable, not JSON, the first
            missing or mistyped envelope key, no ``result``).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "record.json"
    try:
        text = p.read_text()
    except OSError as exc:
        raise KvnotesError(f"cannot read record {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KvnotesError(f"cannot read record {p}: not a text file") from None
    try:
        rec = json.loads(text)
    except ValueError as exc:
        raise KvnotesError(f"cannot read record {p}: not JSON ({exc})") from None
    if not isinstance(rec, dict):
        raise KvnotesError(f"cannot read record {p}: a JSON {type(rec).__name__}, not an object")
    try:
        check_record(rec)
    except KvnotesError as exc:
        raise KvnotesError(f"{p}: {exc}") from None
    if "result" not in rec:
        why = " (status 'running': the job did not finish)" if rec.get("status") == "running" else ""
        raise KvnotesError(f"{p}: record.result: Field required{why}")
    return rec


#: What a record that passed :func:`read_record` can still lack for a table, figure or page: a key
#: (or a value of another type) its probe's reader expects.
SHAPE_ERRORS = (KeyError, TypeError, IndexError, AttributeError)


@contextmanager
def reading(path: str | Path, what: str):
    """Turn a :data:`SHAPE_ERRORS` exception raised while making ``what`` (``"table"``,
    ``"figures"``, ``"report page"``) from the record at ``path`` into one line naming the file and
    the key (the original exception is kept as ``__cause__``).

    Raises:
        KvnotesError: the record lacks a key (or holds a value of another type) that ``what`` reads.
    """
    try:
        yield
    except KeyError as exc:
        raise KvnotesError(f"{path}: cannot make its {what}: the record lacks key {exc.args[0]!r} "
                           f"(written by another kvnotes version, or edited?)") from exc
    except SHAPE_ERRORS as exc:
        raise KvnotesError(f"{path}: cannot make its {what}: {type(exc).__name__}: {exc}") from exc


def json_schema() -> dict:
    """The JSON Schema of :class:`Record` (published as ``docs/record.schema.json``)."""
    return Record.model_json_schema(by_alias=True)


if __name__ == "__main__":
    json.dump(json_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
