"""The plan-wide layout (plan.shape): one Shape carried whole, the rules' parts derived from it, and RankLayout the
one place ranks and groups are computed; a unit's placement (plan.placement) one value."""

from dataclasses import fields, replace

import pytest

from snugfit.plan import BlockPlan, Placement, Plan
from snugfit.plan.facts import ModelFacts
from snugfit.plan.options import Constraints, block_options
from snugfit.plan.rules import Parts, parts_of
from snugfit.plan.shape import RankLayout, Shape


def test_rank_layout_numbers_every_rank_once_with_tp_innermost_and_cp_next():
    layout = RankLayout(pp=2, dp=3, cp=2, tp=2)
    seen = set()
    for pp in range(2):
        for dp in range(3):
            for cp in range(2):
                for tp in range(2):
                    r = layout.rank(pp, dp, tp, cp)
                    assert layout.coords(r) == (pp, dp, tp) and layout.cp_rank(r) == cp
                    seen.add(r)
    assert seen == set(range(24))
    assert layout.tp_group(5) == [4, 5]  # neighbours
    assert layout.dp_group(1) == [1, 5, 9]  # a stride of cp x tp
    assert layout.pipeline_group(3) == [3, 15]
    assert layout.stage_ranks(1) == list(range(12, 24))
    assert Shape(dp=3, cp=2, tp=2, pp=2).world_size == 24 and Shape(dp=2, ep=2).world_size == 2  # ep within dp


def test_a_plan_and_a_candidate_read_their_shape_and_cannot_change_a_part_of_it():
    from snugfit.plan.candidates import Candidate

    plan = Plan.uniform(4, dp=2, pp=2, num_microbatches=2)
    assert (plan.dp, plan.pp, plan.schedule, plan.world_size) == (2, 2, "1f1b", 4) == (
        plan.shape.dp, plan.shape.pp, plan.shape.schedule, plan.shape.world_size)
    with pytest.raises(AttributeError):
        plan.dp = 1
    cand = Candidate(plan.shape)
    assert cand.num_microbatches == 2 and {cand.shape: 1}[replace(plan.shape)] == 1  # the caches key on it


def test_the_rules_parts_are_shapes_fields_all_optional_and_read_off_any_holder():
    names = [f.name for f in fields(Parts)]
    assert names[:len(fields(Shape))] == [f.name for f in fields(Shape)]
    assert all(v is None for v in vars(Parts()).values())
    shape = Shape(dp=2, tp=2, schedule="none", compile=True)
    assert parts_of(shape).tp == 2 and parts_of(shape).compile
    fixed = Constraints(tp=2).parts()
    assert (fixed.tp, fixed.pp, fixed.compile, fixed.placement) == (2, None, None, None)


def test_expert_and_context_parallelism_run():
    plan = Plan(shape=Shape(ep=2, dp=2), stage_blocks=[1], blocks=[BlockPlan()])
    assert plan.rule_broken(ModelFacts(n_experts=4, top_k=2)) is None
    assert Plan(shape=Shape(cp=2), stage_blocks=[1], blocks=[BlockPlan()]).rule_broken() is None


def test_the_search_offers_the_placements_the_offload_options_leave():
    def placements(c: Constraints) -> set[Placement]:
        return {o.placement for o in block_options(c, dp=2)}

    everything = set(Placement)
    assert placements(Constraints()) == everything
    assert placements(Constraints(offload_optimizer="none")) == {Placement.DEVICE, Placement.PARAMS_ON_HOST}
    assert placements(Constraints(offload_optimizer="all")) == {Placement.HOST_STEP}
    assert placements(Constraints(offload_params=True)) == {Placement.PARAMS_ON_HOST}
    assert placements(Constraints(offload_params=False)) == everything - {Placement.PARAMS_ON_HOST}
    assert all(o.zero == 3 for o in block_options(Constraints(), dp=2) if o.placement.params_on_host)
