"""Timing a probe: its best or its typical (median) time after a warm-up call, or several probes interleaved."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

_clock: list[Callable[[], float]] = [time.perf_counter]


def clock() -> float:
    """What times the probes: the wall clock, or where `use_clock` set it, another (bench/speed.py --cpu-time)."""
    return _clock[0]()


def current_clock() -> Callable[[], float]:
    """What `clock` reads (a measurement in a process of its own times its probes with the same)."""
    return _clock[0]


def use_clock(fn: Callable[[], float]) -> None:
    """Time the probes with `fn`: time.thread_time at one thread counts this process's work alone, which a
    machine shared with other jobs stretches on the wall clock by as much as 25x (2 cores, load 10)."""
    _clock[0] = fn


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up: what the machine can do when nothing else runs."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def typical_time(fn, repeats: int) -> float:
    """The median: what a training step meets, where gloo's collectives have a long tail of slow calls
    (the best of a few is the lucky case, up to 2x below the typical one here)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def interleaved_times(steps: dict[str, Callable[[], None]], rounds: int,
                      warmed: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each step in each round, the steps run once per round in an order shuffled alike on every
    rank (they may be collectives). Differences taken within a round are paired: timed one after the other,
    minutes apart, a drift of the machine's speed between two steps reads as their difference (FSDP2's costs
    read 2-3x apart so). `warmed` runs after each step's warm-up call (a barrier between ranks)."""
    for step in steps.values():
        step()
    warmed()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times
