"""Traced steps of torch.distributed.pipelining's schedules: each rank records F and B spans per microbatch
and stage, in the order the time model's simulation assumes, and they draw beside the prediction."""

import matplotlib.image
import pytest
import torch
import torch.distributed as dist

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import Plan
from snugfit.plan.simulate import action_order, simulate
from snugfit.report.timeline import draw_timeline
from snugfit.report.trace import StepTrace
from snugfit.runtime.engine import OptimConfig
from snugfit.runtime.build import build_engine
from tests.distributed import run_ranks

SEQ, MICRO, PP = 8, 4, 2
# schedule -> (virtual stages, blocks: one per stage at least)
CONFIGS = {"1f1b": (1, 2), "interleaved": (2, 4)}


def _plan(schedule: str) -> Plan:
    v, n = CONFIGS[schedule]
    plan = Plan.uniform(n, pp=PP, schedule=schedule, virtual_stages=v, micro_batch_size=1,
                        num_microbatches=MICRO, seq_len=SEQ)
    plan.validate(n_blocks=n, world_size=PP)
    return plan


def _traced(env, schedule: str) -> StepTrace:
    """The first step traced (it includes pipelining's shape inference), the second not."""
    plan = _plan(schedule)
    cfg = ModelConfig(dim=32, n_layers=CONFIGS[schedule][1], n_heads=4, vocab_size=64, max_seq_len=SEQ)
    torch.manual_seed(0)
    engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
    batch = torch.randint(0, 64, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
    trace = engine.trace = StepTrace()
    dist.barrier()
    trace.begin()
    engine.train_step(batch)
    engine.trace = None
    recorded = len(trace.spans)
    engine.train_step(batch)
    assert len(trace.spans) == recorded, "an untraced step recorded spans"
    return trace


def _both(env) -> dict:
    return {schedule: _traced(env, schedule) for schedule in CONFIGS}


@pytest.fixture(scope="module")
def traces():
    results = run_ranks(_both, PP)
    return {schedule: [r[schedule] for r in results] for schedule in CONFIGS}


@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_each_rank_times_every_microbatch_of_its_stages(traces, schedule):
    v, _ = CONFIGS[schedule]
    for rank, trace in enumerate(traces[schedule]):
        assert all(s.rank == rank and s.end >= s.start >= 0 for s in trace.spans)
        work = [s for s in trace.spans if s.kind in ("F", "B")]
        stages = list(range(rank, PP * v, PP))
        assert sorted({s.stage for s in work}) == stages
        for k in stages:
            for kind in ("F", "B"):
                assert sorted(s.mb for s in work if s.stage == k and s.kind == kind) == list(range(MICRO)), (k, kind)
            for mb in range(MICRO):
                f, = (s for s in work if (s.stage, s.mb, s.kind) == (k, mb, "F"))
                b, = (s for s in work if (s.stage, s.mb, s.kind) == (k, mb, "B"))
                assert b.start >= f.end
        # one rank computes one thing at a time, in the order the time model simulates
        work.sort(key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(work, work[1:]))
        assert [(s.kind, s.stage, s.mb) for s in work] == action_order(schedule, PP, v, MICRO, rank)
        assert any(s.kind == "optimizer" for s in trace.spans)
    if schedule == "1f1b":  # spelled out: two warm-up forwards on rank 0, then alternate
        first = [(s.kind, s.mb) for s in sorted(traces[schedule][0].spans, key=lambda s: s.start)][:4]
        assert first == [("F", 0), ("F", 1), ("B", 0), ("F", 2)]


@pytest.mark.parametrize("schedule", list(CONFIGS))
def test_merged_trace_draws_beside_the_prediction(traces, schedule, tmp_path):
    plan = _plan(schedule)
    merged = StepTrace.merge(traces[schedule])
    assert merged.ranks == [0, 1]
    n = PP * plan.virtual_stages
    sim = simulate(schedule, PP, MICRO, [1e-3] * n, [2e-3] * n, v=plan.virtual_stages)
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
