"""Timing a probe: its best or its typical (median) time after a warm-up call."""

from __future__ import annotations

import statistics
import time


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up: what the machine can do when nothing else runs."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def typical_time(fn, repeats: int) -> float:
    """The median: what a training step meets, where gloo's collectives have a long tail of slow calls
    (the best of a few is the lucky case, up to 2x below the typical one here)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
