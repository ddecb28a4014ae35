"""How much of this machine other work used while snugfit measured it.

A hardware profile or a run's corrections taken while other jobs ran describe those jobs' contention, not the
machine: once one planned the README's default model at 2.22 s a step and ran it at 0.20 s. The measure is the
share of the cores' time that processes other than this one (and its waited-for children) kept busy, from the
kernel's own counters (/proc/stat), over the window measured; elsewhere the 1-minute load average stands in.
"""

from __future__ import annotations

import os
import time

# Other work on at most this share of the cores leaves a measurement the machine's; above it, the measurement is
# kept as provisional and taken again once the machine is quiet (hardware.catalogue.load_local)
BUSY_SHARE = 0.25
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, all) jiffies of every core since boot, from /proc/stat's first line; None off Linux."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Open around a measurement; `.share` is then the share of the cores others kept busy during it."""

    share: float | None = None

    def __enter__(self) -> "OtherLoad":
        self._start = (_cpu_jiffies(), _own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        (first, own0), last = self._start, _cpu_jiffies()
        if first is None or last is None:
            loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            self.share = max(0.0, loadavg - 1) / (os.cpu_count() or 1)  # less this process's own
            return
        busy, total = last[0] - first[0], last[1] - first[1]
        mine = (_own_cpu_s() - own0) * _HZ
        self.share = max(0.0, busy - mine) / total if total > 0 else 0.0


def other_load_now(seconds: float = 0.25) -> float:
    """The share of the cores others use now, sampled over a short idle wait."""
    with OtherLoad() as load:
        time.sleep(seconds)
    return load.share or 0.0


def is_busy(share: float | None) -> bool:
    return share is not None and share > BUSY_SHARE
