"""What a traced step measured, per rank: its parts as the time model's corrections read them (MeasuredStep), and
each rank's own time and waits per phase, for naming stragglers.

Ranks in lockstep take alike step times: a slow rank makes its peers wait in their next collective. The trace
tells the two apart by when each rank starts the same action (kind, microbatch, stage): the time a rank spends
in a span before the last of its peers has started it is waiting; the rest, and the gaps between its spans, is
its own.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from snugfit.plan.corrections import MeasuredStep
from snugfit.report.trace import Span, StepTrace

WORK_KINDS = ("F", "B", "I", "W", "recompute", "evict", "load", "offload")
OPTIMIZER_KINDS = ("optimizer", "host optimizer")
HOST = "host"  # a rank's time between its traced actions
PHASE_WORDS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)",
               "collective": "collectives", "optimizer": "optimizer step", "host optimizer": "host optimizer",
               HOST: "host work outside the traced actions"}
PHASE_TERMS = {"F": "compute", "B": "compute", "I": "compute", "W": "compute", "recompute": "recompute",
               "collective": "dp_comm_exposed", "optimizer": "optimizer", "host optimizer": "offload_exposed",
               "evict": "bubble", "load": "bubble", "offload": "offload_exposed", HOST: "host dispatch"}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The time covered by these (start, end) intervals, overlaps once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def measured_step(trace: StepTrace, rank: int, fsdp_share: float = 0.0) -> MeasuredStep:
    """One rank's traced step in the parts the corrections read; fsdp_share: of the forward and backward spans,
    the share FSDP2's own ranges took in a profiled step (taken out of the work as dp communication). A share, not
    the profiled seconds: the profiler slows every operator, FSDP2's and the model's alike."""
    mine = [s for s in trace.spans if s.rank == rank]
    step = max((s.end for s in mine), default=0.0)
    work = union_length([(s.start, s.end) for s in mine if s.kind in WORK_KINDS])
    collective = sum(s.end - s.start for s in mine if s.kind == "collective")
    optimizer = sum(s.end - s.start for s in mine if s.kind in OPTIMIZER_KINDS)
    idle = max(0.0, step - union_length([(s.start, s.end) for s in mine]))
    fsdp = min(max(fsdp_share, 0.0), 1.0) * work
    return MeasuredStep(step=step, work=work - fsdp, dp_comm=fsdp + collective, optimizer=optimizer, idle=idle)


@dataclass
class RankTimes:
    """One rank's traced step: seconds of its own per phase (HOST: between its spans), and waiting per phase."""

    own: dict[str, float] = field(default_factory=dict)
    wait: dict[str, float] = field(default_factory=dict)
    late: dict[str, float] = field(default_factory=dict)  # per phase: the most it started after its first peer
    step: float = 0.0


def _key(s: Span) -> tuple:
    return s.kind, s.mb, s.stage


def rank_times(trace: StepTrace) -> dict[int, RankTimes]:
    """Own and waiting time per phase for every rank of the trace."""
    starts: dict[tuple, list[float]] = {}
    for s in trace.spans:
        starts.setdefault(_key(s), []).append(s.start)
    out = {}
    for rank in trace.ranks:
        rt = RankTimes()
        prev = 0.0
        for s in sorted((s for s in trace.spans if s.rank == rank), key=lambda s: s.start):
            peers = starts[_key(s)]
            waited = min(max(0.0, max(peers) - s.start), s.end - s.start) if len(peers) > 1 else 0.0
            rt.own[HOST] = rt.own.get(HOST, 0.0) + max(0.0, s.start - prev)
            rt.own[s.kind] = rt.own.get(s.kind, 0.0) + (s.end - s.start) - waited
            rt.wait[s.kind] = rt.wait.get(s.kind, 0.0) + waited
            rt.late[s.kind] = max(rt.late.get(s.kind, 0.0), s.start - min(peers))
            prev = max(prev, s.end)
        rt.step = prev
        out[rank] = rt
    return out


@dataclass
class Straggler:
    rank: int
    phase: str  # where its own time stands out (a trace kind, or HOST)
    excess_s: float  # its own time there beyond its peers' median
    waits: dict[int, tuple[str, float]]  # peer -> (the phase it waits in most, seconds)


def stragglers(trace: StepTrace, threshold_s: float) -> list[Straggler]:
    """Ranks whose own time in some phase exceeds their peers' median by more than threshold_s, slowest first."""
    times = rank_times(trace)
    stages = {r: frozenset(s.stage for s in trace.spans if s.rank == r) for r in times}
    found = []
    for rank, rt in times.items():
        peers = [t for r, t in times.items() if r != rank and stages[r] == stages[rank]]  # doing what it does
        if not peers:
            continue
        excess = {ph: s - statistics.median(p.own.get(ph, 0.0) for p in peers) for ph, s in rt.own.items()}
        phase = max(excess, key=excess.get, default=None)
        if phase is not None and excess[phase] > threshold_s:
            waits = {r: max(t.wait.items(), key=lambda kv: kv[1], default=("", 0.0)) for r, t in times.items()
                     if r != rank and stages[r] == stages[rank]}
            found.append(Straggler(rank, phase, excess[phase], waits))
    return sorted(found, key=lambda s: -s.excess_s)
