"""Declared result schemas and their check (record ``schema_version`` 2).

Each probe module declares ``Result``, a :class:`typing.TypedDict` of the dict its ``run(ctx)``
returns (``rows``, ``aggregates``, ``exclusions``, ``excluded`` and probe-specific keys), with its
row type. ``run.py`` checks a probe's result against it before writing the record
(:func:`check_result`), the figures of :mod:`kvnotes.plots` read only declared keys, and every
probe's test checks a result computed on the embedded model (``tests/conftest.py``,
``check_figures``).

The check is structural: every required key is present, and values have the declared type
(``TypedDict`` recursively; ``list[T]`` and ``dict[str, T]`` on their first elements; ``Optional``
and unions; ``Any`` unchecked). Extra keys are allowed (probes may add columns).
"""

from __future__ import annotations

import types
import typing
from typing import Any, NotRequired, TypedDict  # noqa: F401  (re-exported for probe modules)

#: Elements of a list or dict checked against its declared element type.
CHECK_FIRST = 3


class SchemaError(ValueError):
    """A result that does not match its declared schema; the message gives the path."""


class PairRow(TypedDict):
    """Columns of every pair row (:func:`kvnotes.pairs.pair_row` + :func:`kvnotes.readout.pair_status`)."""

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
    """:func:`kvnotes.stats.summarize` output."""

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


class SplitRow(PairRow):
    """A flipping pair of a probe that selects on one split and reports on the other."""

    split: str


class CircuitResult(BaseResult):
    """Keys of every circuit probe result (``heads``, ``components``, ``direction``)."""

    rows: list[SplitRow]
    backend: str
    split: dict[str, list[str]]


def _is_typeddict(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _check(value, tp, path: str) -> None:
    if tp is Any or tp is typing.Any:
        return
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for alt in typing.get_args(tp):
            try:
                _check(value, alt, path)
                return
            except SchemaError as exc:
                errors.append(str(exc))
        raise SchemaError(f"{path}: {type(value).__name__} matches none of {tp}")
    if tp is type(None) or tp is None:
        if value is not None:
            raise SchemaError(f"{path}: expected None, got {type(value).__name__}")
        return
    if _is_typeddict(tp):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected a mapping ({tp.__name__}), got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        for key in tp.__required_keys__:
            if key not in value:
                raise SchemaError(f"{path}: missing key '{key}' ({tp.__name__})")
        for key, sub in hints.items():
            if key in value:
                _check(value[key], sub, f"{path}.{key}")
        return
    if origin is list or tp is list:
        if not isinstance(value, list | tuple):
            raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        for i, v in enumerate(value[:CHECK_FIRST]):
            if args:
                _check(v, args[0], f"{path}[{i}]")
        return
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected a mapping, got {type(value).__name__}")
        args = typing.get_args(tp)
        for k in list(value)[:CHECK_FIRST]:
            if args:
                _check(value[k], args[1], f"{path}[{k!r}]")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{path}: expected a number, got {type(value).__name__}")
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{path}: expected an int, got {type(value).__name__}")
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{path}: expected a bool, got {type(value).__name__}")
        return
    if isinstance(tp, type) and not isinstance(value, tp):
        raise SchemaError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")


def check_result(result: dict, schema: type) -> None:
    """Check a probe's result (JSON-able form, e.g. read back from a record) against ``schema``.

    Raises:
        SchemaError: the first mismatch, with its path (e.g. ``result.rows[0].flips``).
    """
    _check(result, schema, "result")


def result_schema(probe_module) -> type:
    """The ``Result`` a probe module declares (:class:`BaseResult` when it declares none)."""
    return getattr(probe_module, "Result", BaseResult)
