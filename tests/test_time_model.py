"""Time model: collectives, pipeline bubbles, overlap, recompute, offload, and heterogeneous ranks."""

import pytest

from snugfit.hardware import get_link, parse_cluster
from snugfit.plan.estimate import estimate
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.simulate import simulate
from snugfit.plan.timing import piece_compute, ring_time
from tests.test_memory_model import _plan, synthetic_profile


def test_ring_collectives():
    link = get_link("pcie4")
    big = 1e9
    assert ring_time("all_gather", big, 1, link) == 0.0
    ag = ring_time("all_gather", big, 4, link)
    assert ag == pytest.approx(3 * link.latency_s + 0.75 * big / (link.gbps * 1e9))
    assert ring_time("all_reduce", big, 4, link) == pytest.approx(2 * ag)
    assert ring_time("reduce_scatter", big, 4, get_link("eth-10g")) > 10 * ag


def test_1f1b_bubble_is_p_minus_1_stage_times():
    p, m, f, b = 4, 8, 1.0, 2.0
    sim = simulate("1f1b", p, m, [f] * p, [b] * p)
    assert sim.makespan == pytest.approx((m + p - 1) * (f + b))
    assert all(sim.bubble(r) == pytest.approx((p - 1) * (f + b)) for r in range(p))


def test_interleaving_halves_the_bubble():
    p, m = 4, 8
    plain = simulate("1f1b", p, m, [1.0] * p, [2.0] * p)
    inter = simulate("interleaved", p, m, [0.5] * 2 * p, [1.0] * 2 * p, v=2)
    assert inter.bubble(0) == pytest.approx(plain.bubble(0) / 2, rel=0.05)


def test_no_pipeline_no_bubble_and_accumulation_scales():
    prof, cl = synthetic_profile(), parse_cluster("A100-80GB")
    one = estimate(_plan(num_microbatches=1), prof, cl)
    four = estimate(_plan(num_microbatches=4), prof, cl)
    assert one.time_by_phase["bubble"] == pytest.approx(0.0, abs=1e-9)
    assert four.time_by_phase["compute"] == pytest.approx(4 * one.time_by_phase["compute"])
    assert four.tokens_per_s > one.tokens_per_s  # the optimizer step is amortised


def test_phases_sum_to_step_time():
    prof, cl = synthetic_profile(), parse_cluster("2x4xRTX4090")
    plan = _plan(dp=4, pp=2, num_microbatches=8, block=BlockPlan(zero=3, activations="selective"))
    pred = estimate(plan, prof, cl)
    assert sum(pred.time_by_phase.values()) == pytest.approx(pred.step_time_s)
    assert pred.time_by_phase["bubble"] > 0 and pred.time_by_phase["dp_comm_exposed"] > 0
    assert 0 < pred.mfu < 1


def test_recompute_adds_a_forward_selective_less():
    prof, cl = synthetic_profile(), parse_cluster("A100-80GB")
    t = {pol: estimate(_plan(block=BlockPlan(activations=pol)), prof, cl).time_by_phase["recompute"]
         for pol in ("keep", "selective", "recompute")}
    fwd = sum(piece_compute(b, cl.gpu_of(0), "bfloat16", None)[0] for b in prof.blocks)
    assert t["keep"] == 0 and t["recompute"] == pytest.approx(fwd) and 0 < t["selective"] < t["recompute"]


def test_slow_link_exposes_zero3_communication():
    prof = synthetic_profile()
    plan = _plan(dp=8, block=BlockPlan(zero=3), root=BlockPlan(zero=3))
    fast = estimate(plan, prof, parse_cluster("8xH100-80GB"))
    slow = estimate(plan, prof, parse_cluster("8x1xH100-80GB", inter="eth-10g"))
    assert slow.time_by_phase["dp_comm_exposed"] > 10 * fast.time_by_phase["dp_comm_exposed"]
    assert slow.step_time_s > fast.step_time_s


def test_host_optimizer_and_faster_gpus():
    prof = synthetic_profile()
    cl = parse_cluster("RTX4090")
    dev = estimate(_plan(), prof, cl)
    host = estimate(_plan(block=BlockPlan(offload_optimizer=True), root=BlockPlan(offload_optimizer=True)), prof, cl)
    assert host.time_by_phase["optimizer"] < dev.time_by_phase["optimizer"]
    assert host.step_time_s >= dev.step_time_s - dev.time_by_phase["optimizer"]
    assert estimate(_plan(), prof, parse_cluster("H100")).step_time_s < estimate(_plan(), prof, parse_cluster("T4")).step_time_s


def test_slowest_data_parallel_member_sets_the_pace():
    prof = synthetic_profile()
    plan = _plan(dp=2)
    mixed = estimate(plan, prof, parse_cluster("RTX4090+RTX3090"))
    fast = estimate(plan, prof, parse_cluster("2xRTX4090"))
    assert mixed.step_time_s > fast.step_time_s


def test_measured_piece_times_are_used_on_their_device():
    prof = synthetic_profile()
    prof.device = "cpu"
    for p in prof.pieces:
        p.fwd_time_s, p.bwd_time_s = 0.01, 0.02
    pred = estimate(Plan.uniform(8, seq_len=1024, compute_dtype="bfloat16", num_microbatches=2), prof,
                    parse_cluster("cpu"))
    assert pred.time_by_phase["compute"] == pytest.approx(2 * 10 * 0.03)
