"""A tiny recorder of what each rank actually did during a step, to draw beside the plan's prediction.

Engines wrap each action (`with trace.span(rank, "F", mb): ...`, pipelines adding the stage); every rank keeps its own
StepTrace, which is plain data (picklable, so `all_gather_object` can collect them) and
merged on rank 0. Times are seconds since the trace's `begin()` on that rank, because
perf_counter origins differ between processes; calling begin() right after a barrier makes
the ranks' clocks line up to within the barrier's skew.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

# The kinds the timeline knows how to colour; others are drawn grey.
KINDS = ("F", "B", "I", "W", "recompute", "evict", "load", "offload", "collective", "host optimizer", "optimizer")


class Span(NamedTuple):
    rank: int
    kind: str
    mb: int  # microbatch, -1 for per-step work (optimizer, final reduce)
    start: float  # seconds since begin()
    end: float
    stage: int = -1  # pipeline stage (global index) of F/B work, -1 where there is none or it is not known


@dataclass
class StepTrace:
    """Spans of one training step, from one rank or merged from several."""

    spans: list[Span] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)

    def begin(self) -> None:
        """Start the step's clock (and forget earlier spans): call after a barrier on every rank."""
        self.spans.clear()
        self.origin = time.perf_counter()

    @contextmanager
    def span(self, rank: int, kind: str, mb: int = -1, stage: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(rank, kind, mb, start - self.origin, time.perf_counter() - self.origin, stage)

    def add(self, rank: int, kind: str, mb: int, start: float, end: float, stage: int = -1) -> None:
        """Record a span measured elsewhere (e.g. CUDA events), in seconds since begin()."""
        self.spans.append(Span(rank, kind, mb, start, end, stage))

    def extend(self, rank: int, kind: str) -> None:
        """End the rank's latest span of this kind now: fold work timed outside it (a pipeline
        schedule's loss after the last stage's forward) into it."""
        for i in range(len(self.spans) - 1, -1, -1):
            if self.spans[i].rank == rank and self.spans[i].kind == kind:
                self.spans[i] = self.spans[i]._replace(end=time.perf_counter() - self.origin)
                return

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans})

    @property
    def duration(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @classmethod
    def merge(cls, traces: list["StepTrace"]) -> "StepTrace":
        """One trace holding every rank's spans, ordered by rank then start."""
        spans = sorted((s for t in traces for s in t.spans), key=lambda s: (s.rank, s.start))
        return cls(spans=spans, origin=0.0)

    def to_dict(self) -> dict:
        return {"spans": [list(s) for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        return cls(spans=[Span(*s) for s in d["spans"]], origin=0.0)
