"""Timing for probes and benchmark scripts, through ``torch.utils.benchmark``: one measurement
tool for the project.

``torch.utils.benchmark.Timer`` synchronises the accelerator (``torch.accelerator.synchronize``)
before reading the host clock, so a GPU time includes the host's launch of the work (the earlier
hand-written timer read CUDA events, which exclude it; for the forwards timed here the difference
is the launch overhead, microseconds against milliseconds).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils import benchmark


def elapsed_ms(fn: Callable[[], object], cuda: bool = False) -> float:
    """Milliseconds taken by one call of ``fn()`` (a ``Timer.timeit(1)`` measurement; ``cuda`` is
    kept for callers' clarity: the timer synchronises any accelerator itself)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).timeit(1).mean * 1e3


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


def time_calls(fn: Callable[[], object], warmup: int = 1, trials: int = 5,
               min_time: float = 0.0) -> tuple[Timing, object]:
    """Timed calls of ``fn`` after ``warmup`` untimed ones: at least ``trials`` and until they add
    up to ``min_time`` seconds (as ``timeit`` does, so a fast function is sampled over as long a
    stretch of the machine's state as a slow one). One ``Timer.timeit(1)`` per call, so the last
    call's result can be returned with the timing."""
    for _ in range(warmup):
        fn()
    box: list = []
    timer = benchmark.Timer(stmt="box[:] = [fn()]", globals={"fn": fn, "box": box})
    ms: list[float] = []
    while len(ms) < trials or sum(ms) < min_time * 1e3:
        ms.append(timer.timeit(1).mean * 1e3)
    return Timing(ms), box[0] if box else None
