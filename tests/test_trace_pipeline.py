"""Traced pipeline steps: each rank records its actions (F, B, I, W, BPipe's evict and load) per microbatch and
stage, in exactly the order the time model's simulation runs them, for every schedule of the registry at pp 2
and 4; the step's loss equals a one-process reference; the trace draws beside the prediction.

One spawn per pipeline degree runs every schedule (engines built one after another)."""

import matplotlib.image
import pytest
import torch
import torch.distributed as dist

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import Plan
from snugfit.plan.schedules import COMPUTE, SCHEDULES
from snugfit.plan.simulate import simulate
from snugfit.report.timeline import draw_timeline
from snugfit.report.trace import StepTrace
from snugfit.runtime.build import build_engine
from snugfit.runtime.microbatches import split_batch
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import run_ranks

SEQ, MICRO = 8, 4
PIPELINED = [name for name, s in SCHEDULES.items() if s.pipelined]
ACTIONS = (*COMPUTE, "evict", "load")


def _plan(schedule: str, pp: int) -> Plan:
    entry = SCHEDULES[schedule]
    v = entry.stages_per_rank or entry.search_stages_per_rank
    plan = Plan.uniform(pp * v, pp=pp, schedule=schedule, virtual_stages=v, micro_batch_size=1,
                        num_microbatches=MICRO, seq_len=SEQ, evict_bound=1 if entry.evicts else None)
    plan.validate(n_blocks=pp * v, world_size=pp)
    return plan


def _cfg(plan: Plan) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=len(plan.blocks), n_heads=4, vocab_size=64, max_seq_len=SEQ)


def _traced(env, schedule: str, pp: int) -> tuple[StepTrace, float, float]:
    """The first step traced (it includes pipelining's shape inference), the second not; and the first step's
    loss beside a one-process reference's."""
    plan = _plan(schedule, pp)
    batch = torch.randint(0, 64, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = Decoder(_cfg(plan))
    ref_loss = sum(reference(*mb).item() for mb in split_batch(batch, plan)) / MICRO
    torch.manual_seed(0)
    engine = build_engine(Decoder(_cfg(plan)), plan, OptimConfig(), env)
    trace = engine.trace = StepTrace()
    dist.barrier()
    trace.begin()
    loss = engine.train_step(batch).loss
    engine.trace = None
    recorded = len(trace.spans)
    engine.train_step(batch)
    assert len(trace.spans) == recorded, "an untraced step recorded spans"
    del engine  # one pipeline engine at a time: live ones would share the gloo pairs
    return trace, loss, ref_loss


def _every_schedule(env, pp: int) -> dict:
    return {schedule: _traced(env, schedule, pp) for schedule in PIPELINED}


@pytest.fixture(scope="module")
def traces():
    out = {}
    for pp in (2, 4):
        results = run_ranks(_every_schedule, pp, pp)
        out[pp] = {schedule: [r[schedule] for r in results] for schedule in PIPELINED}
    return out


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", PIPELINED)
def test_runtime_runs_the_simulated_order(traces, schedule, pp):
    plan = _plan(schedule, pp)
    n = pp * plan.virtual_stages
    sim = simulate(schedule, pp, MICRO, [1e-3] * n, [2e-3] * n, v=plan.virtual_stages, bound=plan.eviction_bound)
    for rank, (trace, loss, ref_loss) in enumerate(traces[pp][schedule]):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert all(s.rank == rank and s.end >= s.start >= 0 for s in trace.spans)
        work = sorted((s for s in trace.spans if s.kind in ACTIONS), key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(work, work[1:])), "one rank does one thing at a time"
        simulated = [(e.kind, e.stage, e.mb) for e in sim.events if e.rank == rank]
        assert [(s.kind, s.stage, s.mb) for s in work] == simulated, (schedule, pp, rank)
        assert sorted({s.stage for s in work}) == plan.stages_of(rank)
        assert any(s.kind == "optimizer" for s in trace.spans)
    kinds = {s.kind for trace, _, _ in traces[pp][schedule] for s in trace.spans}
    assert kinds >= ({"I", "W"} if SCHEDULES[schedule].splits_backward else {"B"})
    if SCHEDULES[schedule].evicts:
        assert kinds >= {"evict", "load"}
    if schedule == "1f1b" and pp == 2:  # spelled out: two warm-up forwards on rank 0, then alternate
        first = [(s.kind, s.mb) for s in sorted(traces[pp][schedule][0][0].spans, key=lambda s: s.start)][:4]
        assert first == [("F", 0), ("F", 1), ("B", 0), ("F", 2)]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_merged_trace_draws_beside_the_prediction(traces, schedule, tmp_path):
    plan = _plan(schedule, 2)
    merged = StepTrace.merge([trace for trace, _, _ in traces[2][schedule]])
    assert merged.ranks == [0, 1]
    n = 2 * plan.virtual_stages
    sim = simulate(schedule, 2, MICRO, [1e-3] * n, [2e-3] * n, v=plan.virtual_stages)
    out = draw_timeline(sim, plan, tmp_path / "t.png", measured=StepTrace.from_dict(merged.to_dict()))
    assert out.stat().st_size > 10_000
    assert matplotlib.image.imread(out).shape[1] > 800


def test_spans_carry_their_stage_and_the_loss_folds_into_the_forward():
    t = StepTrace()
    t.begin()
    with t.span(1, "F", 0, stage=3):
        pass
    t.add(1, "B", 0, 0.0, 0.0)
    f_end = t.spans[0].end
    t.extend(1, "F")  # the last stage's loss, computed after its forward returned
    assert t.spans[0].end >= f_end and t.spans[0][:3] == (1, "F", 0) and t.spans[0].stage == 3
    assert t.spans[1].stage == -1
    old = StepTrace.from_dict({"spans": [[0, "F", 2, 0.0, 1.0]]})  # saved before spans had a stage
    assert old.spans[0].stage == -1 and StepTrace.from_dict(t.to_dict()).spans == t.spans
