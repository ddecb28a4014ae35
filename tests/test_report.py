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
    assert sim.makespan + tail == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
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
