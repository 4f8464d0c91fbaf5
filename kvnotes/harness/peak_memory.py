"""Peak memory a block of work adds: the process's resident memory sampled by a thread on the CPU,
the CUDA allocator's peak on a GPU. Used by ``kvnotes battery`` (each probe's peak) and
``kvnotes bench probes`` (each method's)."""

from __future__ import annotations

import ctypes
import threading

import psutil
import torch


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``), so that a method's peak RSS is
    not hidden by pages an earlier method freed but the allocator kept; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory added while the ``with`` block runs (:attr:`peak` in bytes, :attr:`mb`): on the
    CPU the process's resident set (:mod:`psutil`) sampled every ``interval_s`` seconds by a thread,
    after :func:`release_free_memory`, above its level at entry; on a GPU
    ``torch.cuda.max_memory_allocated`` above the memory allocated at entry."""

    def __init__(self, device: torch.device | str, interval_s: float = 0.002) -> None:
        self.device, self.interval = torch.device(device), interval_s
        self.peak = 0
        self._base = self._max = 0

    @staticmethod
    def rss() -> int:
        """The process's resident set size in bytes."""
        return psutil.Process().memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._max = max(self._max, self.rss())

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            release_free_memory()
            self._base = self._max = self.rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            self._thread.join()
            self._max = max(self._max, self.rss())
            self.peak = self._max - self._base

    @property
    def mb(self) -> float:
        """:attr:`peak` in MiB."""
        return self.peak / 2**20
