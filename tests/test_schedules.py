"""The schedules registry (plan.schedules): each order is the one torch's own schedule class builds, every entry's
programs run in the simulator without deadlock, and what the search reads of them (residency, bubble) says what
the schedules are for. Pure: torch's classes are only asked for their orders, no process group."""

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from snugfit.plan.schedules import SCHEDULES, programs
from snugfit.plan.simulate import FILL, bubble_microbatches, resident_microbatches, simulate, unit_run

TORCH = {"interleaved": torch_schedules.ScheduleInterleaved1F1B,
         "interleaved_zb": torch_schedules.ScheduleInterleavedZeroBubble,
         "zbv": torch_schedules.ScheduleZBVZeroBubble}


def _torch_order(cls, pp: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """What torch's class computes for each rank (its order builder alone, without stages or a process group)."""
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round, schedule.num_stages = m // schedule.number_of_rounds, pp * v
    return {r: [(a.computation_type.value, a.stage_index, a.microbatch_index)
                for a in schedule._calculate_single_rank_operations(r) if a is not None] for r in range(pp)}


@pytest.mark.parametrize("name", list(TORCH))
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_orders_are_torchs(name, pp):
    entry = SCHEDULES[name]
    for v in ([entry.stages_per_rank] if entry.stages_per_rank else [1, 2, 3]):
        for m in (pp, 2 * pp, 2 * pp - 1, 3 * pp):
            if entry.problem(pp, v, m):
                continue
            torch_order = _torch_order(TORCH[name], pp, v, m)
            for r in range(pp):
                assert [tuple(a) for a in entry.order(pp, v, m, r)] == torch_order[r], (pp, v, m, r)


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.pipelined])
def test_every_program_runs_each_microbatch_of_each_stage_once(name):
    entry = SCHEDULES[name]
    pp, m = 4, 8
    v = entry.stages_per_rank or entry.search_stages_per_rank
    kinds = ("F", "I", "W") if entry.splits_backward else ("F", "B")
    progs = programs(name, pp, v, m)
    for r, prog in enumerate(progs):
        assert {a.stage for a in prog} == set(entry.stages_of(r, pp, v))
        for kind in kinds:
            done = sorted((a.stage, a.mb) for a in prog if a.kind == kind)
            assert done == sorted((k, j) for k in entry.stages_of(r, pp, v) for j in range(m)), (name, r, kind)
    sim = simulate(name, pp, m, [1.0 / v] * pp * v, [2.0 / v] * pp * v, v=v)
    assert len([e for e in sim.events if e.kind in kinds]) == len(kinds) * pp * v * m


def test_zero_bubble_schedules_trade_memory_for_bubble():
    """With the weight gradients half of a backward, the zero-bubble schedules idle a third of 1F1B's time or less,
    and hold as many microbatches on every rank (a microbatch waits for its W, and the warm-up is shorter), where
    1F1B's first rank holds pp and its last one: the later ranks hold more, the first less. Without weight
    gradients to move (frozen weights) their bubble is back near interleaved's."""
    pp, m = 4, 16
    assert bubble_microbatches("interleaved_zb", pp, m, 2) < bubble_microbatches("interleaved", pp, m, 2)
    assert bubble_microbatches("zbv", pp, m, 2) <= bubble_microbatches("1f1b", pp, m) / 3
    assert bubble_microbatches("zbv", pp, m, 2, weight=0.0) > bubble_microbatches("zbv", pp, m, 2)  # no W to move
    held = {name: [resident_microbatches(name, pp, m, r, v) for r in range(pp)]
            for name, v in (("1f1b", 1), ("zbv", 2), ("interleaved_zb", 2), ("interleaved", 2))}
    assert held["1f1b"] == [4, 3, 2, 1]
    assert max(held["zbv"]) - min(held["zbv"]) < max(held["1f1b"]) - min(held["1f1b"])
    assert held["zbv"] == held["interleaved_zb"] == [4] * pp
    assert held["interleaved"][0] > 4 > held["interleaved"][-1]


@pytest.mark.parametrize("name", [n for n, s in SCHEDULES.items() if s.pipelined])
def test_what_the_search_reads_of_a_program_is_its_simulation(name):
    """The search counts residency along each rank's program and takes the bubble from a simulation of at most 8
    ranks and FILL x pp microbatches: for every schedule they are the full unit simulation's (a rank's held count
    never below it; BPipe's light ranks bounded above, as their partner's evictions and their own peak need not
    meet), and the bubble grows as pp - 1 at a given number of microbatches per rank."""
    entry = SCHEDULES[name]
    for pp in (2, 3, 10):
        for v in [entry.stages_per_rank] if entry.stages_per_rank else [1, 2]:
            for m in (pp, 2 * pp, 5 * pp):
                if entry.problem(pp, v, m):
                    continue
                sim = unit_run(name, pp, m, v)
                held = [resident_microbatches(name, pp, m, r, v) for r in range(pp)]
                exact = [sim.max_resident(r) / v for r in range(pp)]
                assert held == exact if not entry.evicts else all(h >= e for h, e in zip(held, exact)), (pp, v, m)
                if m > FILL * pp:
                    assert exact == [unit_run(name, pp, FILL * pp, v).max_resident(r) / v for r in range(pp)]
                bubble = max(sim.bubble(r) for r in range(pp)) / 3
                assert bubble_microbatches(name, pp, m, v) == pytest.approx(bubble, rel=1e-9), (pp, v, m)
