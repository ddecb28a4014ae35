"""A small event simulation of one training step's pipeline schedule.

Each pipeline rank runs its action program (plan.schedules: the same one the runtime executes) in order; a
compute action starts when the rank is free and its inputs have arrived: a forward its previous stage's
output, a backward (B, or I where the backward is split) its next stage's input gradient, a W its own I.
The result keeps every event (for Gantt charts), busy time and bubble per rank, and which (stage,
microbatch) activations each rank holds whenever it starts computing, which is what the memory model needs.

A (stage, microbatch) is held from its forward to its backward (to its W where the backward is split: torch's
input backward keeps the graph for the weight backward). EVICT and LOAD actions (BPipe) run as the compute
action after them is taken up, on a lane beside the rank's compute: evictions start once the rank is free and
overlap what follows; a load starts once the evictions before it are sent and the partner rank's own
backward of that microbatch is done (it may hand the bytes back only then), and the backward waits for it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from snugfit.plan.schedules import COMPUTE, SCHEDULES, partner, programs


@dataclass(slots=True)
class Event:
    rank: int
    stage: int
    kind: str  # F, B, I, W, evict, load
    mb: int
    start: float
    end: float


@dataclass(slots=True)
class Snapshot:
    """At the start of a compute event: how many microbatches of activations the rank holds, per stage (the
    memory model needs no more, and a count keeps long simulations cheap), and of those how many wait for their
    weight backward (their input backward done: torch holds their output gradients too).

    The event's own (stage, mb) is excluded: its bytes belong to the piece walk of the event.
    """

    event: Event
    resident: dict[int, int]  # stage -> microbatches held
    awaiting_weight: dict[int, int] | None = None  # stage -> of those, the ones between I and W


@dataclass
class SimResult:
    events: list[Event] = field(default_factory=list)
    snapshots: dict[int, list[Snapshot]] = field(default_factory=dict)  # rank -> snapshots
    makespan: float = 0.0
    busy: list[float] = field(default_factory=list)  # compute seconds per rank

    def bubble(self, rank: int) -> float:
        return self.makespan - self.busy[rank]

    def working_share(self) -> float:
        """The share of the ranks working while the average unit of work runs (integral of running^2 over pp times
        the integral of running). Ranks on too few cores slow each other only while they work, and a pipeline's
        work runs mostly in its crowded steady state, not at the average over its fill and drain (1F1B at pp 4
        and 4 microbatches: 0.69 against 0.57 busy on average)."""
        work = [e for e in self.events if e.kind in COMPUTE]
        edges = sorted([(e.start, 1) for e in work] + [(e.end, -1) for e in work])
        running, last, square, linear = 0, 0.0, 0.0, 0.0
        for t, step in edges:
            square, linear = square + running * running * (t - last), linear + running * (t - last)
            running, last = running + step, t
        return square / (len(self.busy) * linear) if linear else 1.0

    def max_resident(self, rank: int, stage: int | None = None) -> int:
        """Most microbatches held at once (of one stage, or all) — +1 for the one being computed."""
        best = 0
        for snap in self.snapshots[rank]:
            held = sum(snap.resident.values()) if stage is None else snap.resident.get(stage, 0)
            own = snap.event.kind == "F" and (stage is None or snap.event.stage == stage)
            best = max(best, held + own)
        return best


def simulate(
    schedule: str, pp: int, m: int, fwd: list[float], bwd: list[float], *, v: int = 1,
    p2p: list[float] | None = None, bound: int | None = None, move: list[float] | None = None,
    split: list[tuple[float, float]] | None = None,
) -> SimResult:
    """Simulate one step. fwd/bwd: seconds per microbatch of each of the pp*v stages;
    p2p[k]: seconds to send stage k's output to stage k+1 (and its gradient back);
    move[k]: seconds to evict (or load back) one microbatch of stage k's activations (BPipe);
    split[k]: (input, weight) backward seconds of stage k where the schedule splits it (default: halves of bwd).
    Snapshots of one schedule share their dicts (`_order`): read them, never change them.
    """
    sched = SCHEDULES[schedule]
    n_stages = pp * v
    lag = [*(p2p or [0.0] * n_stages), 0.0]  # by the waits' p2p stage; -1 (same rank): none
    move = move or [0.0] * n_stages
    split = split or [(b / 2, b / 2) for b in bwd]
    seconds = {"F": fwd, "B": bwd, "I": [s[0] for s in split], "W": [s[1] for s in split]}
    order = _order(schedule, pp, m, v, bound)
    steps, waits, owned, neighbours = order.steps, order.waits, order.owned, order.neighbours
    lengths = [len(s) for s in steps]
    # the ranks whose snapshots add what their partner holds for them (BPipe)
    lends = [sched.evicts and partner(pp, r) != r for r in range(pp)]
    pos = [0] * pp
    free = [0.0] * pp
    ends = [[0.0] * len(s) for s in steps]  # each rank's steps' end times, those before pos[r] set
    evicted_counts = [dict.fromkeys(owned[r], 0) for r in range(pp)]  # r's own held by its partner, by stage
    res = SimResult(snapshots={r: [] for r in range(pp)}, busy=[0.0] * pp)
    snapshots, busy, add_event = [res.snapshots[r] for r in range(pp)], res.busy, res.events.append
    remaining = sum(lengths)

    def ready_at(r: int) -> float:
        """When rank r's next compute action could start, or inf while its inputs are missing."""
        t = free[r]
        for q, i, d in waits[r][pos[r]]:
            if pos[q] <= i:
                return math.inf
            t = max(t, ends[q][i] + lag[d])
        return t

    # When each rank's next action could start: an action changes only its own rank's and its waiting
    # neighbours' (the ranks it sends to and receives from), so only those are recomputed.
    starts = [ready_at(r) if steps[r] else math.inf for r in range(pp)]

    def run_moves(r: int, moves, t_free: float) -> float:
        """The EVICTs and LOAD before a compute action; returns when the action may start for them."""
        sent, ready = t_free, 0.0
        for mv in moves:
            k, j = mv.stage, mv.mb
            if mv.kind == "EVICT":
                evicted_counts[r][k] += 1
                res.events.append(Event(r, k, "evict", j, t_free, t_free + move[k]))
                sent = max(sent, res.events[-1].end)
            else:  # the partner hands it back once its own backward of that microbatch is done
                start = max([sent] + [ends[q][i] for q, i in (order.made["R", s, j] for s in owned[partner(pp, r)])])
                evicted_counts[r][k] -= 1
                res.events.append(Event(r, k, "load", j, start, start + move[k]))
                ready = max(ready, start + move[k])
        return ready

    while remaining:
        # run the action that can start first, so cross-rank state (evictions) changes in time order
        ready = min(starts)
        if ready == math.inf:
            raise RuntimeError(f"schedule {schedule} deadlocked (pp={pp}, v={v}, m={m})")
        r = starts.index(ready)
        at = pos[r]
        moves, a = steps[r][at]
        kind, k, j = a
        if moves:
            ready = max(ready, run_moves(r, moves, free[r]))
        dur = seconds[kind][k]
        ev = Event(r, k, kind, j, ready, ready + dur)
        resident = order.resident[r][at]
        if lends[r]:
            resident = {**resident, **evicted_counts[partner(pp, r)]}  # the partner's stages: other keys
        snapshots[r].append(Snapshot(ev, resident, order.awaiting[r][at]))
        add_event(ev)
        busy[r] += dur
        free[r] = ends[r][at] = ev.end
        pos[r] += 1
        remaining -= 1
        starts[r] = ready_at(r) if pos[r] < lengths[r] else math.inf
        for q in neighbours[r]:  # a neighbour already ready has all its inputs: unchanged
            if starts[q] == math.inf and pos[q] < lengths[q]:
                starts[q] = ready_at(q)
    res.makespan = max(e.end for e in res.events)
    return res


@dataclass(frozen=True)
class _Order:
    """What simulate() takes of a schedule whatever the durations: each rank's steps, the earlier steps each waits
    for, and what the rank holds of its own stages as each starts (its own program decides that). Built once per
    (schedule, pp, m, v, bound): the search's estimates simulate the same few with other durations (70B on 8x8
    H100s: 13 of 7 kinds). Alike held counts are one dict (rank_footprint skips the repeats)."""

    steps: list[list[tuple[tuple, object]]]  # rank -> (moves before it, compute action)
    waits: list[list[tuple[tuple[int, int, int], ...]]]  # rank -> step -> (rank, step, p2p stage or -1) it waits for
    made: dict[tuple[str, int, int], tuple[int, int]]  # (F | G | W | R, stage, mb) -> (rank, step) that makes it
    owned: list[list[int]]  # rank -> its stages
    neighbours: list[list[int]]  # rank -> the ranks that may wait for it
    resident: list[list[dict[int, int]]]  # rank -> step -> own stage -> microbatches held (the step's own left out)
    awaiting: list[list[dict[int, int] | None]]  # the same, of those between I and W (None: the backward is whole)


NEVER = (0, math.inf)  # what a wait for something no action makes names: never done (simulate() deadlocks)


@functools.lru_cache(maxsize=256)
def _order(schedule: str, pp: int, m: int, v: int, bound: int | None) -> _Order:
    sched = SCHEDULES[schedule]
    n_stages = pp * v
    rank_of = [sched.rank_of(k, pp) for k in range(n_stages)]
    steps = [_steps(prog) for prog in programs(schedule, pp, v, m, bound)]
    owned = [[k for k in range(n_stages) if rank_of[k] == r] for r in range(pp)]
    # "G": the input gradient ready; "R": the activations released (the partner may hand back what it holds)
    made: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, rank_steps in enumerate(steps):
        for i, (_, (kind, k, j)) in enumerate(rank_steps):
            made["F" if kind == "F" else "W" if kind == "W" else "G", k, j] = (r, i)
            if kind in ("B", "W"):
                made["R", k, j] = (r, i)

    def inputs(r: int, kind: str, k: int, j: int) -> list[tuple[tuple[str, int, int], int]]:
        """The actions this one waits for, each with the stage whose transfer delays it to rank r (-1: none)."""
        if kind == "F":
            return [(("F", k - 1, j), -1 if rank_of[k - 1] == r else k - 1)] if k > 0 else []
        if kind == "W":
            return [(("G", k, j), -1)]
        own = (("F", k, j), -1)
        return [own, (("G", k + 1, j), -1 if rank_of[k + 1] == r else k)] if k < n_stages - 1 else [own]

    def loads(r: int, moves) -> list[tuple[tuple[str, int, int], int]]:
        """A load waits for the partner to release that microbatch (its backward, or W, of it done)."""
        return [(("R", s, mv.mb), -1) for mv in moves if mv.kind == "LOAD" for s in owned[partner(pp, r)]]

    waits = [[tuple((*made.get(d, NEVER), lag) for d, lag in inputs(r, a.kind, a.stage, a.mb) + loads(r, moves))
              for moves, a in steps[r]] for r in range(pp)]
    neighbours = [sorted({rank_of[k + d] for k in owned[r] for d in (-1, 1) if 0 <= k + d < n_stages}
                         | ({partner(pp, r)} if sched.evicts else set()) - {r}) for r in range(pp)]
    resident, awaiting = [], []
    for r in range(pp):
        counts = dict.fromkeys(owned[r], 0)  # (stage, mb) held on r, by stage (r's own)
        waiting = dict.fromkeys(owned[r], 0)
        alike: dict[tuple, dict[int, int]] = {}
        held_of, waiting_of = [], []
        for moves, (kind, k, _) in steps[r]:
            for mv in moves:
                counts[mv.stage] += -1 if mv.kind == "EVICT" else 1
            held = dict(counts)
            if kind != "F":
                held[k] -= 1
            held_of.append(alike.setdefault(("held", *held.items()), held))
            wait_w = dict(waiting)
            if kind == "W":
                wait_w[k] -= 1
            waiting_of.append(alike.setdefault(("waiting", *wait_w.items()), wait_w))
            if kind == "F":
                counts[k] += 1
            elif kind == "I":
                waiting[k] += 1
            else:
                counts[k] -= 1
                if kind == "W":
                    waiting[k] -= 1
        resident.append(held_of)
        awaiting.append(waiting_of if sched.splits_backward else [None] * len(waiting_of))
    return _Order(steps, waits, made, owned, neighbours, resident, awaiting)


def _steps(program) -> list[tuple[tuple, object]]:
    """A rank's program as (moves before it, compute action) pairs."""
    out, moves = [], []
    for a in program:
        if a.kind in COMPUTE:
            out.append((tuple(moves), a))
            moves = []
        else:
            moves.append(a)
    return out


def split_backward(bwd: list[float], weight: list[float], again: list[float]) -> list[tuple[float, float]]:
    """(I, W) seconds of each stage's split backward: W computes the weight gradients (`weight` of `bwd`) and
    replays what the stage recomputes (`again`: torch's weight backward unpacks the checkpoint a second time);
    the first stage has no input to differentiate, so torch runs its whole backward as W."""
    return [(0.0, b) if k == 0 else (b - w, w + r) for k, (b, w, r) in enumerate(zip(bwd, weight, again))]


@functools.lru_cache(maxsize=4096)
def unit_run(schedule: str, pp: int, m: int, v: int = 1, bound: int | None = None, weight: float = 0.5) -> SimResult:
    """The schedule over like stages, a microbatch's forward 1 and backward 2 on each rank, `weight` of the
    backward the weight gradients' (a split backward's W): what the search reads of a schedule before any plan
    exists (residency, bubble, crowding)."""
    n = pp * v
    bwd = [2.0 / v] * n
    split = split_backward(bwd, [b * weight for b in bwd], [0.0] * n) if SCHEDULES[schedule].splits_backward else None
    return simulate(schedule, pp, m, [1.0 / v] * n, bwd, v=v, bound=bound, split=split)


# A schedule's fill and drain, hence what a rank holds at its peak and how long it idles, are those of 4 x pp
# microbatches once it runs that many; and at a given microbatches-per-rank its idle time grows as pp - 1. Both
# hold for every registry schedule (tests/test_schedules.py), and spare the search simulating thousands of
# events per candidate where pp reaches 64.
FILL = 4
SIMULATED_PP = 8


def resident_microbatches(schedule: str, pp: int, m: int, rank: int, v: int = 1, bound: int | None = None) -> float:
    """Microbatches of activations pipeline rank `rank` holds at its peak, the one in flight included (each
    (stage, microbatch) pair is 1/v of the rank's blocks), counted along the rank's own program: held from its F
    to its B (or W). Where a partner evicts to it (BPipe), the most the partner holds evicted at once comes on
    top: a bound, as the two peaks need not meet (estimate() simulates when they do)."""
    m = min(m, FILL * pp)
    sched = SCHEDULES[schedule]
    held = _held_peaks(schedule, pp, m, v, bound)
    partner_rank = partner(pp, rank)
    away = held[partner_rank][1] if sched.evicts and partner_rank != rank else 0
    return (held[rank][0] + away) / v


@functools.lru_cache(maxsize=1024)
def _held_peaks(schedule: str, pp: int, m: int, v: int, bound: int | None) -> tuple[tuple[int, int], ...]:
    """Per rank: (most (stage, microbatch) pairs held at once, the one being computed included; most evicted at
    once), along its program."""
    out = []
    for program in programs(schedule, pp, v, m, bound):
        held = away = most = most_away = 0
        released = set()
        for a in program:
            if a.kind == "F":
                held += 1
                most = max(most, held)
            elif a.kind == "EVICT":
                held, away = held - 1, away + 1
                most_away = max(most_away, away)
            elif a.kind == "LOAD":
                held, away = held + 1, away - 1
            elif (a.kind == "W" or a.kind == "B") and (a.stage, a.mb) not in released:
                released.add((a.stage, a.mb))
                held -= 1
        out.append((most, most_away))
    return tuple(out)


def bubble_microbatches(schedule: str, pp: int, m: int, v: int = 1, weight: float = 0.5) -> float:
    """The schedule's idle time per rank, in microbatches of a whole rank's work (1F1B: pp - 1; interleaved:
    (pp - 1) / v), from its own program's unit simulation (`unit_run`) at up to SIMULATED_PP ranks and as many
    microbatches per rank; weight: the share of a backward a split schedule can move into its bubble, rounded to
    a twentieth."""
    sched = SCHEDULES[schedule]
    if pp == 1:
        return 0.0
    small = min(pp, SIMULATED_PP)
    per_rank = min(m, FILL * pp) / pp
    m_small = max(small, round(per_rank * small))
    if sched.microbatches_per_round:
        m_small = -(-m_small // small) * small
    sim = unit_run(schedule, small, m_small, v, weight=round(weight * 20) / 20 if sched.splits_backward else 0.5)
    return max(sim.bubble(r) for r in range(small)) / 3.0 * (pp - 1) / (small - 1)
