"""Timeline pictures and the measured-step recorder: files are real images, traces merge and draw."""

import pickle
import xml.etree.ElementTree as ET

import matplotlib.image
import pytest

from snugfit.hardware import parse_cluster
from snugfit.plan.plan import BlockPlan
from snugfit.report.timeline import COLOURS, draw_timeline, timeline_for
from snugfit.report.trace import KINDS, StepTrace
from tests.test_memory_model import _plan, synthetic_profile


@pytest.fixture(scope="module")
def bpipe():
    plan = _plan(dp=2, pp=4, num_microbatches=8, schedule="bpipe", block=BlockPlan(zero=3, activations="selective"))
    sim, detail = timeline_for(plan, synthetic_profile(), parse_cluster("2x4xRTX4090"))
    return plan, sim, detail


def test_timeline_matches_the_time_model(bpipe):
    plan, sim, detail = bpipe
    tail = max(sum(t.values()) for t in detail.tail)
    assert sim.makespan + tail == pytest.approx(detail.step_s, rel=1e-6)
    assert plan.predicted is None  # the plan's own prediction is not the timeline's to change (test_one_prediction)
    assert {e.kind for e in sim.events} >= {"F", "B", "evict", "load"}
    assert all(s > 0 for s in detail.static_bytes) and all(p > s for p, s in zip(detail.peak_bytes, detail.static_bytes))


def test_png_and_svg(bpipe, tmp_path):
    plan, sim, detail = bpipe
    png = draw_timeline(sim, plan, tmp_path / "t.png", detail=detail)
    img = matplotlib.image.imread(png)
    assert img.shape[1] > 800 and 300 < img.shape[0] < 3000
    svg = draw_timeline(sim, plan, tmp_path / "t.svg")  # without detail: whole events, memory in microbatches
    assert ET.parse(svg).getroot().tag.endswith("svg")
    with pytest.raises(ValueError, match="png"):
        draw_timeline(sim, plan, tmp_path / "t.jpg")


def test_trace_records_merges_and_draws(bpipe, tmp_path):
    plan, sim, detail = bpipe
    per_rank = []
    for rank in (0, 1):
        t = StepTrace()
        t.begin()
        with t.span(rank, "F", 0):
            pass
        with t.span(rank, "B", 0):
            pass
        t.add(rank, "optimizer", -1, t.duration, t.duration + 1e-3)
        per_rank.append(pickle.loads(pickle.dumps(t)))  # as all_gather_object would carry it
    merged = StepTrace.merge(per_rank)
    assert merged.ranks == [0, 1] and len(merged.spans) == 6
    assert [s.kind for s in merged.spans if s.rank == 1] == ["F", "B", "optimizer"]
    assert all(0 <= s.start <= s.end for s in merged.spans)
    assert StepTrace.from_dict(merged.to_dict()).spans == merged.spans
    assert set(KINDS) <= set(COLOURS)  # every kind an engine may record has its colour
    out = draw_timeline(sim, plan, tmp_path / "m.png", measured=merged, detail=detail)
    assert out.stat().st_size > 10_000


def test_an_accelerator_allocator_peak_is_logged_beside_the_tracked_one(monkeypatch):
    """GPU runs log torch's max_memory_allocated/reserved per interval (reset each time); CPU runs do not."""
    import torch

    from snugfit.train.metrics import compare_line, measured_memory

    class Engine:
        memory = None

    assert "allocator_peak_bytes" not in measured_memory(Engine())
    resets = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda: 4 * 2**20)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", lambda: resets.append(1))
    record = {"step": 5, "loss": 1.0, "step_time_s": 0.1, **measured_memory(Engine())}
    assert (record["allocator_peak_bytes"], record["allocator_reserved_bytes"], resets) == ([3 * 2**20], [4 * 2**20], [1])
    assert "allocator MiB 3.0 (reserved 4.0)" in compare_line(record)


def test_each_row_of_a_tp_pipeline_is_the_estimate_of_its_rank():
    """tp 2 x pp 2: a row stands for pipeline rank r's dp x tp ranks and draws the estimate of its first rank,
    plan.layout.rank(r) (rank 2 for the second row; its tensor-parallel peer rank 1 belongs to the first)."""
    from snugfit.plan.estimate import estimate_step
    from snugfit.plan.memory import device_bytes
    from snugfit.report.timeline import _memory_curve, _predicted_rows, stage_detail

    plan = _plan(tp=2, pp=2, num_microbatches=4, block=BlockPlan(activations="selective"))
    est = estimate_step(plan, synthetic_profile(), parse_cluster("4xRTX4090"))
    sim, detail = timeline_for(plan, synthetic_profile(), parse_cluster("4xRTX4090"))
    assert detail == stage_detail(est, plan)
    rows, _, end = _predicted_rows(sim, detail, plan.pp, plan.virtual_stages)
    firsts = [plan.layout.rank(r) for r in range(plan.pp)]
    assert firsts == [0, 2]
    for r, first in enumerate(firsts):
        mine = est.rank(first)
        cats = plan.predicted.memory_by_rank[first]
        assert detail.peak_bytes[r] == device_bytes(cats) == device_bytes(mine.memory.cats)
        assert detail.tail[r] == mine.tail
        # the row's bars after the pipeline drains are that rank's tail, in order, and end at its step time
        after = [(kind, w) for kind, bars in rows[r].items() for s, w in bars if s >= sim.makespan - 1e-12
                 and kind in mine.tail]
        assert sorted(after) == sorted((k, w) for k, w in mine.tail.items() if w > 0)
        assert sim.makespan + sum(mine.tail.values()) <= plan.predicted.step_time_s + 1e-12
        # its memory curve starts from that rank's static bytes
        _, ys = _memory_curve(sim, r, detail)
        assert min(ys) * 2**30 == pytest.approx(detail.static_bytes[r], rel=1e-9)
        # its compute events are its own stages', at the times the estimate simulated
        assert {e.stage for e in sim.events if e.rank == r} == set(plan.stages_of(r))
    assert detail.peak_bytes[0] != detail.peak_bytes[1]  # the rows differ: embedding on one, head on the other
    assert end == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
