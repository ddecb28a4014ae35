"""The footprint (a rank's memory at each named moment of its step), its named once-per-stage buffers, and the
step's time terms assembled once."""

import pytest

from snugfit.hardware import parse_cluster
from snugfit.plan.estimate import estimate_step
from snugfit.plan.footprint import MOMENTS, StageBuffers, largest_tensor_bytes, stage_moments
from snugfit.plan.plan import BlockPlan
from snugfit.plan.piece_memory import StagePiece, gathered_bytes, prefetched_part
from snugfit.plan.placement import Placement
from snugfit.plan.stage_costs import Cost
from snugfit.plan.step_terms import step_terms
from snugfit.plan.timing import StageTime
from tests.test_memory_model import _plan, synthetic_profile


def test_stage_buffers_are_named_by_what_needs_them():
    b = StageBuffers(zero3_copies=8.0, activation_window=4.0, checkpoint_window=2.0, states_window=1.0, prefetched=3.0)
    assert StageBuffers.needs(BlockPlan(zero=3, activations="offload")) == {"zero3_copies", "activation_window"}
    assert StageBuffers.needs(BlockPlan(activations="recompute_offload")) == {"checkpoint_window"}
    assert StageBuffers.needs(BlockPlan(zero=3, placement=Placement.STREAMED)) == {"zero3_copies", "states_window"}
    assert StageBuffers.needs(BlockPlan(zero=3, placement=Placement.STREAMED), root=True) == {"zero3_copies"}
    assert StageBuffers.needs(BlockPlan(zero=2)) == frozenset()
    assert b.extra(BlockPlan(zero=3, activations="offload")) == 12.0  # `prefetched` is part of the copies, no buffer
    # every subset of what is asked for, once, the empty one first (the knapsack solves one table for each)
    subsets = b.subsets(frozenset({"zero3_copies", "states_window"}))
    assert list(subsets) == [frozenset(), {"zero3_copies"}, {"states_window"}, {"zero3_copies", "states_window"}]


@pytest.mark.parametrize("ep", [1, 2])
def test_zero3_copies_are_a_block_whole_and_what_fsdp2_prefetches_of_the_next(ep):
    """A dense block is one FSDP2 unit: two blocks' copies. Under ep a block's experts are a unit inside it, which
    FSDP2 gathers only once the block's backward reaches them: the running block whole and the next one's dense
    part, in the search's buffers (StageBuffers.of_block) as in the footprint (test_expert_parallel checks it)."""
    prof = synthetic_profile()
    experts = (4_000_000, 2_000_000)  # of block_params: its 3-D expert weights, split over ep
    plan = _plan(dp=4, ep=ep, block=BlockPlan(zero=3))
    sp = StagePiece(prof.blocks[0], plan.blocks[0], prof.blocks[0].num_params, experts=experts)
    whole = 10_000_000 * 2
    dense = whole if ep == 1 else (10_000_000 - sum(experts)) * 2
    b = StageBuffers.of_block(plan, sp)
    assert (b.zero3_copies, b.prefetched) == (whole + dense, dense)
    assert gathered_bytes(plan, sp) == (whole if ep == 1 else dense + sum(experts) // ep * 2)
    assert gathered_bytes(plan, prefetched_part(plan, sp)) == dense


def test_stage_moments_bound_a_stage_by_its_passes_and_its_roots_reduce():
    block = Cost(static=100, grads=30, grads_reduced=10, act=7, t_mb=1.0, t_step=0.0)
    root = Cost(static=50, grads=20, grads_reduced=5, act=3, t_mb=1.0, t_step=0.0, at_root=-4)
    at = stage_moments(4, block, [root], resident=2, m=2, walk=11, buffers=13, root_reduce=17, prefetched=19)
    assert at.passes == 11 + (50 + 20 + 2 * 3) + 4 * (100 + 30 + 2 * 7) + 13
    assert at.root_reduce == 50 + 4 * 100 + 4 * 10 + 17 - 4 + 19 and at.static == 450
    assert at.peak == max(at.passes, at.root_reduce)
    one = stage_moments(4, block, [root], resident=2, m=1, walk=11, buffers=13, root_reduce=17, prefetched=19)
    assert one.passes == at.passes - 4 * (30 - 10) - (20 - 5)  # one microbatch: only the reduced shards


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_ranks_peak_is_its_busiest_named_moment(in_backward):
    prof, cluster = synthetic_profile(), parse_cluster("4xA100-80GB")
    plan = _plan(dp=4, block=BlockPlan(zero=3), num_microbatches=2, grad_reduce="microbatch")
    plan.optimizer.in_backward = in_backward
    est = estimate_step(plan, prof, cluster)
    fp = est.ranks[0].memory.footprint
    assert set(fp.moments) == set(MOMENTS) - ({"step"} if in_backward else set())
    assert fp.moments[fp.peak].total == max(m.total for m in fp.moments.values())
    cats = est.prediction.memory_by_rank[0]
    device = sum(v for k, v in cats.items() if not k.startswith("host:") and k != "reserve")
    assert device == sum(fp.static.values()) + fp.moments[fp.peak].total
    # at the reduce, FSDP2 holds the reduce-scatter input
    assert fp.moments["reduce"].cats["reduce_buffers"] > 0
    startup = prof.scaled(plan.micro_batch_size).split(1)
    assert est.prediction.startup_bytes["device"] == fp.startup.total == (
        fp.static["parameters"] + fp.static.get("frozen_parameters", 0) + largest_tensor_bytes(startup))


@pytest.mark.parametrize("every", [False, True])
def test_step_terms_add_up_alike_for_estimate_and_the_stage_costs(every):
    """estimate()'s phases over m microbatches are m of the stage costs' per-microbatch seconds and their step's."""
    st = StageTime(fwd=1.0, bwd=2.0, recompute=0.5, comm_exposed=0.25, offload_exposed=0.5, tp_fwd=0.125,
                   tp_bwd=0.125, split_host=0.0625, update=0.75)
    terms = step_terms([(st, 2)], reduce=2.0, host_step=3.0, device_step=4.0, every_microbatch=every, split=True)
    m = 4
    phases = terms.phases(m, bubble=0.75)
    assert list(phases)[:3] == ["compute", "recompute", "bubble"]
    assert phases["recompute"] == m * 2 * 0.5  # a split backward's W recomputes again
    assert phases["dp_comm_exposed"] == m * 0.25 + (m * 2.0 if every else 2.0)
    assert phases["offload_exposed"] == m * 0.5 + 3.0 and phases["optimizer"] == 4.75
    assert sum(phases.values()) - 0.75 == pytest.approx(m * terms.t_microbatch + terms.t_step)
    assert terms.t_step == 3.0 + 4.75 + (0.0 if every else 2.0)
    assert terms.tail(m) == {"collective": terms.reduces(m), "host optimizer": 3.0, "optimizer": 4.75}
