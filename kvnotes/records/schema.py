"""Declared result schemas and their check (record ``schema_version`` 2).

Each probe module declares ``Result``, a :class:`typing.TypedDict` of the dict its ``run(ctx)``
returns (``rows``, ``aggregates``, ``exclusions``, ``excluded`` and probe-specific keys), with its
row type. ``run.py`` checks a probe's result against it before writing the record
(:func:`check_result`), the figures of :mod:`kvnotes.plots` read only declared keys, and every
probe's test checks a result computed on the embedded model (``tests/conftest.py``,
``check_figures``).

The check is pydantic's (strict mode): every required key is present and every value, of every list
and mapping, has the declared type (``Any`` unchecked). Extra keys are allowed (probes may add
columns). Declare results with this module's ``TypedDict`` (``typing_extensions``': pydantic needs it
before Python 3.12).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import TypeAdapter, ValidationError
from typing_extensions import NotRequired, TypedDict  # noqa: F401  (re-exported for probe modules)


class SchemaError(ValueError):
    """A result that does not match its declared schema; the message gives the path."""


class PairRow(TypedDict):
    """Columns of every pair row (:func:`kvnotes.harness.pairs.pair_row` + :func:`kvnotes.harness.readout.pair_status`)."""

    pair: str
    scenario: str
    family: str
    instance: str
    s_old: float
    s_new: float
    effect: float
    flips: bool
    reason: str | None


class ExclusionRow(TypedDict):
    """An excluded pair: identifying columns and the reason."""

    pair: str
    scenario: str
    family: str
    reason: str


class Summary(TypedDict):
    """:func:`kvnotes.harness.stats.summarize` output."""

    n: int
    n_scenarios: int
    mean: float | None
    median: float | None
    ci_mean: list | None
    ci_method: str | None


class BaseResult(TypedDict):
    """Keys of every probe result."""

    rows: list[PairRow]
    aggregates: dict[str, Any]
    exclusions: dict[str, int]
    excluded: list[ExclusionRow]
    #: what the probe could not measure and why, one line each (also said on stderr by the job)
    warnings: NotRequired[list[str]]


class SplitRow(PairRow):
    """A flipping pair of a probe that selects on one split and reports on the other."""

    split: str


class CircuitResult(BaseResult):
    """Keys of every circuit probe result (``heads``, ``components``, ``direction``)."""

    rows: list[SplitRow]
    backend: str
    split: dict[str, list[str]]


@functools.lru_cache(maxsize=None)
def _adapter(schema: type) -> TypeAdapter:
    return TypeAdapter(schema)


def _where(loc: tuple) -> str:
    """A pydantic error location as a path: ``('rows', 0, 'flips')`` -> ``result.rows[0].flips``."""
    out = "result"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _TYPE_TAGS or str(part).startswith(("list[", "dict[")):
            continue                                   # a union branch pydantic names, not a key
        else:
            out += f".{part}"
    return out


#: Union-branch tags pydantic puts in error locations (not keys of the result).
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict", "function-plain"}


def check_result(result: dict, schema: type) -> None:
    """Check a probe's result (JSON-able form, e.g. read back from a record) against ``schema``
    with pydantic in strict mode (every element of every list and mapping; an int is a valid float,
    a bool is not an int).

    Raises:
        SchemaError: the first mismatch, with its path (e.g. ``result.rows[0].flips``).
    """
    try:
        _adapter(schema).validate_python(result, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "missing":
            raise SchemaError(f"{_where(err['loc'][:-1])}: missing key '{err['loc'][-1]}'") from None
        raise SchemaError(f"{_where(err['loc'])}: {err['msg']} (got {type(err['input']).__name__})") from None


def result_schema(probe_module) -> type:
    """The ``Result`` a probe module declares (:class:`BaseResult` when it declares none)."""
    return getattr(probe_module, "Result", BaseResult)
