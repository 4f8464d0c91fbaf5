"""Timing for probes and benchmark scripts: one measurement tool for the project, on
``torch.utils.benchmark``'s clock (``torch.utils.benchmark.utils.timer.timer``: it synchronises the
accelerator before reading the host clock, so a GPU time includes the host's launch of the work;
the earlier hand-written timer read CUDA events, which exclude it: microseconds against the
milliseconds of the forwards timed here).

Every call is timed exactly once. ``torch.utils.benchmark.Timer`` itself is not used: its
``timeit`` runs two untimed warm-up calls per measurement and pins torch to one thread unless told
otherwise, while the calls timed here take seconds, run on every core, and some extend a cache in
place (a repeated call would change what is measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass, field

from torch.utils.benchmark.utils.timer import timer as clock

T = TypeVar("T")


def elapsed_ms(fn: Callable[[], object]) -> float:
    """Milliseconds taken by one call of ``fn()`` (the clock synchronises any accelerator itself)."""
    t0 = clock()
    fn()
    return (clock() - t0) * 1e3


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """``(milliseconds, value)`` of one call of ``fn()`` (:func:`elapsed_ms`)."""
    box: list = []
    ms = elapsed_ms(lambda: box.append(fn()))
    return ms, box[0]


@dataclass
class Timing:
    """Per-call wall times of one function (milliseconds) and their median and minimum."""

    trials_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.trials_ms)

    @property
    def min_ms(self) -> float:
        return min(self.trials_ms)

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "trials_ms": self.trials_ms}


def time_calls(fn: Callable[[], T], warmup: int = 1, trials: int = 5,
               min_time: float = 0.0) -> tuple[Timing, T]:
    """Timed calls of ``fn`` after ``warmup`` untimed ones: at least ``trials`` and until they add
    up to ``min_time`` seconds (as ``timeit`` does, so a fast function is sampled over as long a
    stretch of the machine's state as a slow one). Each call timed once; the last call's result is
    returned with the timing.

    Raises:
        ValueError: ``trials`` below 1 (no call to return the result of)."""
    if trials < 1:
        raise ValueError(f"time_calls: trials must be at least 1, got {trials}")
    for _ in range(warmup):
        fn()
    box: list = []
    ms: list[float] = []
    while len(ms) < trials or sum(ms) < min_time * 1e3:
        ms.append(elapsed_ms(lambda: box.__setitem__(slice(None), [fn()])))
    return Timing(ms), box[0]
