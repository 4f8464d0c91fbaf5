"""Wall time of one call for the benchmark scripts: CUDA events on a GPU, ``perf_counter`` on CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def elapsed_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Milliseconds taken by ``fn()``.

    On a GPU (``cuda=True``) the device is synchronised before and after and the time comes from a
    pair of ``torch.cuda.Event`` (kernel time, not launch time); on CPU from ``time.perf_counter``.
    """
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3
