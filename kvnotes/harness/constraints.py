"""Value constraints declared on the typed configs, checked before any model loads.

A probe's ``Config`` dataclass (:class:`kvnotes.harness.kit.ProbeConfig` and its subclasses) is the
one source of its keys, types and defaults. Its fields carry their allowed values as
``typing.Annotated`` metadata that OmegaConf ignores (it types and merges the YAML) and pydantic
enforces (:func:`check_values` validates the merged config with ``pydantic.TypeAdapter``):

    n_boot: Count = 2000                   # an int >= 1
    selection_fraction: OpenFraction = 0.5 # 0 < x < 1
    sink: Annotated[str, one_of("bos", "none")] = "bos"

The aliases below name the constraints the probes share; a probe may write its own with
``annotated_types`` (``Ge``, ``Gt``, ``Interval``, ``Len``) or :func:`one_of`.
"""

from __future__ import annotations

from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval, Len
from pydantic import AfterValidator, TypeAdapter, ValidationError

from kvnotes.errors import KvnotesError

#: An integer >= 1 (a number of replicates, tokens, pairs, draws, layers).
Count = Annotated[int, Ge(1)]
#: An integer >= 0 (a seam width, a number of positions that may be none).
NonNegative = Annotated[int, Ge(0)]
#: A float strictly between 0 and 1 (a selection share: both halves non-empty).
OpenFraction = Annotated[float, Interval(gt=0.0, lt=1.0)]
#: A float in (0, 1] (a share of positions, a significance level).
Share = Annotated[float, Interval(gt=0.0, le=1.0)]
#: A float >= 0 (a margin, a threshold).
NonNegativeFloat = Annotated[float, Ge(0.0)]
#: A float > 0.
PositiveFloat = Annotated[float, Gt(0.0)]
#: A non-empty list of counts, e.g. ``ks`` or ``lengths``.
Counts = Annotated[list[Count], Len(min_length=1)]
#: A non-empty list of non-negative integers, e.g. seams.
NonNegatives = Annotated[list[NonNegative], Len(min_length=1)]


def one_of(*choices: Any) -> AfterValidator:
    """A pydantic validator admitting only ``choices`` (OmegaConf has no ``Literal``), for
    ``Annotated[str, one_of("a", "b")]`` or, on list items, ``list[Annotated[str, one_of(...)]]``."""
    def check(value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(map(repr, choices))}")
        return value

    return AfterValidator(check)


def check_values(schema: type, data: dict, prefix: str = "probe") -> None:
    """Validate a merged config against the constraints declared on its dataclass ``schema``.

    Args:
        schema: the config dataclass (fields annotated with the aliases above).
        data: the config as plain data (``OmegaConf.to_container``), interpolations resolved.
        prefix: the config group, for the message (``probe.n_boot``).

    Raises:
        KvnotesError: the first violation in one line: dotted key, the allowed values, the value
            given (and how many more violations there are).
    """
    try:
        TypeAdapter(schema).validate_python(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in (prefix, *err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ").rstrip(".")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise KvnotesError(f"{key}: {msg}, got {err.get('input')!r}{more}") from None
