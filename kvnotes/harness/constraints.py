"""Value constraints declared on the typed configs, checked before any model loads.

A probe's ``Config`` dataclass (:class:`kvnotes.harness.kit.ProbeConfig` and its subclasses) is the
one source of its keys, types and defaults. Its fields carry their allowed values as
``typing.Annotated`` metadata that OmegaConf ignores (it types and merges the YAML) and pydantic
enforces (:func:`check_values` validates the merged config with ``pydantic.TypeAdapter``):

    n_boot: Count = 2000                   # an int >= 1
    selection_fraction: OpenFraction = 0.5 # 0 < x < 1
    sink: Annotated[str, one_of("bos", "none")] = "bos"

The aliases below name the constraints the probes share; a probe may write its own with
``annotated_types`` (``Ge``, ``Gt``, ``Interval``, ``Len``) or :func:`one_of`. What a probe's keys
alone cannot say it checks against the run's settings in ``Config.check_run``
(:meth:`kvnotes.harness.kit.ProbeConfig.check_run`; e.g. :func:`require_instances`), also before any
model loads; what depends on the model's shape (a layer index beyond its depth) is a
:class:`kvnotes.errors.ModelFitError` raised as soon as the model is loaded, before any work.
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


def _band_list(value: Any, integers: bool = False) -> Any:
    """A non-empty list of ``[lo, hi]`` bands, numbers (integers with ``integers``) with ``0 <= lo < hi``."""
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty list of [lo, hi] bands")
    kinds = int if integers else int | float
    for band in value:
        if (not isinstance(band, list) or len(band) != 2
                or not all(isinstance(x, kinds) and not isinstance(x, bool) for x in band)
                or not 0 <= band[0] < band[1]):
            what = "layer indices" if integers else "numbers"
            raise ValueError(f"band {band!r} is not [lo, hi] with {what} 0 <= lo < hi")
    return value


def _layer_bands(value: Any) -> Any:
    """A number of equal bands (an int >= 1) or a list of ``[lo, hi)`` layer ranges (:func:`_band_list`)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if not isinstance(value, list):
        raise ValueError("must be a number of bands >= 1 or a non-empty list of [lo, hi] layer ranges")
    return _band_list(value, integers=True)


#: Layer bands as :func:`kvnotes.harness.kit.layer_bands` takes them in layer units: a number of
#: equal bands, or a non-empty list of ``[lo, hi)`` layer ranges (``0 <= lo < hi``; ``hi`` is checked
#: against the model's depth once it is loaded, a :class:`kvnotes.errors.ModelFitError`).
LayerBands = Annotated[Any, AfterValidator(_layer_bands)]
#: Bands as a non-empty list of ``[lo, hi]`` numbers (``0 <= lo < hi``), in fractions of depth or
#: layers (the probe's units; checked against the model once it is loaded).
BandList = Annotated[Any, AfterValidator(_band_list)]


def require_instances(run: Any, least: int, probe: str, why: str) -> None:
    """Refuse a run that draws fewer than ``least`` instances per scenario, for a probe whose point
    is a split of each scenario's instances (selection / held-out,
    :func:`kvnotes.harness.selection.split_instances`): with one instance every pair is held out
    and nothing is selected. For :meth:`kvnotes.harness.kit.ProbeConfig.check_run`.

    Args:
        run: the typed run config (:class:`kvnotes.harness.runconfig.RunSettings`).
        why: what the probe does with the split, e.g. ``"ranks positions on selection instances and
            tests them on held-out ones"``.

    Raises:
        KvnotesError: ``scenario.n_instances < least``, in one line naming the key, the probe and why.
    """
    n = int(run.scenario.n_instances)
    if n < least:
        raise KvnotesError(f"scenario.n_instances={n}: {probe} {why}; it needs scenario.n_instances >= {least}")


def require_field_placement(run: Any, probe: str, why: str) -> None:
    """Refuse a run that moves the field's line (``scenario.field_placement`` other than ``first``)
    for a probe that lays out the prompt's lines itself, so the key would go unread.

    Raises:
        KvnotesError: in one line naming the key, the probe and why.
    """
    placement = str(run.scenario.field_placement)
    if placement != "first":
        raise KvnotesError(f"scenario.field_placement={placement}: {probe} {why}; it runs with the field's line "
                           f"first only")


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
