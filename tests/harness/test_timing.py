"""The one timing tool: each call timed exactly once (timed calls may extend a cache in place)."""

from __future__ import annotations

import torch

from kvnotes.harness.timing import elapsed_ms, time_calls


def test_each_call_runs_once_and_keeps_the_thread_count():
    calls = []
    threads = torch.get_num_threads()
    ms = elapsed_ms(lambda: calls.append(torch.get_num_threads()))
    assert calls == [threads] and ms >= 0
    calls.clear()
    timing, last = time_calls(lambda: calls.append(1) or len(calls), warmup=2, trials=3)
    assert len(calls) == 5 and last == 5 and len(timing.trials_ms) == 3
    assert timing.min_ms <= timing.median_ms and set(timing.as_dict()) == {"median_ms", "min_ms", "trials_ms"}


def test_min_time_adds_calls_until_it_is_spent():
    import time

    timing, _ = time_calls(lambda: time.sleep(0.01), warmup=0, trials=1, min_time=0.05)
    assert len(timing.trials_ms) >= 4 and sum(timing.trials_ms) >= 50
