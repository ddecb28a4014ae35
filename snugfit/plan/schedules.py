"""The pipeline schedules: one entry per schedule, and the action program each pipeline rank runs.

An entry says where the stages sit (looped: stage k on pipeline rank k % pp; V: a rank holds stage r going
down and stage 2pp-1-r coming back), how many stages a rank may hold, what the microbatch count must
satisfy, and, above all, the order of one rank's actions:

  F  forward of (stage, microbatch)        B  its whole backward
  I  the backward to the stage's input     W  the backward to its weights (after I; zero-bubble schedules)
  EVICT / LOAD  move a microbatch's saved activations to the partner rank pp-1-r and back (BPipe)

Sends and receives follow from the compute actions (a forward's output goes to the next stage, an input
gradient to the previous one), on both sides. That one program is what the time model simulates
(plan.simulate), what the memory model reads residency from, and what the runtime executes: torch's
_PipelineScheduleRuntime is handed it as is (runner "torch"), BPipe's hand-written schedule runs it with its
evictions (runner "bpipe"), and without a pipeline the engine accumulates microbatches ("accumulate").

Adding a schedule: an order function and an entry here; the runtime needs nothing new when torch can run
the program (see docs/how-it-plans.md, "adding a schedule"). Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from snugfit.errors import PlanError

COMPUTE = ("F", "B", "I", "W")
MOVES = ("EVICT", "LOAD")


class Action(NamedTuple):
    kind: str  # COMPUTE or MOVES
    stage: int  # global stage index
    mb: int  # microbatch


Order = Callable[[int, int, int, int], list[Action]]  # (pp, v, m, rank) -> the rank's compute actions


@dataclass(frozen=True)
class Schedule:
    name: str
    order: Order
    runner: str = "torch"  # how the runtime runs it: "accumulate" (no pipeline), "torch", "bpipe"
    placement: str = "looped"  # "looped" or "v" (see `rank_of`)
    stages_per_rank: int | None = 1  # virtual stages a rank holds; None: any (plan.virtual_stages)
    search_stages_per_rank: int = 1  # what the search tries where the user fixes none
    splits_backward: bool = False  # B is run as I then W (zero bubble)
    evicts: bool = False  # heavy ranks move activations to their partner (BPipe)
    microbatches_per_round: bool = False  # num_microbatches must be a multiple of pp
    tensor_parallel: bool = True  # the runner runs tensor-parallel stages

    @property
    def pipelined(self) -> bool:
        return self.runner != "accumulate"

    @property
    def v_shaped(self) -> bool:
        """Ranks hold stages going down and coming back, so each holds early and late stages' activations alike."""
        return self.placement == "v"

    def rank_of(self, stage: int, pp: int) -> int:
        """The pipeline rank that runs `stage`."""
        if self.placement == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def stages_of(self, rank: int, pp: int, v: int) -> list[int]:
        """The stages pipeline rank `rank` runs, in stage order."""
        return [k for k in range(pp * v) if self.rank_of(k, pp) == rank]

    def problem(self, pp: int, v: int, m: int) -> str | None:
        """Why this schedule cannot run pp ranks of v stages each over m microbatches, or None."""
        if self.pipelined != (pp > 1):
            return (f"schedule {self.name!r} needs pp > 1" if self.pipelined
                    else f"schedule {self.name!r} is for pp 1; with pp {pp} choose a pipeline schedule")
        if self.stages_per_rank is not None and v != self.stages_per_rank:
            return f"schedule {self.name!r} runs {self.stages_per_rank} stage(s) per rank, not virtual_stages {v}"
        if pp > 1 and m < pp:
            return f"num_microbatches ({m}) must be >= pp ({pp}) for a pipeline schedule"
        if self.microbatches_per_round and m % pp:
            return f"schedule {self.name!r} needs num_microbatches ({m}) divisible by pp ({pp})"
        return None

    def program(self, pp: int, v: int, m: int, rank: int, bound: int | None = None) -> list[Action]:
        """What pipeline rank `rank` runs, in order: its compute actions, and BPipe's moves where it evicts."""
        return list(_programs(self.name, pp, v, m, bound)[rank])


# -- orders --
def _accumulate(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """No pipeline: each microbatch's forward, then its backward."""
    return [a for j in range(m) for a in (Action("F", 0, j), Action("B", 0, j))]


def _one_f_one_b(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """pp - rank - 1 warm-up forwards, then one forward and one backward, then the remaining backwards."""
    warm = min(pp - rank - 1, m)
    out = [Action("F", rank, j) for j in range(warm)]
    for i in range(m - warm):
        out += [Action("F", rank, warm + i), Action("B", rank, i)]
    return out + [Action("B", rank, j) for j in range(m - warm, m)]


def _looped(pp: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B over v looped stages per rank, depth first in rounds of pp microbatches, as torch's
    ScheduleInterleaved1F1B orders it; zero_bubble: as ScheduleInterleavedZeroBubble (ZB1P), whose backwards are
    I, and whose W follow them from the rank-th on, fewer warm-up forwards (one per hop, not two)."""
    total = m * v
    warm = min((v - 1) * pp + (1 if zero_bubble else 2) * (pp - 1 - rank), total)
    count = {"F": [0] * (pp * v), "B": [0] * (pp * v), "W": [0] * (pp * v)}

    def act(kind: str, stage: int) -> Action:
        key = "F" if kind == "F" else ("W" if kind == "W" else "B")
        count[key][stage] += 1
        return Action(kind, stage, count[key][stage] - 1)

    def fwd_stage(step: int) -> int:
        return (step // pp) % v * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - (step - warm) // pp % v) * pp + rank

    back = "I" if zero_bubble else "B"
    out, backwards, weights = [], [], 0
    for step in range(total + warm):
        if step < total:
            out.append(act("F", fwd_stage(step)))
        if step >= warm:
            out.append(act(back, bwd_stage(step)))
            backwards.append(step)
            if zero_bubble and step - warm >= rank:
                out.append(act("W", bwd_stage(backwards[weights])))
                weights += 1
    while zero_bubble and weights < len(backwards):
        out.append(act("W", bwd_stage(backwards[weights])))
        weights += 1
    return out


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Action]:
    return _looped(pp, v, m, rank, zero_bubble=False)


def _interleaved_zb(pp: int, v: int, m: int, rank: int) -> list[Action]:
    return _looped(pp, v, m, rank, zero_bubble=True)


def _zbv(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """ZB-V (zero bubble, V-shaped), as torch's ScheduleZBVZeroBubble orders it: chunk 0 is stage `rank` going
    down, chunk 1 stage 2pp-1-rank coming back; warm-up forwards, a steady F I W of each chunk in turn, then the
    input backwards, and the weight backwards last. Planned with at least 2pp-1 microbatches and those beyond m
    dropped, as torch does."""
    n = max(2 * pp - 1, m)
    down, up = rank, 2 * pp - 1 - rank
    f = {down: 0, up: 0}
    b = {down: 0, up: 0}
    out: list[Action] = []

    def add(kind: str, stage: int, counter: dict[int, int]) -> None:
        out.append(Action(kind, stage, counter[stage]))
        if kind != "W":
            counter[stage] += 1

    for _ in range(2 * (pp - rank) - 1):
        add("F", down, f)
    for _ in range(rank):
        add("F", up, f)
        add("F", down, f)
    def backward(stage: int) -> None:  # the input backward, then at once the weight backward of that microbatch
        add("I", stage, b)
        add("W", stage, {stage: b[stage] - 1})

    for _ in range(pp - rank):
        add("F", up, f)
        backward(up)
    while f[up] < f[down] or f[down] < n:
        if f[down] < n:
            add("F", down, f)
        backward(down)
        add("F", up, f)
        backward(up)
    w = dict(b)
    for _ in range(rank):
        add("I", down, b)
        add("I", up, b)
    for _ in range(pp - rank):
        add("I", down, b)
        add("W", down, w)
        w[down] += 1
    for stage in (up, down):
        while w[stage] < b[stage]:
            add("W", stage, w)
            w[stage] += 1
    return [a for a in out if a.mb < m]


def with_evictions(order: list[Action], bound: int) -> list[Action]:
    """`order` with EVICT and LOAD keeping at most `bound` microbatches' activations on the rank: before a forward
    that would exceed it, evict the held one whose backward comes last (the newest); before the backward of an
    evicted one, make room the same way and load it back. A (stage, microbatch) is held from its F to its B (or
    its W, where the backward is split). Any schedule's order can take them; BPipe's heavy ranks do."""
    resident: list[tuple[int, int]] = []
    evicted: set[tuple[int, int]] = set()
    program: list[Action] = []

    def make_room() -> None:
        while len(resident) >= bound:
            victim = max(resident, key=lambda s: s[1])
            resident.remove(victim)
            evicted.add(victim)
            program.append(Action("EVICT", *victim))

    for a in order:
        key = (a.stage, a.mb)
        if a.kind == "F":
            make_room()
            resident.append(key)
        elif key in evicted:
            make_room()
            evicted.remove(key)
            program.append(Action("LOAD", *key))
            resident.append(key)
        program.append(a)
        if a.kind == "W" or (a.kind == "B" and key in resident):
            resident.remove(key)
    return program


def partner(pp: int, rank: int) -> int:
    """BPipe pairs pipeline rank x with pp-1-x; the one nearer the start is the heavy one, which evicts."""
    return pp - 1 - rank


def bpipe_bound(pp: int, bound: int | None = None) -> int:
    """Most microbatches a heavy BPipe rank holds: the plan's, else BPipe's ceil((p+2)/2)."""
    return bound if bound is not None else -(-(pp + 2) // 2)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    # no pipeline: every microbatch's forward and backward in turn, gradients accumulated
    Schedule("none", _accumulate, runner="accumulate"),
    # 1F1B: stage s holds up to pp - s microbatches
    Schedule("1f1b", _one_f_one_b),
    # interleaved 1F1B over virtual stages: a bubble 1/v as long, more transfers
    Schedule("interleaved", _interleaved, stages_per_rank=None, search_stages_per_rank=2,
             microbatches_per_round=True),
    # 1F1B whose heavy stages evict activations to their partner (BPipe)
    Schedule("bpipe", _one_f_one_b, runner="bpipe", evicts=True, tensor_parallel=False),
    # zero-bubble V: two stages per rank in a V, weight gradients fill the bubble (torch's ScheduleZBVZeroBubble)
    Schedule("zbv", _zbv, placement="v", stages_per_rank=2, search_stages_per_rank=2, splits_backward=True),
    # interleaved zero bubble, ZB1P (torch's ScheduleInterleavedZeroBubble)
    Schedule("interleaved_zb", _interleaved_zb, stages_per_rank=None, search_stages_per_rank=2,
             splits_backward=True, microbatches_per_round=True),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)
RUNNERS = ("accumulate", "torch", "bpipe")  # the runtime's step runners (runtime.build checks its table)


def schedule(name: str) -> Schedule:
    """The entry of `name`; an unknown name is a one-line error."""
    found = SCHEDULES.get(name)
    if found is None:
        raise PlanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return found


@functools.lru_cache(maxsize=1024)
def _programs(name: str, pp: int, v: int, m: int, bound: int | None) -> tuple[tuple[Action, ...], ...]:
    """Every rank's program (cached: the search and estimate() ask for the same ones many times)."""
    s = SCHEDULES[name]
    out = []
    for rank in range(pp):
        order = s.order(pp, v, m, rank)
        if s.evicts and rank < partner(pp, rank):
            order = with_evictions(order, bpipe_bound(pp, bound))
        out.append(tuple(order))
    return tuple(out)


def programs(name: str, pp: int, v: int, m: int, bound: int | None = None) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's program, rank by rank."""
    return _programs(name, pp, v, m, bound)
