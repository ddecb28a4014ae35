"""A small event simulation of one training step's pipeline schedule.

Each pipeline rank runs its list of actions in order (the order torch's schedules
use); an action starts when the rank is free and its inputs have arrived. Stage k
of pp*v stages runs on rank k % pp. The result keeps every event (for Gantt
charts), busy time and bubble per rank, and which (stage, microbatch) activations
each rank holds whenever it starts computing, which is what the memory model needs.

BPipe moves follow the runtime's program (runtime.schedules.bpipe_program), so
a heavy rank x < p-1-x never holds more than `bound` microbatches: before a
forward at the bound it evicts the one whose backward comes last to its partner
p-1-x (overlapped with that forward); before the backward of an evicted one it
makes room the same way, then loads it back once the partner's backward of it is
done (the backward waits for the load).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field


@dataclass(slots=True)
class Event:
    rank: int
    stage: int
    kind: str  # F, B, evict, load
    mb: int
    start: float
    end: float


@dataclass(slots=True)
class Snapshot:
    """At the start of a compute event: how many microbatches of activations the rank holds, per stage (the
    memory model needs no more, and a count keeps long simulations cheap).

    The event's own (stage, mb) is excluded: its bytes belong to the piece walk of the event.
    """

    event: Event
    resident: dict[int, int]  # stage -> microbatches held


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
        edges = sorted([(e.start, 1) for e in self.events if e.kind in "FB"]
                       + [(e.end, -1) for e in self.events if e.kind in "FB"])
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


def action_order(schedule: str, pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, stage, microbatch) actions of one pipeline rank, in the order it runs them."""
    if schedule == "none":
        return [a for j in range(m) for a in (("F", 0, j), ("B", 0, j))]
    if schedule in ("1f1b", "bpipe"):
        warm = min(pp - rank - 1, m)
        out = [("F", rank, j) for j in range(warm)]
        for i in range(m - warm):
            out += [("F", rank, warm + i), ("B", rank, i)]
        return out + [("B", rank, j) for j in range(m - warm, m)]
    if schedule == "interleaved":
        total = m * v

        def fwd(k):
            return "F", ((k // pp) % v) * pp + rank, (k // (pp * v)) * pp + k % pp

        def bwd(k):
            return "B", (v - 1 - (k // pp) % v) * pp + rank, (k // (pp * v)) * pp + k % pp

        warm = min((v - 1) * pp + 2 * (pp - 1 - rank), total)
        out = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            out += [fwd(warm + i), bwd(i)]
        return out + [bwd(k) for k in range(total - warm, total)]
    raise ValueError(f"unknown schedule {schedule!r}")


def simulate(
    schedule: str, pp: int, m: int, fwd: list[float], bwd: list[float], *, v: int = 1,
    p2p: list[float] | None = None, bound: int | None = None, move: list[float] | None = None,
) -> SimResult:
    """Simulate one step. fwd/bwd: seconds per microbatch of each of the pp*v stages;
    p2p[k]: seconds to send stage k's output to stage k+1 (and its gradient back);
    move[k]: seconds to evict (or load back) one microbatch of stage k's activations (BPipe).
    """
    n_stages = pp * v
    p2p = p2p or [0.0] * n_stages
    move = move or [0.0] * n_stages
    orders = [action_order(schedule, pp, v, m, r) for r in range(pp)]
    pos = [0] * pp
    free = [0.0] * pp
    done: dict[tuple[str, int, int], float] = {}
    held: list[dict[tuple[int, int], None]] = [{} for _ in range(pp)]  # insertion-ordered sets
    evicted: list[dict[tuple[int, int], None]] = [{} for _ in range(pp)]  # by owner rank: held by the partner
    counts = [dict.fromkeys(range(r, n_stages, pp), 0) for r in range(pp)]  # held[r] by stage (r's own)
    evicted_counts = [dict.fromkeys(range(r, n_stages, pp), 0) for r in range(pp)]  # evicted[r] by stage
    res = SimResult(snapshots={r: [] for r in range(pp)}, busy=[0.0] * pp)
    remaining = sum(len(o) for o in orders)

    def inputs(r: int, kind: str, k: int, j: int) -> tuple[tuple[tuple[str, int, int], float], ...]:
        """The actions this one waits for, each with its transfer delay to rank r."""
        if kind == "F":
            return ((("F", k - 1, j), 0.0 if (k - 1) % pp == r else p2p[k - 1]),) if k > 0 else ()
        own = (("F", k, j), 0.0)
        return (own, (("B", k + 1, j), 0.0 if (k + 1) % pp == r else p2p[k])) if k < n_stages - 1 else (own,)

    waits = [[inputs(r, *a) for a in orders[r]] for r in range(pp)]

    def ready_at(r: int) -> float:
        """When rank r's next action could start, or inf while its inputs are missing."""
        t = free[r]
        for d, delay in waits[r][pos[r]]:
            end = done.get(d)
            if end is None:
                return math.inf
            t = max(t, end + delay)
        return t

    # When each rank's next action could start: an action changes only its own rank's and its waiting
    # neighbours' (the ranks it sends to and receives from), so only those are recomputed.
    starts = [ready_at(r) for r in range(pp)]  # inf: waiting for an input, or done

    def make_room(r: int, t: float) -> float:
        """Evict rank r's microbatches whose backward comes last until one more fits under the bound, from t;
        returns when the evictions are sent."""
        sent = t
        while len(held[r]) >= bound:
            victim = max(held[r], key=lambda s: s[1])
            del held[r][victim]
            evicted[r][victim] = None
            counts[r][victim[0]] -= 1
            evicted_counts[r][victim[0]] += 1
            res.events.append(Event(r, victim[0], "evict", victim[1], t, t + move[victim[0]]))
            sent = max(sent, res.events[-1].end)
        return sent

    while remaining:
        # run the action that can start first, so cross-rank state (evictions) changes in time order
        ready = min(starts)
        if ready == math.inf:
            raise RuntimeError(f"schedule {schedule} deadlocked (pp={pp}, v={v}, m={m})")
        r = starts.index(ready)
        kind, k, j = orders[r][pos[r]]
        partner = pp - 1 - r
        if kind == "F" and schedule == "bpipe" and r < partner and bound:  # only heavy ranks evict
            make_room(r, ready)
        if kind == "B" and (k, j) in evicted[r]:
            # room first (loading into a full rank would exceed the bound), then the load, which the partner
            # serves once its own backward of j is done: both overlap this rank's wait for the gradient
            start = max(make_room(r, free[r]), done[("B", partner, j)])
            del evicted[r][(k, j)]
            held[r][(k, j)] = None
            evicted_counts[r][k] -= 1
            counts[r][k] += 1
            res.events.append(Event(r, k, "load", j, start, start + move[k]))
            ready = max(ready, start + move[k])
        dur = fwd[k] if kind == "F" else bwd[k]
        ev = Event(r, k, kind, j, ready, ready + dur)
        resident = dict(counts[r])
        if kind == "B":
            resident[k] -= 1
        if schedule == "bpipe" and partner != r:
            resident.update(evicted_counts[partner])  # the partner's stages: other keys
        res.snapshots[r].append(Snapshot(ev, resident))
        res.events.append(ev)
        res.busy[r] += dur
        free[r] = ev.end
        done[(kind, k, j)] = ev.end
        pos[r] += 1
        remaining -= 1
        starts[r] = ready_at(r) if pos[r] < len(orders[r]) else math.inf
        for q in ((r + 1) % pp, (r - 1) % pp):  # a neighbour already ready has all its inputs: unchanged
            if starts[q] == math.inf and pos[q] < len(orders[q]):
                starts[q] = ready_at(q)
        if kind == "F":
            held[r][(k, j)] = None
            counts[r][k] += 1
        else:
            del held[r][(k, j)]
            counts[r][k] -= 1
    res.makespan = max(e.end for e in res.events)
    return res
